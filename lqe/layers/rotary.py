"""Rotary position embedding (neox / HF-Llama layout: rotate halves) with the scalings Llama checkpoints use."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lqe.forward_context import step_cached

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(
        f"rope_scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    """Use :func:`get_rope` so that all layers share one cos/sin table."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv = _inv_freq(head_dim, base, scaling)
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1).float(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, H*D]``, ``k [T, KVH*D]`` rotated at ``positions [T]``."""
        if q.is_cuda:
            from lqe.kernels.fused_ops import rotary_embedding

            return rotary_embedding(positions, q, k, self.cos_sin, self.head_dim)
        # the same positions tensor reaches every layer: gather cos/sin once per step
        cos, sin = step_cached(("rope", id(self), id(positions)),
                               lambda: [c[:, None, :] for c in self.cos_sin[positions].chunk(2, dim=-1)])
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t, dtype = x.shape[0], x.dtype
        x = x.view(t, -1, self.head_dim).float()
        x1, x2 = x.chunk(2, dim=-1)
        c, s = cos, sin  # [T, 1, D/2]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        return out.flatten(1).to(dtype)


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None,
             device: torch.device | None = None) -> RotaryEmbedding:
    key = (head_dim, max_position, base, repr(sorted((scaling or {}).items())), str(device or torch.get_default_device()))
    if key not in _ROPE_CACHE:
        _ROPE_CACHE[key] = RotaryEmbedding(head_dim, max_position, base, scaling)
    return _ROPE_CACHE[key]
