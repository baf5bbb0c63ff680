"""Triton paged attention over an fp8 KV cache (``kv_cache_dtype="fp8" / "fp8_e5m2"``) against the torch reference.

``check_attention_fp8`` also runs on CPU under ``TRITON_INTERPRET=1`` (``tests/test_triton_interpret_fp8.py``).
The store must write the reference's bytes exactly (same division, saturation and rounding); the attention
output, computed from the fp8 tiles with the scales applied in fp32, must match the reference's, which
dequantizes the gathered blocks in fp32.
"""
from __future__ import annotations

import pytest
import torch

from lqe.kernels import attention_ref as ref

from test_triton_attention import make_case

ATOL = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 4e-2}
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def check_attention_fp8(specs, num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, device="cuda",
                        kv_dtype=E4M3, block_size=16, num_splits=None, seed=0, pad_tokens=0, outlier=True,
                        **attn_kw) -> float:
    from lqe.kernels import triton_attention as ta

    query, key, value, cache, meta = make_case(specs, num_heads, num_kv_heads, head_dim, dtype, device,
                                               block_size, seed, pad_tokens)
    k_scale = torch.tensor([0.011], dtype=torch.float32, device=device)
    v_scale = torch.tensor([0.023], dtype=torch.float32, device=device)
    if outlier:  # far past the format's range: the store must saturate, not write inf / NaN
        key[0, 0, 0] = 1e4
    cache8 = ref.quantize_kv(cache, k_scale, kv_dtype)  # garbage / cached prefix, already in fp8
    cache_ref = cache8.clone()
    ref.store_kv(key, value, cache_ref, meta.slot_mapping, k_scale, v_scale)
    ta.store_kv(key, value, cache8, meta.slot_mapping, k_scale, v_scale)
    assert torch.equal(cache8.view(torch.uint8), cache_ref.view(torch.uint8)), "triton fp8 store differs from the reference"
    assert torch.isfinite(cache8.float()).all()
    scale = head_dim ** -0.5
    n = meta.query_start_loc_cpu[-1]
    expected = ref.paged_attention_ref(query[:n], cache_ref, meta, scale, k_scale, v_scale).float()
    got = ta.paged_attention(query, cache8, meta, scale, num_splits=num_splits, k_scale=k_scale,
                             v_scale=v_scale, **attn_kw)[:n].float()
    err = (got - expected).abs().max().item()
    assert err <= ATOL[dtype], f"max abs error {err} > {ATOL[dtype]} for {specs} {dtype} {kv_dtype} D={head_dim}"
    # the same attention over a float cache holding the dequantized values: fp8 reads are exactly "x * scale"
    deq = torch.stack([cache_ref[0].float() * k_scale, cache_ref[1].float() * v_scale]).to(dtype)
    plain = ref.paged_attention_ref(query[:n], deq, meta, scale).float()
    assert (plain - expected).abs().max().item() <= ATOL[dtype]
    return err


# ------------------------------------------------------------------------------------------------ GPU tests
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = [pytest.mark.gpu, gpu]
DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_prefill_with_prefix(dtype, kv_dtype):
    check_attention_fp8([(37, 0), (64, 100), (5, 3), (128, 17)], 8, 2, 128, dtype, kv_dtype=kv_dtype, pad_tokens=3)


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("num_splits", [1, 4, None])
def test_fp8_decode_split_k(kv_dtype, num_splits):
    check_attention_fp8([(1, 4000), (1, 1), (1, 257), (1, 0)], 32, 8, 128, torch.bfloat16, kv_dtype=kv_dtype,
                        num_splits=num_splits)


def test_fp8_mixed_batch_gqa_and_block_sizes():
    for bs in (1, 16, 32):
        check_attention_fp8([(1, 130), (33, 20), (1, 1), (4, 0)], 12, 4, 64, torch.float16, block_size=bs)
    check_attention_fp8([(1, 40), (9, 9)], 4, 1, 128, torch.bfloat16, kv_dtype=E5M2)  # MQA


def test_fp8_scales_are_read_at_run_time():
    """A CUDA graph captured with one scale replays with the scale tensor's current value (no host float)."""
    from lqe.kernels import triton_attention as ta

    query, key, value, cache, meta = make_case([(1, 300), (1, 50)], 8, 2, 128, torch.bfloat16, "cuda")
    cache8 = ref.quantize_kv(cache, torch.ones(1, device="cuda"), E4M3)
    k_scale = torch.ones(1, device="cuda")
    v_scale = torch.ones(1, device="cuda")
    out = torch.empty_like(query)
    ta.paged_attention(query, cache8, meta, 0.1, out=out, num_splits=2, k_scale=k_scale, v_scale=v_scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ta.paged_attention(query, cache8, meta, 0.1, out=out, num_splits=2, k_scale=k_scale, v_scale=v_scale)
    for ks, vs in ((1.0, 1.0), (0.5, 2.0), (0.02, 0.3)):
        k_scale.fill_(ks)
        v_scale.fill_(vs)
        graph.replay()
        expected = ref.paged_attention_ref(query, cache8, meta, 0.1, k_scale, v_scale)
        torch.testing.assert_close(out.float(), expected.float(), atol=4e-2, rtol=4e-2)


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_fp8_store_keeps_nan_and_saturates_inf(kv_dtype):
    """A NaN key stays NaN in the cache, as in the reference (plain min / max on the GPU return the non-NaN operand:
    the interpreter cannot show it); +-inf saturate to +-max. Every other byte is the reference's (NaN codes may
    differ in sign or payload)."""
    from lqe.kernels import triton_attention as ta

    t, kvh, d = 4, 2, 64
    key = torch.randn(t, kvh, d, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(t, kvh, d, device="cuda", dtype=torch.bfloat16)
    key[1, 0, 3], key[2, 1, 5], value[0, 0, 0] = float("nan"), float("inf"), -float("inf")
    cache = torch.zeros(2, 2, 16, kvh, d, device="cuda", dtype=kv_dtype)
    cache_ref = cache.clone()
    scales = torch.tensor([0.5], device="cuda"), torch.tensor([1.0], device="cuda")
    slots = torch.arange(t, device="cuda")
    ref.store_kv(key, value, cache_ref, slots, *scales)
    ta.store_kv(key, value, cache, slots, *scales)
    k = cache[0].reshape(-1, kvh, d)[:t].float()
    assert torch.isnan(k[1, 0, 3]) and torch.isnan(cache_ref[0].reshape(-1, kvh, d)[1, 0, 3].float())
    assert k[2, 1, 5] == torch.finfo(kv_dtype).max and cache[1].reshape(-1, kvh, d)[0, 0, 0].float() == -torch.finfo(kv_dtype).max
    nan = torch.isnan(cache_ref.float())
    assert torch.equal(torch.isnan(cache.float()), nan)
    assert torch.equal(cache.view(torch.uint8)[~nan], cache_ref.view(torch.uint8)[~nan])
