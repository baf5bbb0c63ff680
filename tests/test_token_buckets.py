"""Token buckets of mixed/prefill steps (lqe.engine.token_buckets) and the padding the piecewise graphs rely on:
a step padded to its bucket gives the unpadded step's hidden states (real rows) and stores the same KV."""
import pytest
import torch

from lqe import LLM, SamplingParams
from lqe.engine.token_buckets import plan_step, token_bucket_for, token_buckets
from lqe.forward_context import ForwardContext, set_forward_context


def test_buckets_cover_every_count_with_bounded_padding():
    b = token_buckets(8192)
    assert b[:8] == [64, 128, 192, 256, 320, 384, 448, 512] and b[-1] == 8192 and b == sorted(set(b))
    for n in range(1, 8193):
        k = token_bucket_for(n, b)
        assert k is not None and k >= n
        assert k - n < 64 or k <= n * 1.25 + 1, (n, k)
    assert token_bucket_for(8193, b) is None
    assert token_buckets(100) == [64, 100] and token_buckets(7) == [7]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        token_buckets(0)


def _engine(tiny_llama_dir, budget=40):
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=32 << 20, max_model_len=256, max_num_batched_tokens=budget,
              enable_prefix_caching=False)
    return llm.llm_engine


def test_plan_step_routes_decode_mixed_and_large_steps(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    engine.add_request("a", list(range(5, 35)), SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    sched = engine.scheduler.schedule()
    assert plan_step(sched, [1, 2, 4], token_buckets(40)) == ("piecewise", 40)  # 30-token prefill -> cap 40
    assert plan_step(sched, [1, 2, 4], [16]) == ("eager", None)  # larger than every bucket
    engine._process(sched, engine.runner.execute(sched, engine._sampling_batch(sched)))
    dec = engine.scheduler.schedule()
    assert plan_step(dec, [1, 2, 4], token_buckets(40)) == ("decode", 1)


def test_padded_mixed_step_matches_unpadded(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    p = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    engine.add_request("a", list(range(5, 17)), p)
    engine.step()  # "a" decodes from now on
    engine.add_request("b", list(range(40, 63)), p)
    sched = engine.scheduler.schedule()
    assert len(sched.scheduled) == 2 and sched.num_batched_tokens == 24  # a mixed step: 1 decode + 23 prefill
    runner = engine.runner
    outs = []
    for pad in (None, 64):
        inp = runner.inputs.build(sched, pad_tokens=pad)
        with torch.inference_mode(), set_forward_context(ForwardContext(inp.meta, runner.kv_caches)):
            hidden = runner.model(inp.input_ids, inp.positions)
        # on CPU the step buffer is reused by the next build: keep copies
        outs.append((hidden.clone(), runner.kv_cache.clone(), inp.sample_rows.clone(), inp.positions.clone(),
                     inp.meta.slot_mapping.clone(), list(inp.meta.query_start_loc_cpu)))
    (h0, kv0, s0, _, _, q0), (h1, kv1, s1, pos1, slots1, q1) = outs
    assert h1.shape[0] == 64 and h0.shape[0] == 24
    torch.testing.assert_close(h1[:24], h0, rtol=1e-5, atol=1e-5)
    assert torch.equal(kv1, kv0), "padding tokens must store nothing"
    assert torch.equal(s1, s0) and s0.tolist() == [0, 23]
    assert pos1.shape[0] == 64 and pos1[24:].abs().sum() == 0 and q1 == q0 == [0, 1, 24]
    assert (slots1[24:] == -1).all() and (slots1[:24] >= 0).all()
