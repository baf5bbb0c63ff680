"""Reference int8 activation quantization (per token, dynamic; per tensor, static): the contract of
csrc/gemm/quant_per_token.cu, the fused Triton producers (:mod:`lqe.kernels.fused_quant`) and the W8A8 quant
layers. It lives beside :mod:`lqe.kernels.gemm_ref` so kernels and their tests reach it without importing the
quant layers; :mod:`lqe.quant_layers.reference` re-exports it for the converter.

Rounding is round-half-to-even (``torch.round``; the CUDA kernels use ``cvt.rni.sat.s8.f32``), results
saturate to int8.
"""
from __future__ import annotations

import torch


def per_token_quant_int8(x: torch.Tensor, symmetric: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Dynamic per-row int8 quantization of ``x [M, K]``.

    symmetric: ``s = absmax/127``, ``q = sat(round(x * 127/absmax))``. Every quotient is the correctly rounded fp32
    one (``127/absmax`` is formed in float64 and rounded once: torch's CPU ``scalar / tensor`` multiplies by a
    reciprocal instead, which differs in the last bit for a quarter of the values); the CUDA kernel
    (csrc/gemm/quant_per_token.cu, ``__fdiv_rn``) computes the same bits.
    asymmetric: ``s = (max-min)/255``, ``azp = round(-128 - min/s)``, ``q = sat(round(x/s) + azp)``.
    All-zero rows give ``s = 0`` and ``q = 0`` (``azp = 0``). Returns ``(q int8, s float32 [M,1], azp int32 [M,1] | None)``."""
    xf = x.float()
    if symmetric:
        absmax = xf.abs().amax(dim=-1, keepdim=True)
        inv = torch.where(absmax > 0, (127.0 / absmax.double()).float(), torch.zeros_like(absmax))
        q = torch.round(xf * inv).clamp(-128, 127).to(torch.int8)
        return q, absmax / 127.0, None
    xmin, xmax = xf.amin(dim=-1, keepdim=True), xf.amax(dim=-1, keepdim=True)
    scale = (xmax - xmin) / 255.0
    nz = scale > 0
    safe = torch.where(nz, scale, torch.ones_like(scale))
    azp = torch.where(nz, torch.round(-128.0 - xmin / safe), torch.zeros_like(scale))
    q = torch.where(nz, torch.round(xf / safe) + azp, torch.zeros_like(xf)).clamp(-128, 127).to(torch.int8)
    return q, scale, azp.to(torch.int32)


def static_quant_int8(x: torch.Tensor, scale: torch.Tensor | float, azp: torch.Tensor | int | None = None) -> torch.Tensor:
    """Static per-tensor int8 quantization: ``sat(round(x / scale) (+ azp))``."""
    q = torch.round(x.float() / torch.as_tensor(scale, dtype=torch.float32))
    if azp is not None:
        q = q + torch.as_tensor(azp, dtype=torch.float32)
    return q.clamp(-128, 127).to(torch.int8)
