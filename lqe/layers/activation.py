"""Gated activations on a fused ``[gate | up]`` tensor."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
