"""An activation that arrives already quantized, from the op that produced it (RMSNorm or SiLU-mul fused with the
per-token int8 quantization, :mod:`lqe.kernels.fused_quant`).

A linear method whose :meth:`~lqe.quant_layers.base.LinearMethod.input_quant` names a scheme may be handed a
:class:`QuantizedActivation` of that scheme in place of the float tensor, and skips its own quantization. Who
produces one is decided once after loading (:mod:`lqe.layers.act_quant_fusion`), so model code never branches on it:
it passes the value along as it would the float tensor (``.shape`` and ``.dtype`` are the float activation's).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_PER_TOKEN_SYM = "int8-per-token-sym"  # q = sat(rne(x * 127/absmax)), scale = absmax/127 per row (no zero point)


@dataclass(slots=True, frozen=True)
class QuantizedActivation:
    q: torch.Tensor  # int8 [..., K]
    scale: torch.Tensor  # fp32 [..., 1]
    dtype: torch.dtype  # the float activation's dtype: the consumer's output dtype
    scheme: str = INT8_PER_TOKEN_SYM

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [M, K], scale [M])``: the layout the W8A8 kernels take."""
        return self.q.reshape(-1, self.q.shape[-1]), self.scale.reshape(-1)

    def dequantize(self) -> torch.Tensor:
        """The float activation it approximates (for inspection and tests; the fused path never calls it)."""
        return (self.q.float() * self.scale).to(self.dtype)
