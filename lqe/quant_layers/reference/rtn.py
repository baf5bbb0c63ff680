"""Round-to-nearest weight quantization to :class:`CanonicalWeight` (GPTQ / AutoAWQ conventions).

symmetric (GPTQ ``find_params``): ``scale = 2*absmax / (2^b - 1)``, ``zero = 2^(b-1)``;
asymmetric: min/max widened to include 0, ``scale = (max - min) / (2^b - 1)``, ``zero = clamp(round(-min/scale))``;
``code = clamp(round(w/scale) + zero, 0, 2^b - 1)``.
"""
from __future__ import annotations

import torch

from lqe.kernels.canonical import CanonicalWeight


def rtn_quantize(weight: torch.Tensor, bits: int, group_size: int, sym: bool, g_idx: torch.Tensor | None = None) -> CanonicalWeight:
    """Quantize a torch-layout ``weight [N, K]`` per group of input channels.

    ``group_size=-1`` is one group over K; a group size that does not divide K gives a short last group.
    ``g_idx`` (``[K]``, groups in act-order) overrides ``k // group_size``."""
    w = weight.detach().float().t()  # [K, N]
    k, n = w.shape
    maxq = (1 << bits) - 1
    if g_idx is None:
        gi = torch.arange(k, device=w.device) // (k if group_size == -1 else group_size)
    else:
        gi = g_idx.long()
    num_groups = int(gi.max()) + 1
    # per-group min/max over the rows of each group
    idx = gi.view(k, 1).expand(k, n)
    wmin = torch.zeros(num_groups, n, device=w.device).scatter_reduce(0, idx, w, "amin", include_self=True)
    wmax = torch.zeros(num_groups, n, device=w.device).scatter_reduce(0, idx, w, "amax", include_self=True)
    if sym:
        absmax = torch.maximum(wmin.abs(), wmax.abs())
        scale = 2 * absmax / maxq
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zeros = None
        z = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        scale = (wmax - wmin) / maxq
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        z = torch.round(-wmin / scale).clamp(0, maxq)
        zeros = z.to(torch.uint8)
    codes = torch.clamp(torch.round(w / scale[gi]) + z[gi], 0, maxq).to(torch.uint8)
    return CanonicalWeight(codes, scale, zeros, None if g_idx is None else g_idx.to(torch.int32), bits, group_size)
