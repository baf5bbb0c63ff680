"""W8A8 int8 reference: activation quantization and the int8 GEMM with its scale epilogue (FORMATS.md §3.4).

Rounding is round-half-to-even (``torch.round``; the CUDA kernels use ``cvt.rni.sat.s8.f32``), results
saturate to int8. ``out = s_a * s_w * (acc - azp * colsum(W_q)) + bias`` with ``acc`` the exact int32 product.
"""
from __future__ import annotations

import torch

from lqe.kernels.act_quant_ref import per_token_quant_int8, static_quant_int8


def int8_gemm_ref(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    s_a: torch.Tensor | float,
    s_w: torch.Tensor | float,
    azp: torch.Tensor | int | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``x_q [M, K]`` int8 times ``w_q [N, K]`` int8 (torch layout) with int32 accumulation, then
    ``s_a [M,1]|scalar * s_w [N]|[N,1]|scalar * (acc - azp * colsum) + bias``. The accumulator is computed in
    float64, which is exact here (every partial sum is an integer below ``K * 2^14 < 2^53``) and runs on BLAS,
    on any device (an int64 matmul has no BLAS and takes minutes at prefill sizes)."""
    acc = x_q.to(torch.float64) @ w_q.to(torch.float64).t()
    if azp is not None:
        colsum = w_q.to(torch.float64).sum(dim=1)
        acc = acc - torch.as_tensor(azp, dtype=torch.float64, device=acc.device) * colsum
    s_w = torch.as_tensor(s_w, dtype=torch.float32, device=acc.device).reshape(-1)
    s_a = torch.as_tensor(s_a, dtype=torch.float32, device=acc.device)
    out = s_a.reshape(-1, 1) * s_w.reshape(1, -1) * acc.to(torch.float32) if s_a.numel() > 1 else s_a * s_w * acc.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def w8a8_linear_ref(
    x: torch.Tensor,
    w_q: torch.Tensor,
    s_w: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    input_zero_point: torch.Tensor | None = None,
    symmetric: bool = True,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The whole W8A8 linear: dynamic per-token activations when ``input_scale`` is None, else static."""
    if input_scale is None:
        x_q, s_a, azp = per_token_quant_int8(x, symmetric)
    else:
        x_q, s_a, azp = static_quant_int8(x, input_scale, input_zero_point), input_scale, input_zero_point
    return int8_gemm_ref(x_q, w_q, s_a, s_w, azp, bias, x.dtype)
