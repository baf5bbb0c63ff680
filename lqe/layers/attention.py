"""Attention over the paged KV cache.

The model calls ``Attention(q, k, v)`` with the step's flattened tokens; the layer hands them, with its
layer's KV cache and the step's metadata from the forward context, to its backend, which stores K/V and
computes the output. Backends (torch reference, triton, flash_attn) and their selection live in
:mod:`lqe.kernels.attention_backends`; the model runner assigns one to every layer after building the model.
"""
from __future__ import annotations

import torch
from torch import nn

from lqe.forward_context import get_forward_context
from lqe.kernels.attention_backends import AttentionBackend, TorchAttentionBackend


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
