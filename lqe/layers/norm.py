"""RMSNorm, optionally fused with the residual add (``x + residual`` is normalised and also returned).

When its consumer takes quantized input (``output_quant``, an :class:`~lqe.quant_layers.quantized_activation.ActQuant`
set after loading by :mod:`lqe.layers.act_quant_fusion`: int8 per token sym / asym, int8 static, fp8 per token or
per group), the norm returns its output quantized
(:class:`~lqe.quant_layers.quantized_activation.QuantizedActivation`, one fused kernel on GPU) in place of the float
tensor; the residual is the same either way.
"""
from __future__ import annotations

import torch
from torch import nn

from lqe.quant_layers.quantized_activation import SCHEMES, ActQuant


class RMSNorm(nn.Module):
    supported_output_quant = SCHEMES

    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        self.output_quant: ActQuant | None = None  # a scheme of supported_output_quant: return it quantized

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.output_quant is not None:
            return self.output_quant.rms_norm(x, self.weight, self.eps, residual)
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
