"""RMSNorm, optionally fused with the residual add (``x + residual`` is normalised and also returned)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda:  # one fused Triton kernel on GPU (same rounding as below)
            from lqe.kernels.fused_ops import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return out if residual is None else (out, residual)
