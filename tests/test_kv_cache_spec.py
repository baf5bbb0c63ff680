"""The KV cache's byte count and block budget (lqe.engine.kv_cache), without a model."""
import pytest
import torch

from lqe import LLM
from lqe.config import EngineConfig
from lqe.engine.kv_cache import DEFAULT_CPU_KV_BYTES, KVCacheSpec

CPU = torch.device("cpu")
E4M3 = torch.float8_e4m3fn


def spec(dtype=torch.bfloat16, rotation=True, layers=30, block=16, heads=3, d=64):
    return KVCacheSpec(layers, block, heads, d, dtype, torch.bfloat16, rotation)


def test_bytes_per_block_and_fixed_overhead():
    assert spec().bytes_per_block() == 2 * 30 * 16 * 3 * 64 * 2
    assert spec(E4M3).bytes_per_block() * 2 == spec().bytes_per_block()
    assert spec().fixed_bytes() == 0  # a 16-bit cache has no scales and no rotation
    assert spec(E4M3, rotation=False).fixed_bytes() == 2 * 30 * 4
    assert spec(E4M3).fixed_bytes() == 2 * 30 * 4 + 64 * 64 * (2 + 4)


def test_budget_precedence():
    s = spec(E4M3)
    per = s.bytes_per_block()
    exact = EngineConfig(model="m", num_kv_blocks=7, kv_cache_memory_bytes=100 * per)
    assert s.num_blocks(exact, CPU, 16) == 7  # an exact count overrides the budget
    budget = EngineConfig(model="m", kv_cache_memory_bytes=10 * per + s.fixed_bytes() - 1)
    assert s.num_blocks(budget, CPU, 16) == 9  # the fixed overhead comes out of the budget first
    default = EngineConfig(model="m")
    assert s.num_blocks(default, CPU, 16) == (DEFAULT_CPU_KV_BYTES - s.fixed_bytes()) // per
    assert s.blocks_per_request(17) == 2 and s.blocks_per_request(16) == 1


def test_slot_numbers_stay_int32():
    """Slots (block x block_size + offset) are int32 in the step buffers: a budget of more than 2^31 tokens (a tiny
    model on a large GPU) is cut to what int32 addresses."""
    s = spec(E4M3, layers=1, heads=1, d=16, block=16)
    cfg = EngineConfig(model="m", kv_cache_memory_bytes=(2**31 + 10 * 16) // 16 * s.bytes_per_block())
    n = s.num_blocks(cfg, CPU, 16)
    assert n == (2**31 - 1) // 16 and n * 16 < 2**31


def test_too_small_names_the_request_and_the_knobs():
    s = spec()
    cfg = EngineConfig(model="m", kv_cache_memory_bytes=3 * s.bytes_per_block())
    assert s.num_blocks(cfg, CPU, 48) == 3
    with pytest.raises(MemoryError, match=r"3 blocks of 16 tokens.*max_model_len=49 tokens needs 4 blocks.*"
                                          r"Raise kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len"):
        s.num_blocks(cfg, CPU, 49)


def test_engine_refuses_a_cache_that_cannot_hold_one_request(tiny_llama_dir):
    with pytest.raises(MemoryError, match="max_model_len=256 tokens needs 16 blocks"):
        LLM(tiny_llama_dir, num_kv_blocks=15, max_model_len=256)
    llm = LLM(tiny_llama_dir, num_kv_blocks=16, max_model_len=256)  # the bound itself fits
    assert llm.llm_engine.runner.num_blocks == 16
