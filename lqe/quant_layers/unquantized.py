"""Float linear layers (fp32 / fp16 / bf16): the baseline every quantized method is compared with."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lqe.quant_layers.base import LinearMethod, empty_param


class UnquantizedLinearMethod(LinearMethod):
    supports_tensor_parallel = True

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype) -> None:
        layer.register_parameter("weight", empty_param((sum(output_sizes), input_size), params_dtype, output_dim=0, input_dim=1))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def describe(self, layer: nn.Module) -> str:
        return f"unquantized {str(layer.weight.dtype).removeprefix('torch.')}"
