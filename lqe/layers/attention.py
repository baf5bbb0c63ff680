"""Attention over the paged KV cache, with a pluggable backend.

The model calls ``Attention(q, k, v)`` with the step's flattened tokens; the layer stores K/V into its cache
and asks the backend for the output. Backends: ``torch`` (reference, everywhere) and, on GPU, ``triton``
(lqe's own kernels) or ``flash_attn`` when that package is installed. ``LQE_ATTENTION_BACKEND`` forces one.
"""
from __future__ import annotations

import os
from typing import Callable, Protocol

import torch
from torch import nn

from lqe.engine.forward_context import AttentionMetadata, get_forward_context
from lqe.layers import paged_attention_ref as ref


class AttentionBackend(Protocol):
    name: str

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """``query [T, H, D]``, ``key``/``value`` ``[T, KVH, D]`` -> ``[T, H, D]``; stores K/V first."""


class TorchAttentionBackend:
    name = "torch"

    def forward(self, query, key, value, kv_cache, meta, scale):
        ref.store_kv(key, value, kv_cache, meta.slot_mapping)
        return ref.paged_attention_ref(query, kv_cache, meta, scale)


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch": TorchAttentionBackend}


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    _BACKENDS[name] = factory


def select_backend(device: torch.device) -> AttentionBackend:
    forced = os.environ.get("LQE_ATTENTION_BACKEND")
    if forced:
        if forced not in _BACKENDS:
            _try_register_gpu_backends()
        if forced not in _BACKENDS:
            raise ValueError(f"LQE_ATTENTION_BACKEND={forced!r} is not available; available: {sorted(_BACKENDS)}")
        return _BACKENDS[forced]()
    if device.type == "cuda":
        _try_register_gpu_backends()
        for name in ("flash_attn", "triton"):
            if name in _BACKENDS:
                return _BACKENDS[name]()
    return TorchAttentionBackend()


def _try_register_gpu_backends() -> None:
    try:
        from lqe.kernels import attention_backends  # noqa: F401  (registers what it can import)
    except ImportError:
        pass


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, layer_idx: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.layer_idx = layer_idx
        self.backend: AttentionBackend = TorchAttentionBackend()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        t = q.shape[0]
        out = self.backend.forward(
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
            ctx.kv_caches[self.layer_idx], ctx.attn_metadata, self.scale,
        )
        return out.reshape(t, self.num_heads * self.head_dim)
