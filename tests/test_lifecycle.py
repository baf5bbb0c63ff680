"""Engine lifecycle (issue 28): LLMs one after another in one process, ``shutdown()``, ``with LLM(...)``, and
``del llm``: each releases the weights, the KV cache and the tensor-parallel workers and process group."""
from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import weakref

import pytest

from helpers import build_tiny_model
from lqe import LLM, SamplingParams
from lqe.distributed.parallel_state import get_tp_size

KW = dict(kv_cache_memory_bytes=8 << 20, max_model_len=128)
PROMPTS = [[1, 520, 3100, 28, 9874, 41, 1023], [1, 5, 6, 7]]
SP = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("lifecycle") / "m"), "llama", tokenizer=False)


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, SP, use_tqdm=False)]


def _tp_children() -> list[str]:
    return [p.name for p in mp.active_children() if p.name.startswith("lqe-tp")]


def _held(llm: LLM) -> list[weakref.ref]:
    """Weak references to what the engine must release: the model, its weights and the KV cache."""
    runner = llm.llm_engine.runner
    return [weakref.ref(runner), weakref.ref(runner.model), weakref.ref(runner.kv_cache),
            weakref.ref(next(runner.model.parameters()))]


def test_shutdown_releases_and_is_idempotent(model_dir):
    llm = LLM(model_dir, **KW)
    first = _tokens(llm)
    held = _held(llm)
    llm.shutdown()
    llm.shutdown()
    assert [r() for r in held] == [None] * len(held), "weights / KV cache still referenced after shutdown()"
    with pytest.raises(RuntimeError, match="shut down.*create a new LLM"):
        llm.generate(PROMPTS, SP, use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        next(llm.stream(PROMPTS[0], SP))
    again = LLM(model_dir, **KW)
    assert _tokens(again) == first


def test_shutdown_with_an_async_step_in_flight_releases(model_dir):
    """async_scheduling: a step still in flight at shutdown (an abandoned stream) holds the model runner; shutdown
    drops it with everything else."""
    llm = LLM(model_dir, async_scheduling=True, **KW)
    eng = llm.llm_engine
    eng.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.async_stepper.inflight is not None
    held = _held(llm)
    llm.shutdown()
    gc.collect()
    assert [r() for r in held] == [None] * len(held), "a step in flight kept the runner alive after shutdown()"


def test_with_block_and_del_release(model_dir):
    with LLM(model_dir, **KW) as llm:
        toks = _tokens(llm)
        held = _held(llm)
    assert llm.llm_engine.is_closed and [r() for r in held] == [None] * len(held)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS, SP, use_tqdm=False)

    llm = LLM(model_dir, **KW)
    held = _held(llm)
    assert _tokens(llm) == toks
    del llm
    gc.collect()
    assert [r() for r in held] == [None] * len(held), "del llm + gc did not release the engine"


def test_with_block_shuts_down_on_error(model_dir):
    with pytest.raises(ZeroDivisionError):
        with LLM(model_dir, **KW) as llm:
            1 / 0
    assert llm.llm_engine.is_closed


def test_tensor_parallel_twice_in_one_process(model_dir):
    """TP=2, then a TP=1 engine beside it, a refused second TP engine, ``del``, and a second TP=2 in a ``with``:
    the same tokens every time and no worker left behind."""
    tp1 = LLM(model_dir, **KW)
    ref = _tokens(tp1)

    llm = LLM(model_dir, tensor_parallel_size=2, **KW)
    procs = list(llm.llm_engine.tp.procs)
    assert _tokens(llm) == ref
    assert get_tp_size() == 1, "the driver's tensor-parallel size leaked out of the engine's steps"
    assert _tokens(tp1) == ref  # a TP=1 engine runs beside a live TP=2 one, with no collective
    with pytest.raises(RuntimeError, match=r"tensor_parallel_size=2.*still alive.*shutdown\(\)"):
        LLM(model_dir, tensor_parallel_size=2, **KW)
    assert _tokens(llm) == ref  # the refused one broke nothing
    held = _held(llm)
    del llm
    gc.collect()
    for p in procs:
        p.join(timeout=15)
    assert not any(p.is_alive() for p in procs) and all(p.exitcode == 0 for p in procs), "workers not stopped cleanly"
    assert [r() for r in held] == [None] * len(held)

    with LLM(model_dir, tensor_parallel_size=2, **KW) as llm2:
        procs = list(llm2.llm_engine.tp.procs)
        assert _tokens(llm2) == ref
    for p in procs:
        p.join(timeout=15)
    assert not _tp_children()
    assert all(p.exitcode == 0 for p in procs)
    tp1.shutdown()


def test_server_engine_close_goes_through_shutdown(model_dir):
    """``lqe serve`` closes its AsyncEngine, which shuts the engine down through the same path."""
    from lqe.entrypoints.async_engine import AsyncEngine

    llm = LLM(model_dir, **KW)
    held = _held(llm)
    engine = AsyncEngine(llm.llm_engine)

    async def run():
        await engine.start()
        await engine.shutdown()

    asyncio.run(run())
    engine.close()
    assert llm.llm_engine.is_closed
    assert [r() for r in held] == [None] * len(held)
