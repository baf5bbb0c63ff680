"""Async scheduling (lqe.engine.async_steps), on CPU: step N+1 is scheduled and launched before step N's tokens
reach the host (placeholders in its host inputs, filled on the device from step N's sampled ids); the generated
tokens equal the synchronous engine's, with continuous batching, chunked prefill, prefix caching, preemption,
seeded sampling, stop tokens, logprobs, and steps that must wait (penalties)."""
import random

import pytest

from lqe import LLM, SamplingParams
from lqe.engine.async_steps import PLACEHOLDER
from lqe.engine.cuda_graph import EagerPaddedRunner
from lqe.engine.graph_backends import RecordingBackend


def _workload(n, seed=0, vocab=49000):
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(24)]
    prompts, params = [], []
    for i in range(n):
        prompts.append((shared if i % 2 else []) + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 60))])
        kw = dict(max_tokens=rng.randrange(1, 16), ignore_eos=True)
        if i % 4 == 3:
            params.append(SamplingParams(temperature=0.8, top_k=50, seed=7 + i, **kw))
        elif i % 5 == 1:
            params.append(SamplingParams(temperature=0, logprobs=2, **kw))
        else:
            params.append(SamplingParams(temperature=0, **kw))
    return prompts, params


def _run(model_dir, async_scheduling, prompts, params, graphs=False, **kw):
    llm = LLM(model_dir, kv_cache_memory_bytes=64 << 20, max_model_len=128, max_num_batched_tokens=48, max_num_seqs=6,
              max_cudagraph_batch=4, async_scheduling=async_scheduling, **kw)
    if graphs:  # the graph paths' input handling, on CPU: padded decode buckets and recorded piecewise pieces
        runner = llm.llm_engine.runner
        runner.capture_cuda_graphs(EagerPaddedRunner)
        runner.capture_piecewise(RecordingBackend(), [16, 32, 48])
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason,
                  [sorted(d) for d in (o.outputs[0].logprobs or [])]) for o in outs]


@pytest.mark.parametrize("num_kv_blocks,graphs", [(None, False), (14, False), (14, True)])
def test_async_tokens_equal_sync(tiny_llama_dir, num_kv_blocks, graphs):
    prompts, params = _workload(12)
    kw = {} if num_kv_blocks is None else {"num_kv_blocks": num_kv_blocks}
    _, want = _run(tiny_llama_dir, False, prompts, params, **kw)
    llm, got = _run(tiny_llama_dir, True, prompts, params, graphs=graphs, **kw)
    assert got == want
    eng = llm.llm_engine
    if graphs:
        assert eng.runner.steps_by_path["decode_graph"] > 0 and eng.runner.steps_by_path["piecewise"] > 0
    assert eng.async_stepper.overlapped > 10 and eng.async_stepper.inflight is None and not eng.has_unfinished()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    if num_kv_blocks:
        assert eng.scheduler.num_preemptions > 0
    else:
        assert eng.block_manager.hits > 0


def test_async_stops_and_waiting_steps(tiny_llama_dir):
    """A stop token ends a sequence already scheduled again (its extra row is dropped); max_model_len ends others;
    a request with a repetition penalty makes its steps wait for the previous tokens; outputs never show a
    placeholder."""
    prompts, params = _workload(8, seed=3)
    _, free = _run(tiny_llama_dir, False, prompts[:1], [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)])
    stop_at = free[0][0][4]
    params[0] = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at])
    params[2] = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)  # runs into max_model_len
    params[5] = SamplingParams(temperature=0, max_tokens=9, repetition_penalty=1.3, ignore_eos=True)
    _, want = _run(tiny_llama_dir, False, prompts, params)
    llm, got = _run(tiny_llama_dir, True, prompts, params)
    assert got == want
    assert got[0][1] == "stop" and got[0][0][-1] == stop_at and got[2][1] == "length"
    assert all(PLACEHOLDER not in t for t, _, _ in got)
    streamed = []
    eng = llm.llm_engine
    eng.add_request("s", prompts[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    eng.add_request("t", prompts[3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while eng.has_unfinished():
        streamed += [t for o in eng.step() for t in o.outputs[0].token_ids]
    assert streamed and PLACEHOLDER not in streamed


def test_async_abort_mid_flight(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=32 << 20, max_model_len=128, async_scheduling=True)
    eng = llm.llm_engine
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    eng.add_request("a", list(range(5, 30)), p)
    eng.add_request("b", list(range(40, 52)), p)
    for _ in range(4):
        eng.step()
    assert eng.async_stepper.inflight is not None
    eng.abort_request("a")
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    final = [o for o in outs if o.request_id == "b" and o.finished]
    assert len(final) == 1 and len(final[0].outputs[0].token_ids) == 20
    assert all(o.request_id != "a" for o in outs)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
