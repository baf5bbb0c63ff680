"""Gated activations on a fused ``[gate | up]`` tensor.

When its consumer takes quantized input (``output_quant``, an :class:`~lqe.quant_layers.quantized_activation.ActQuant`
set after loading by :mod:`lqe.layers.act_quant_fusion`), the activation returns its output quantized
(:class:`~lqe.quant_layers.quantized_activation.QuantizedActivation`, one fused kernel on GPU) in place of the float
tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lqe.quant_layers.quantized_activation import SCHEMES, ActQuant, QuantizedActivation


class SiluAndMul(nn.Module):
    supported_output_quant = SCHEMES

    def __init__(self) -> None:
        super().__init__()
        self.output_quant: ActQuant | None = None  # a scheme of supported_output_quant: return it quantized

    def forward(self, x: torch.Tensor) -> torch.Tensor | QuantizedActivation:
        if self.output_quant is not None:
            return self.output_quant.silu_mul(x)
        if x.is_cuda:
            from lqe.kernels.fused_ops import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


_ACTIVATIONS = {"silu": SiluAndMul}


def get_act_and_mul(name: str) -> nn.Module:
    if name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act={name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]()
