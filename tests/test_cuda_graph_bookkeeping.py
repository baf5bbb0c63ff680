"""The CUDA-graph decode path's plain-Python parts, on CPU: buckets, the one-buffer step layout, padding rows,
and whole generations run through the padded decode path (``EagerPaddedRunner``: the graph runner's
bookkeeping with an eager forward in place of each replay) against the eager engine."""
from types import SimpleNamespace

import numpy as np
import pytest

from lqe import LLM, SamplingParams
from lqe.engine.cuda_graph import EagerPaddedRunner, batch_buckets, bucket_for, graphable
from lqe.engine.scheduler import ScheduledSeq, SchedulerOutput
from lqe.engine.step_inputs import StepLayout, fill_host, token_slice

from helpers import mixed_workload


def test_batch_buckets():
    assert batch_buckets(64, 256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(256, 20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(3, 256) == [1, 2, 3]
    assert batch_buckets(1, 256) == [1]
    assert batch_buckets(100, 256)[-2:] == [96, 100]


def test_bucket_for():
    buckets = [1, 2, 4, 8, 16]
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert bucket_for(17, buckets) is None


def _seq(prompt, out, table, wants_prompt_lp=False):
    return SimpleNamespace(prompt_token_ids=prompt, output_token_ids=out, block_table=table,
                           num_prompt_tokens=len(prompt), num_tokens=len(prompt) + len(out),
                           wants_prompt_logprobs=wants_prompt_lp)


def test_token_slice_matches_concatenation():
    s = _seq([5, 6, 7], [8, 9], [0])
    full = s.prompt_token_ids + s.output_token_ids
    for start in range(5):
        for n in range(1, 6 - start):
            assert token_slice(s, start, n) == full[start:start + n]


def test_padded_decode_layout():
    bs = 4
    seqs = [_seq([1, 2, 3], [4, 5], [7, 3]), _seq([9] * 6, [10], [2, 5]), _seq([11], [], [6])]
    sched = SchedulerOutput([ScheduledSeq(s, s.num_tokens - 1, 1) for s in seqs])
    assert graphable(sched)
    buf = np.full(200, 12345, dtype=np.int32)
    lay = fill_host(buf, sched, bs, pad_seqs=4, width=3, logits_for_all=True)
    assert lay == StepLayout(4, 4, 3, 0)
    assert buf[lay.ids:lay.positions].tolist() == [5, 10, 11, 0]
    assert buf[lay.positions:lay.slots].tolist() == [4, 6, 0, 0]
    # position 4 of seq 0 is block 3 offset 0; position 6 of seq 1 is block 5 offset 2; seq 2 block 6 offset 0
    assert buf[lay.slots:lay.query_start_loc].tolist() == [12, 22, 24, -1]
    assert buf[lay.query_start_loc:lay.seq_lens].tolist() == [0, 1, 2, 3, 4]
    assert buf[lay.seq_lens:lay.block_tables].tolist() == [5, 7, 1, 0]
    assert buf[lay.block_tables:lay.sample_rows].reshape(4, 3).tolist() == [[7, 3, 0], [2, 5, 0], [6, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="decode-only"):
        fill_host(buf, SchedulerOutput([ScheduledSeq(seqs[0], 0, 5)]), bs, pad_seqs=4, width=3)


def test_mixed_step_layout_lists_sample_rows():
    bs = 4
    prefill = _seq([1, 2, 3, 4, 5, 6], [], [8, 9])
    chunk = _seq([7] * 10, [], [1, 2, 3])
    decode = _seq([1, 2], [3], [4])
    sched = SchedulerOutput([ScheduledSeq(prefill, 0, 6), ScheduledSeq(chunk, 0, 5), ScheduledSeq(decode, 2, 1)])
    assert not graphable(sched)
    buf = np.zeros(200, dtype=np.int32)
    lay = fill_host(buf, sched, bs)
    assert (lay.num_tokens, lay.num_seqs, lay.width, lay.num_sample) == (12, 3, 3, 2)
    assert buf[lay.ids:lay.positions].tolist() == [1, 2, 3, 4, 5, 6, 7, 7, 7, 7, 7, 3]
    assert buf[lay.slots:lay.query_start_loc].tolist() == [32, 33, 34, 35, 36, 37, 4, 5, 6, 7, 8, 18]
    assert buf[lay.query_start_loc:lay.seq_lens].tolist() == [0, 6, 11, 12]
    assert buf[lay.sample_rows:lay.size].tolist() == [5, 11]  # the chunk that stops short of its end samples nothing


def test_prompt_logprobs_step_is_not_graphable():
    s = _seq([1, 2, 3], [], [0], wants_prompt_lp=True)
    assert not graphable(SchedulerOutput([ScheduledSeq(s, 2, 1)]))


PADDED_KW = dict(kv_cache_memory_bytes=64 << 20, max_model_len=256, enable_prefix_caching=True, max_num_seqs=6,
                 max_cudagraph_batch=5)


@pytest.fixture(scope="module")
def padded_workload_alone(tiny_llama_dir):
    """The 14 requests of the padded-path tests and the tokens each gets alone on the eager path (computed once
    for both parametrizations)."""
    prompts, params = mixed_workload(14)
    eager = LLM(tiny_llama_dir, **PADDED_KW)
    alone = [eager.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    eager.shutdown()
    return prompts, params, alone


@pytest.mark.parametrize("num_kv_blocks", [None, 16])
def test_padded_decode_path_equals_eager(tiny_llama_dir, padded_workload_alone, num_kv_blocks):
    """Batched generation with decode steps on the padded-bucket path (prefix caching on; preemption forced by a
    16-block cache) gives every request the tokens it gets alone on the eager path."""
    prompts, params, alone = padded_workload_alone
    llm = LLM(tiny_llama_dir, **PADDED_KW, **({"num_kv_blocks": num_kv_blocks} if num_kv_blocks else {}))
    runner = llm.llm_engine.runner
    runner.capture_cuda_graphs(EagerPaddedRunner)
    assert runner.graph_runner.buckets == [1, 2, 4, 5]
    calls = []
    original = runner.graph_runner._replay
    runner.graph_runner._replay = lambda bucket, lay: (calls.append(bucket), original(bucket, lay))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert len(set(calls)) >= 3, calls  # several buckets were used, so padding rows were exercised
    if num_kv_blocks:
        assert llm.llm_engine.scheduler.num_preemptions > 0


def test_enforce_eager_and_max_cudagraph_batch_options(tiny_llama_dir):
    with pytest.raises(ValueError, match="max_cudagraph_batch"):
        LLM(tiny_llama_dir, max_cudagraph_batch=0)
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=16 << 20, max_model_len=128, enforce_eager=True)
    assert llm.llm_engine.runner.graph_runner is None  # CPU, and eager asked for: no graphs either way
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
