"""GPU: piecewise CUDA graphs of mixed and prefill steps (lqe.engine.piecewise, issue 26), float and W4A16 models.

* Replaying the pieces is the same arithmetic as the eager forward of the same padded step: an engine whose
  piecewise replay is swapped for the eager forward of the padded inputs gives the same tokens and logprobs.
* Against the plain eager engine (``enforce_eager=True``: unpadded GEMMs, no graphs) tokens agree except at a near
  tie (test_model_matrix's rule; padding changes GEMM tiles in bf16).
* Steady-state mixed steps make no device-to-host sync besides the one of ``ModelRunner.to_host_start``
  (``torch.cuda.set_sync_debug_mode("error")``; the event wait of ``to_host_wait`` is not a stream sync).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from test_model_matrix import FORMATS, check_same_greedy, gen_requests, release_memory  # noqa: E402,F401
from test_model_matrix import build_checkpoints as _build_matrix  # noqa: E402

W4A16 = "gptq-v1-sym-g128"
CASES = ["base-base", W4A16]
TOL = (0.15, 0.25)  # (LP_TOL, NEAR_TIE) of check_same_greedy for bf16 and weight-only formats
ENGINE = dict(device="cuda", dtype="bfloat16", cudagraph_mode="FULL_AND_PIECEWISE", max_num_seqs=8, max_cudagraph_batch=8,
              max_num_batched_tokens=192,
              num_kv_blocks=48, block_size=8, max_model_len=160, enable_prefix_caching=True)


def build_checkpoints(root: str, names: list[str] | None = None) -> dict[str, str]:
    """The float bases and the W4A16 checkpoint these tests load."""
    return _build_matrix(root, [W4A16] if names is None else names)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return build_checkpoints(str(tmp_path_factory.mktemp("piecewise")))


def _generate(model_dir: str, mode: str) -> tuple[list, dict, list[int]]:
    """``mode``: "piecewise" (graphs), "padded_eager" (same engine, each piecewise replay swapped for the eager
    forward of the same padded inputs) or "eager" (enforce_eager)."""
    from lqe import LLM, SamplingParams
    from lqe.forward_context import ForwardContext, set_forward_context

    prompts, lengths = gen_requests(16, seed=1)
    prompts = [p * 2 for p in prompts]  # 2-118 tokens: prefill chunks of several buckets beside decodes
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in lengths]
    llm = LLM(model_dir, enforce_eager=mode == "eager", **ENGINE)
    runner = llm.llm_engine.runner
    used: list[int] = []
    if mode == "eager":
        assert runner.piecewise is None and runner.graph_runner is None
    else:
        pw = runner.piecewise
        assert pw is not None and pw.buckets == [64, 128, 192], pw and pw.buckets
        assert all(len(g.pieces) == runner.model_cfg.num_hidden_layers + 1 for g in pw.graphs.values())
        replay = pw.run

        def eager_padded(bucket, inp):
            with set_forward_context(ForwardContext(inp.meta, runner.kv_caches)):
                return runner.model(inp.input_ids, inp.positions)
        run = replay if mode == "piecewise" else eager_padded
        pw.run = lambda bucket, inp: (used.append(bucket), run(bucket, inp))[1]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = dict(runner.steps_by_path, preemptions=llm.llm_engine.scheduler.num_preemptions)
    llm = runner = None  # rebound, not del: eager_padded reads runner
    release_memory()
    return outs, stats, used


@pytest.mark.parametrize("name", CASES)
def test_piecewise_replay_equals_padded_eager(name, checkpoints):
    g, g_stats, g_used = _generate(checkpoints[name], "piecewise")
    e, e_stats, e_used = _generate(checkpoints[name], "padded_eager")
    assert g_used == e_used and len(set(g_used)) >= 2, (g_used, e_used)  # the same steps, several buckets
    assert g_stats["eager"] == 0 and g_stats["piecewise"] > 0 and g_stats["decode_graph"] > 0, g_stats
    for i, (a, b) in enumerate(zip(e, g)):
        assert list(a.token_ids) == list(b.token_ids), f"request {i}: piecewise {b.token_ids} != padded eager {a.token_ids}"
        lp = max(abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids))
        assert lp < 1e-3, f"request {i}: logprobs differ by {lp} (replay should be the eager arithmetic)"


@pytest.mark.parametrize("name", CASES)
def test_piecewise_engine_equals_eager_engine(name, checkpoints):
    g, g_stats, _ = _generate(checkpoints[name], "piecewise")
    e, e_stats, _ = _generate(checkpoints[name], "eager")
    assert e_stats["piecewise"] == 0 and e_stats["eager"] > 0
    counts = check_same_greedy(e, g, *TOL)
    assert counts["exact"] >= len(e) // 2, counts


def test_mixed_steps_make_one_host_sync(checkpoints):
    """Steady state: decodes beside prefill chunks, greedy; under sync debug mode "error" no step syncs the host
    except through to_host_start (once per step), and the steps ran the piecewise graphs."""
    from lqe import LLM, SamplingParams

    llm = LLM(checkpoints["base-base"], **{**ENGINE, "num_kv_blocks": 256, "enable_prefix_caching": False})
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    p = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"d{i}", [3 + i] * 20, p)
    for _ in range(3):  # prefills, then decodes
        engine.step()

    def mixed_steps(tag: str, n: int) -> int:
        syncs = 0
        for j in range(n):
            engine.add_request(f"{tag}{j}", [7 + j] * 40, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            before = runner.host_syncs
            engine.step()  # 4 decodes + one 40-token prefill: bucket 64
            syncs += runner.host_syncs - before
        return syncs

    mixed_steps("warm", 3)  # first use of every kernel shape outside the check
    before = dict(runner.steps_by_path)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        syncs = mixed_steps("m", 6)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert syncs == 6
    assert runner.steps_by_path["piecewise"] - before["piecewise"] == 6, (before, runner.steps_by_path)
    llm = engine = runner = None  # rebound, not del: mixed_steps reads engine and runner
    release_memory()


def test_async_scheduling_equals_sync(checkpoints):
    """async_scheduling=True (step N+1 launched before step N's tokens reach the host; pending tokens scattered on
    the device into the decode-graph and piecewise inputs) gives the synchronous engine's tokens by the near-tie
    rule (a finishing sequence frees its slot a step later, so batches, hence bf16 GEMM tiles, may differ)."""
    from lqe import LLM, SamplingParams

    prompts, lengths = gen_requests(16, seed=2)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in lengths]
    runs = {}
    for flag in (False, True):
        llm = LLM(checkpoints["base-base"], async_scheduling=flag, **ENGINE)
        runs[flag] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        if flag:
            stepper, paths = llm.llm_engine.async_stepper, llm.llm_engine.runner.steps_by_path
            assert stepper.overlapped > 10 and paths["decode_graph"] > 0 and paths["piecewise"] > 0, paths
        del llm
        release_memory()
    counts = check_same_greedy(runs[False], runs[True], *TOL)
    assert counts["exact"] >= len(prompts) // 2, counts
