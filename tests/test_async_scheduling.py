"""Async scheduling (lqe.engine.async_steps), on CPU: step N+1 is scheduled and launched before step N's tokens
reach the host (placeholders in its host inputs, filled on the device from step N's sampled ids); the generated
tokens equal the synchronous engine's, with continuous batching, chunked prefill, prefix caching, preemption,
seeded sampling, stop tokens, logprobs, and steps that must wait (penalties)."""
import random
import re

import pytest

from lqe import LLM, SamplingParams
from lqe.sampling_params import StructuredOutputsParams
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


def _full(outs):
    """Everything a caller can read from the outputs but the timings: ``(exact part, logprob values)``. The values
    are compared with a tolerance: a sequence's batch can differ with async scheduling (a finishing sequence
    frees its slot one step later), and the CPU matmuls' rounding depends on the batch."""
    values = []

    def lp(d):
        if d is None:
            return None
        values.extend(v.logprob for v in d.values())
        return {t: v.rank for t, v in d.items()}
    exact = [(o.request_id, [(c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason,
                              c.cumulative_logprob is None, None if c.logprobs is None else [lp(d) for d in c.logprobs])
                             for c in o.outputs],
              None if o.prompt_logprobs is None else [lp(d) for d in o.prompt_logprobs]) for o in outs]
    values += [c.cumulative_logprob for o in outs for c in o.outputs if c.cumulative_logprob is not None]
    return exact, values


def test_async_per_request_features_equal_sync(tiny_llama_dir):
    """Prompt logprobs, logprobs, stop strings, n > 1 with seeds, logit_bias, min_tokens, penalties and structured
    output give the synchronous engine's outputs with async scheduling (prompt logprobs used to come back as
    ``[None]``: the step that computes them went through the launch path, which keeps no hidden states for them)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49000) for _ in range(n)] for n in (20, 7, 33, 12, 5, 26, 9, 15, 11)]
    greedy = dict(temperature=0, ignore_eos=True)
    _, free = _run(tiny_llama_dir, False, prompts[3:4], [SamplingParams(max_tokens=10, **greedy)])
    llm0 = LLM(tiny_llama_dir, kv_cache_memory_bytes=16 << 20, max_model_len=128)
    stop_text = llm0.get_tokenizer().decode(free[0][0][3:5])
    llm0.shutdown()
    params = [
        SamplingParams(max_tokens=6, prompt_logprobs=1, **greedy),
        SamplingParams(max_tokens=8, logprobs=3, prompt_logprobs=0, temperature=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=3, logprobs=1, ignore_eos=True),
        SamplingParams(max_tokens=10, stop=[stop_text], **greedy),
        SamplingParams(max_tokens=7, logit_bias={17: 40.0, 23: 39.5}, temperature=0.7, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=6, min_tokens=4, stop_token_ids=[17], logit_bias={17: 50.0}, **greedy),
        SamplingParams(max_tokens=6, presence_penalty=1.5, frequency_penalty=0.5, prompt_logprobs=2, **greedy),
        SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, min_p=0.05, seed=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, seed=4, n=2,
                       structured_outputs=StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2}")),
    ]
    want, want_lp = _full(_run_outputs(tiny_llama_dir, False, prompts, params))
    got, got_lp = _full(_run_outputs(tiny_llama_dir, True, prompts, params))
    prompt_lp = want[0][2]
    assert prompt_lp is not None and len(prompt_lp) == 20 and all(d is not None for d in prompt_lp[1:])
    assert want[3][1][0][3] == "stop" and want[5][1][0][1][4] == 17 and len(want[2][1]) == 3
    assert all(re.fullmatch(r"[a-c]{3}-[0-9]{2}", c[2]) for c in want[8][1])
    assert got == want
    assert got_lp == pytest.approx(want_lp, rel=1e-5, abs=1e-5)


def _run_outputs(model_dir, async_scheduling, prompts, params):
    llm = LLM(model_dir, kv_cache_memory_bytes=64 << 20, max_model_len=128, max_num_batched_tokens=48, max_num_seqs=6,
              async_scheduling=async_scheduling)
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
