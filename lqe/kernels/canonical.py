"""The canonical form every weight-only checkpoint decodes to (DESIGN.md rule 4).

GPTQ, AWQ and compressed-tensors ``pack-quantized`` all decode to the same thing, and every kernel repacks
from it. ``W[k, n] = scales[g_idx[k], n] * (codes[k, n] - zeros[g_idx[k], n])`` in the math orientation
``y = x @ W`` (``W`` is ``[K, N]``, the transpose of a torch ``weight``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class CanonicalWeight:
    codes: torch.Tensor  # [K, N] uint8, unsigned codes in [0, 2^bits)
    scales: torch.Tensor  # [G, N] float
    zeros: torch.Tensor | None  # [G, N] uint8 true zero points, or None = symmetric (zero = 2^(bits-1))
    g_idx: torch.Tensor | None  # [K] int32 group of each input row, or None = k // group_size
    bits: int
    group_size: int  # -1 = one group over all of K

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def group_index(self) -> torch.Tensor:
        """``[K]`` int64 group of each input row (``ceil(K/g)`` groups; the last may be short)."""
        k = self.codes.shape[0]
        if self.g_idx is not None:
            return self.g_idx.long()
        g = k if self.group_size == -1 else self.group_size
        return torch.arange(k, device=self.codes.device) // g

    def zero_points(self) -> torch.Tensor:
        """``[G, N]`` zero points as float (the constant ``2^(bits-1)`` when symmetric)."""
        if self.zeros is not None:
            return self.zeros.float()
        return torch.full_like(self.scales, float(1 << (self.bits - 1)), dtype=torch.float32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Float ``W`` ``[K, N]``."""
        gi = self.group_index()
        w = (self.codes.float() - self.zero_points()[gi]) * self.scales.float()[gi]
        return w.to(dtype)

    def has_act_order(self) -> bool:
        """True when ``g_idx`` is not the trivial ``k // group_size`` (the checkpoint used act-order)."""
        if self.g_idx is None:
            return False
        k = self.codes.shape[0]
        g = k if self.group_size == -1 else self.group_size
        trivial = torch.arange(k, device=self.g_idx.device) // g
        return not torch.equal(self.g_idx.long(), trivial)


def build_canonical(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    num_groups: int | None = None,
) -> CanonicalWeight:
    """A validated CanonicalWeight: ``scales``/``zeros`` must have ``ceil(K/g)`` rows (1 for ``group_size=-1``),
    or ``num_groups`` rows when given (a tensor-parallel shard of an act-order layer: its rows read groups of the
    whole K through ``g_idx``), and a trivial ``g_idx`` (``k // g``) is dropped so kernels see act-order only when
    it is real."""
    k, n = int(codes.shape[0]), int(codes.shape[1])
    g = num_groups if num_groups is not None else (1 if group_size == -1 else -(-k // group_size))
    if tuple(scales.shape) != (g, n):
        raise ValueError(f"scales: expected shape {(g, n)} (ceil(K/g) groups for K={k}, group_size={group_size}), "
                         f"found {tuple(scales.shape)}")
    if zeros is not None and tuple(zeros.shape) != (g, n):
        raise ValueError(f"zero points: expected shape {(g, n)}, found {tuple(zeros.shape)}")
    cw = CanonicalWeight(codes, scales.float(), zeros, None if g_idx is None else g_idx.to(torch.int32), bits, group_size)
    if not cw.has_act_order():
        cw.g_idx = None
    return cw
