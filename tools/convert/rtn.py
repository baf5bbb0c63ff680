"""Round-to-nearest with the stored scale: the engine's :func:`rtn_quantize` conventions, scales rounded to the
storage dtype first and codes recomputed with them, so the stored weights are exactly what was measured."""
from __future__ import annotations

import torch

from lqe.kernels.canonical import CanonicalWeight
from lqe.quant_layers.reference import rtn_quantize


def rtn_canonical(weight: torch.Tensor, bits: int, group_size: int, sym: bool,
                  scale_dtype: torch.dtype = torch.float16) -> CanonicalWeight:
    cw = rtn_quantize(weight, bits, group_size, sym)
    cw.scales = cw.scales.to(scale_dtype).float().clamp_min(torch.finfo(scale_dtype).tiny)
    gi = cw.group_index()
    q = torch.round(weight.detach().float().t() / cw.scales[gi]) + cw.zero_points()[gi]
    cw.codes = q.clamp(0, (1 << bits) - 1).to(torch.uint8)
    return cw


def fake_quant(weight: torch.Tensor, bits: int, group_size: int, sym: bool,
               scale_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Torch-layout dequantized RTN weight ``[N, K]``."""
    return rtn_canonical(weight, bits, group_size, sym, scale_dtype).dequantize().t()
