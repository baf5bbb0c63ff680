"""Many requests batched together give exactly what each gives alone: plain, with prefix-cache hits,
with chunked prefill forced by a small token budget, and with preemption forced by a tiny KV cache."""
import random

import pytest

from lqe import LLM, SamplingParams


def _prompts(n: int, seed: int = 0, shared_prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        body = [rng.randrange(3, 49000) for _ in range(rng.randrange(1, 60))]
        out.append((shared_prefix or []) + body)
    return out


def _params(n: int, seed: int = 1) -> list[SamplingParams]:
    rng = random.Random(seed)
    ps = []
    for i in range(n):
        if i % 3 == 2:  # seeded sampling must also be independent of the batch
            ps.append(SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=rng.randrange(1, 24), ignore_eos=True))
        else:
            ps.append(SamplingParams(temperature=0, max_tokens=rng.randrange(1, 24), ignore_eos=True))
    return ps


@pytest.fixture(scope="module")
def alone_outputs(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=64 << 20, max_model_len=512, enable_prefix_caching=False)
    prompts, params = _prompts(22), _params(22)
    return prompts, params, [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids
                             for p, sp in zip(prompts, params)]


def _check(llm: LLM, alone_outputs) -> None:
    prompts, params, expected = alone_outputs
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.outputs[0].token_ids == e, f"request {i} differs when batched"
        assert o.outputs[0].finish_reason == "length"


def test_batched_equals_alone(tiny_llama_dir, alone_outputs):
    _check(LLM(tiny_llama_dir, kv_cache_memory_bytes=64 << 20, max_model_len=512), alone_outputs)


def test_chunked_prefill_small_budget(tiny_llama_dir, alone_outputs):
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=64 << 20, max_model_len=512, max_num_batched_tokens=7)
    _check(llm, alone_outputs)


def test_preemption_with_tiny_kv_cache(tiny_llama_dir, alone_outputs):
    llm = LLM(tiny_llama_dir, num_kv_blocks=12, block_size=8, max_model_len=96)
    _check(llm, alone_outputs)
    assert llm.llm_engine.scheduler.num_preemptions > 0, "the tiny cache should have forced preemption"
    assert llm.llm_engine.block_manager.num_free_blocks == 12, "all blocks are returned at the end"


def test_prefix_cache_hits_give_identical_outputs(tiny_llama_dir):
    shared = list(range(100, 140))
    prompts = _prompts(12, seed=3, shared_prefix=shared)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM(tiny_llama_dir, kv_cache_memory_bytes=32 << 20, max_model_len=256, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    cached = LLM(tiny_llama_dir, kv_cache_memory_bytes=32 << 20, max_model_len=256, block_size=8)
    cached.generate([prompts[0]], params, use_tqdm=False)  # warms the cache with the shared prefix
    outs = cached.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.num_cached_tokens >= 40 for o in outs), [o.num_cached_tokens for o in outs]
    assert cached.llm_engine.stats().prefix_cache_hit_rate > 0.5
