"""W8A8 int8 GEMM with fused scales (csrc/gemm/w8a8_gemm.cu), per-token int8 activation quantization
(csrc/gemm/quant_per_token.cu), and FP8 W8A8 through ``torch._scaled_mm`` (Hopper / Ada)."""
from __future__ import annotations

import math

import torch

from lqe.kernels.gemm import BLOCK_N, counters, ext, plan_slabs_per_split
from lqe.kernels.repack import PackedW8A8

FP8_MAX = 448.0  # float8_e4m3fn


def quantize_per_token(x: torch.Tensor, symmetric: bool = True):
    """``x [M, K]`` fp16/bf16 -> ``(q int8 [M, K], scale fp32 [M], azp int32 [M] or None)``."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    m = x2.shape[0]
    q = torch.empty_like(x2, dtype=torch.int8)
    scale = torch.empty(m, dtype=torch.float32, device=x2.device)
    azp = None if symmetric else torch.empty(m, dtype=torch.int32, device=x2.device)
    ext().quantize_per_token(x2, q, scale, azp)
    return q, scale, azp


def w8a8_gemm(xq: torch.Tensor, a_scale: torch.Tensor, packed: PackedW8A8, azp: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
              out: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """``a_scale[m] * w_scale[n] * (xq @ Wq - azp[m] * colsum[n]) + bias[n]``; ``a_scale`` per token ``[M]`` or
    a static per-tensor scalar."""
    m = xq.shape[0]
    a_scale = a_scale.float().reshape(-1)
    if a_scale.numel() == 1 and m != 1:
        a_scale = a_scale.expand(m)
    a_scale = a_scale.contiguous()
    if azp is not None:
        azp = azp.to(torch.int32).reshape(-1).expand(m).contiguous()
    if out is None:
        out = torch.empty(m, packed.n, dtype=out_dtype, device=xq.device)
    spp = plan_slabs_per_split(m, packed.n, packed.k, xq.device, 32, 2, splits)
    cnt = counters(xq.device, math.ceil(packed.n / BLOCK_N) * math.ceil(m / 16))
    ext().w8a8_gemm(xq.contiguous(), a_scale, azp, packed.qweight, packed.w_scale,
                    packed.colsum if azp is not None else None, bias, out, spp, cnt)
    return out


def w8a8_linear(x: torch.Tensor, packed: PackedW8A8, bias: torch.Tensor | None = None,
                symmetric: bool = True) -> torch.Tensor:
    """Dynamic per-token quantization then the int8 GEMM, output in ``x``'s dtype."""
    lead = x.shape[:-1]
    q, s, azp = quantize_per_token(x, symmetric)
    return w8a8_gemm(q, s, packed, azp, bias, x.dtype).view(*lead, packed.n)


def fp8_supported(device: torch.device | str | None = None) -> str | None:
    """Why FP8 ``_scaled_mm`` cannot run here, or ``None``."""
    if not torch.cuda.is_available():
        return "CUDA not available"
    if not hasattr(torch, "float8_e4m3fn"):
        return "this torch has no float8_e4m3fn"
    cap = torch.cuda.get_device_capability(device)
    return None if cap >= (8, 9) else f"compute capability {cap[0]}.{cap[1]} < 8.9 (no FP8 tensor cores)"


def fp8_quantize_weight(w_kn: torch.Tensor):
    """``[K, N]`` float -> (fp8 ``[N, K]`` row-major, fp32 per-channel scale ``[1, N]``)."""
    s = (w_kn.float().abs().amax(0).clamp(min=1e-12) / FP8_MAX)
    q = (w_kn.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.t().contiguous(), s.reshape(1, -1).contiguous()


def fp8_quantize_per_token(x: torch.Tensor):
    """``[M, K]`` -> (fp8 ``[M, K]``, fp32 ``[M, 1]``) dynamic per-token scales."""
    s = (x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX)
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq_nk: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 W8A8 via ``torch._scaled_mm`` with row-wise (per-token x per-channel) scales."""
    return torch._scaled_mm(xq, wq_nk.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=out_dtype)


def fp8_linear(x: torch.Tensor, wq_nk: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None):
    lead = x.shape[:-1]
    xq, xs = fp8_quantize_per_token(x.reshape(-1, x.shape[-1]))
    return fp8_gemm(xq, xs, wq_nk, w_scale, bias, x.dtype).view(*lead, wq_nk.shape[0])
