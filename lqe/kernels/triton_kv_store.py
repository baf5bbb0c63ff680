"""Triton KV store of the paged cache (``lqe.kernels.triton_attention`` re-exports it): ``key``/``value``
``[T, KVH, D]`` into ``kv_cache [2, num_blocks, block_size, KVH, D]`` at ``slot_mapping``; an fp8 cache stores
``x / scale`` saturated to the format's range (never inf / NaN), rounded to nearest even as torch does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lqe.kernels.attention_ref import fp8_max, is_fp8
from lqe.kernels.triton_pdl import pdl_args, pdl_start


@triton.jit
def _store_kv_kernel(K, V, KV, Slots, KScale, VScale, stride_kt, stride_kh, stride_vt, stride_vh, stride_kv,
                     stride_slot, stride_ch, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_start(PDL)  # (lqe.kernels.triton_pdl: before every load and the early exit)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = KV + slot * stride_slot + offs_h[:, None] * stride_ch + offs_d[None, :]
    if QUANT:  # saturating: out-of-range values land on +-FP8_MAX, never on inf; correctly rounded division
        # (a plain "/" is div.full on NVIDIA, up to 2 ulps off torch's IEEE quotient: another fp8 code near a tie).
        # A NaN stays NaN, as in torch's reference (plain min / max on the GPU would turn it into -FP8_MAX).
        k = tl.clamp(tl.div_rn(k.to(tl.float32), tl.load(KScale)), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        v = tl.clamp(tl.div_rn(v.to(tl.float32), tl.load(VScale)), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    tl.store(dst, k.to(KV.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, v.to(KV.dtype.element_ty), mask=mask)


def _scales(kv_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None):
    """(QUANT, FP8_MAX, k_scale, v_scale) for a launch: unit scales for an fp8 cache given none; the cache itself
    as a never-read placeholder pointer for a 16/32-bit one."""
    if not is_fp8(kv_cache.dtype):
        return False, 0.0, kv_cache, kv_cache
    one = None
    if k_scale is None or v_scale is None:
        one = torch.ones(1, dtype=torch.float32, device=kv_cache.device)
    return True, fp8_max(kv_cache.dtype), one if k_scale is None else k_scale, one if v_scale is None else v_scale


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write ``key``/``value`` ``[T, KVH, D]`` into ``kv_cache`` at ``slot_mapping`` (``-1`` = skip); an fp8
    cache stores them divided by ``k_scale`` / ``v_scale`` (float32 device tensors of one element)."""
    _check_cache(kv_cache)
    t, kvh, d = key.shape
    if t == 0:
        return
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("store_kv needs key/value with a contiguous last (head_dim) dimension")
    quant, fmax, ks, vs = _scales(kv_cache, k_scale, v_scale)
    _store_kv_kernel[(t,)](
        key, value, kv_cache, slot_mapping, ks, vs, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=kvh, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(kvh), BLOCK_D=triton.next_power_of_2(d),
        QUANT=quant, FP8_MAX=fmax, **pdl_args(key.device),
    )


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim]; got {tuple(kv_cache.shape)}")
    if kv_cache.stride(4) != 1 or kv_cache.stride(1) != kv_cache.shape[2] * kv_cache.stride(2):
        raise ValueError("kv_cache blocks must be contiguous (allocate it with torch.empty and do not slice it)")
