"""Attention backends and their registry: which kernel computes paged attention on which device.

* ``torch``: the reference (``attention_ref``), everywhere.
* ``triton``: lqe's own kernels (``triton_attention``): KV store, prefill over a cached prefix, split-K decode.
  Registered when triton imports and CUDA is available, or when ``LQE_ATTENTION_BACKEND=triton`` forces it
  (with ``TRITON_INTERPRET=1`` it then runs on CPU tensors, slowly: for tests).
* ``flash_attn``: ``flash_attn_varlen_func`` / ``flash_attn_with_kvcache`` with a block table. FlashAttention-2
  only pages KV in blocks of a multiple of 256 tokens; for other block sizes this backend hands the step to
  the triton kernels (or the torch reference when triton is absent), so it is always correct.

Importing this module never raises: a missing or broken package just means its backend is not registered.
``LQE_ATTENTION_BACKEND`` forces one. An fp8 KV cache (``kv_cache_dtype``) is read by the torch and triton
backends with the layer's ``k_scale`` / ``v_scale`` tensors; flash_attn hands such steps to triton. The layer (``lqe.layers.attention.Attention``) only holds a backend
object; this module never imports the layer.
"""
from __future__ import annotations

import os
from typing import Callable, Protocol

import torch

from lqe.forward_context import AttentionMetadata
from lqe.kernels import attention_ref as ref

try:
    from lqe.kernels import triton_attention as _ta
except Exception:  # noqa: BLE001 -- ImportError, or a triton build that fails to initialise
    _ta = None

try:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
except Exception:  # noqa: BLE001
    flash_attn_varlen_func = flash_attn_with_kvcache = None

FLASH_ATTN_BLOCK_MULTIPLE = 256


class AttentionBackend(Protocol):
    name: str

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """``query [T, H, D]``, ``key``/``value`` ``[T, KVH, D]`` -> ``[T, H, D]``; stores K/V first (quantized
        with ``k_scale`` / ``v_scale`` when ``kv_cache`` is fp8). With ``out`` (``[T, H, D]``) the result is
        written there and ``out`` returned (the piecewise replay's static buffer: no copy after)."""


class TorchAttentionBackend:
    name = "torch"

    def forward(self, query, key, value, kv_cache, meta, scale, k_scale=None, v_scale=None, out=None):
        ref.store_kv(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)
        return _into(out, ref.paged_attention_ref(query, kv_cache, meta, scale, k_scale, v_scale))


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """``result``, copied into ``out`` when the caller gave one (backends whose kernels allocate their output)."""
    if out is None:
        return result
    return out.copy_(result)


class TritonAttentionBackend:
    name = "triton"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        _ta.store_kv(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)
        return _ta.paged_attention(query, kv_cache, meta, scale, out=out, k_scale=k_scale, v_scale=v_scale)


class _CuSeqlensK:
    """``[0, cumsum(seq_lens)]`` once per step (every layer shares the step's metadata object)."""

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._value: torch.Tensor | None = None

    def __call__(self, meta: AttentionMetadata) -> torch.Tensor:
        if self._meta is not meta:
            cu = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=meta.seq_lens.device)
            torch.cumsum(meta.seq_lens, 0, dtype=torch.int32, out=cu[1:])
            self._meta, self._value = meta, cu
        return self._value


_cu_seqlens_k = _CuSeqlensK()


class FlashAttnBackend:
    name = "flash_attn"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        if (meta.block_size % FLASH_ATTN_BLOCK_MULTIPLE or query.dtype not in (torch.float16, torch.bfloat16)
                or ref.is_fp8(kv_cache.dtype)):  # FlashAttention-2 reads no fp8 cache
            return _fallback(query, key, value, kv_cache, meta, scale, k_scale, v_scale, out)
        if _ta is not None:
            _ta.store_kv(key, value, kv_cache, meta.slot_mapping)
        else:
            ref.store_kv(key, value, kv_cache, meta.slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, KVH, D]
        if meta.is_decode_only:
            b = meta.num_seqs
            # one token per sequence, in sequence order: tokens past query_start_loc[-1] are padding
            res = flash_attn_with_kvcache(query[:b].unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                          block_table=meta.block_tables, softmax_scale=scale, causal=True).squeeze(1)
        else:
            b = meta.query_start_loc_cpu[-1]
            res = flash_attn_varlen_func(
                query[:b], k_cache, v_cache, cu_seqlens_q=meta.query_start_loc, cu_seqlens_k=_cu_seqlens_k(meta),
                max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len, softmax_scale=scale, causal=True,
                block_table=meta.block_tables,
            )
        if b == query.shape[0]:
            return _into(out, res)
        full = torch.zeros_like(query) if out is None else out.zero_()  # rows past b: padding tokens
        full[:b] = res
        return full


def _fallback(query, key, value, kv_cache, meta, scale, k_scale=None, v_scale=None, out=None):
    if _ta is not None and query.is_cuda:
        return TritonAttentionBackend().forward(query, key, value, kv_cache, meta, scale, k_scale, v_scale, out)
    return TorchAttentionBackend().forward(query, key, value, kv_cache, meta, scale, k_scale, v_scale, out)


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch": TorchAttentionBackend}


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    _BACKENDS[name] = factory


def _register() -> None:
    forced = os.environ.get("LQE_ATTENTION_BACKEND", "")
    cuda = torch.cuda.is_available()
    if _ta is not None and (cuda or forced == "triton"):
        register_backend("triton", TritonAttentionBackend)
    if flash_attn_varlen_func is not None and cuda:
        register_backend("flash_attn", FlashAttnBackend)


_register()


def select_backend(device: torch.device) -> AttentionBackend:
    """``LQE_ATTENTION_BACKEND`` when set; on CUDA flash_attn, else triton; the torch reference otherwise."""
    forced = os.environ.get("LQE_ATTENTION_BACKEND")
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"LQE_ATTENTION_BACKEND={forced!r} is not available; available: {sorted(_BACKENDS)}")
        return _BACKENDS[forced]()
    if device.type == "cuda":
        for name in ("flash_attn", "triton"):
            if name in _BACKENDS:
                return _BACKENDS[name]()
    return TorchAttentionBackend()
