"""An activation that arrives already quantized, from the op that produced it (RMSNorm or SiLU-mul fused with the
activation quantization of its consumer: int8 in :mod:`lqe.kernels.fused_quant`, fp8 in
:mod:`lqe.kernels.fused_quant_fp8`).

A linear method whose :meth:`~lqe.quant_layers.base.LinearMethod.input_quant` returns an :class:`ActQuant` may be
handed a :class:`QuantizedActivation` of that scheme in place of the float tensor, and skips its own quantization.
Who produces one is decided once after loading (:mod:`lqe.layers.act_quant_fusion`), so model code never branches on
it: it passes the value along as it would the float tensor (``.shape`` and ``.dtype`` are the float activation's).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_PER_TOKEN_SYM = "int8-per-token-sym"  # q = sat(rne(x * 127/absmax)), scale = absmax/127 per row (no zero point)
INT8_PER_TOKEN_ASYM = "int8-per-token-asym"  # scale = (max-min)/255, azp = rne(-128 - min/scale) per row
INT8_STATIC = "int8-static"  # the consumer's calibrated per-tensor scale (and zero point): q = sat(rne(x/s) + azp)
FP8_PER_TOKEN = "fp8-per-token"  # e4m3, scale = max(absmax, 1e-12)/448 per row
FP8_PER_GROUP = "fp8-per-group"  # e4m3 per 1 x group columns (128: the activations of 128x128 block-scaled weights)
FP8_STATIC = "fp8-static"  # e4m3 with the consumer's static per-tensor scale (a checkpoint's input_scale)
SCHEMES = (INT8_PER_TOKEN_SYM, INT8_PER_TOKEN_ASYM, INT8_STATIC, FP8_PER_TOKEN, FP8_PER_GROUP, FP8_STATIC)
STATIC_SCHEMES = (INT8_STATIC, FP8_STATIC)  # the consumer's own scale, read by the producer on the device


@dataclass(frozen=True, eq=False)
class ActQuant:
    """What a consumer takes pre-quantized: a scheme of :data:`SCHEMES`, the group width of ``FP8_PER_GROUP``, and
    for ``INT8_STATIC`` / ``FP8_STATIC`` the consumer's own fp32 ``[1]`` scale (and for int8 an optional int32 ``[1]``
    zero point): its buffers, which the producer reads on the device, so a producer serves exactly the consumer that
    offered them."""
    scheme: str
    group: int = 0
    scale: torch.Tensor | None = None
    zero_point: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"activation quantization scheme {self.scheme!r} is not one of {SCHEMES}")
        if (self.scheme == FP8_PER_GROUP) != (self.group > 0):
            raise ValueError(f"{self.scheme}: group={self.group} (a group width goes with {FP8_PER_GROUP} only)")
        if (self.scheme in STATIC_SCHEMES) != (self.scale is not None) or (
                self.zero_point is not None and self.scheme != INT8_STATIC):
            raise ValueError(f"{self.scheme}: a scale goes with {' / '.join(STATIC_SCHEMES)} only, and each of them "
                             f"needs one; a zero point goes with {INT8_STATIC} only")

    def same_as(self, other: "ActQuant | None") -> bool:
        """Whether one producer output serves both (same scheme, group and static values)."""
        if other is None or (self.scheme, self.group) != (other.scheme, other.group):
            return False
        pairs = ((self.scale, other.scale), (self.zero_point, other.zero_point))
        return all((a is None) == (b is None) and (a is None or torch.equal(a, b)) for a, b in pairs)

    def __str__(self) -> str:
        if self.scheme == FP8_PER_GROUP:
            return f"{self.scheme}({self.group})"
        if self.scheme == INT8_STATIC:
            return f"{self.scheme}({'asym' if self.zero_point is not None else 'sym'})"
        return self.scheme

    # ---- the producers: one fused kernel on CUDA, the torch twin (the unfused ops, op for op) elsewhere
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
        """``rms_norm(x, weight, eps, residual)`` quantized: ``QuantizedActivation`` (and the new residual)."""
        if self.scheme.startswith("fp8"):
            from lqe.kernels.fused_quant_fp8 import rms_norm_quant_fp8

            q, scale, residual = rms_norm_quant_fp8(x, weight, eps, residual, self.group, use_triton=x.is_cuda,
                                                    scale=self.scale)
            azp = None
        else:
            from lqe.kernels.fused_quant import rms_norm_quant_int8_any

            q, scale, azp, residual = rms_norm_quant_int8_any(x, weight, eps, residual, self.scheme == INT8_PER_TOKEN_SYM,
                                                              self.scale, self.zero_point, use_triton=x.is_cuda)
        out = QuantizedActivation(q, scale, x.dtype, self.scheme, azp)
        return out if residual is None else (out, residual)

    def silu_mul(self, x: torch.Tensor) -> "QuantizedActivation":
        """``silu(gate) * up`` of ``x [..., 2I]`` quantized."""
        if self.scheme.startswith("fp8"):
            from lqe.kernels.fused_quant_fp8 import silu_mul_quant_fp8

            (q, scale), azp = silu_mul_quant_fp8(x, self.group, use_triton=x.is_cuda, scale=self.scale), None
        else:
            from lqe.kernels.fused_quant import silu_mul_quant_int8_any

            q, scale, azp = silu_mul_quant_int8_any(x, self.scheme == INT8_PER_TOKEN_SYM, self.scale, self.zero_point,
                                                    use_triton=x.is_cuda)
        return QuantizedActivation(q, scale, x.dtype, self.scheme, azp)


@dataclass(slots=True, frozen=True)
class QuantizedActivation:
    q: torch.Tensor  # int8 / float8_e4m3fn [..., K]
    scale: torch.Tensor  # fp32 [..., 1] per token, [..., K / group] per group, [1] static (the consumer's tensor)
    dtype: torch.dtype  # the float activation's dtype: the consumer's output dtype
    scheme: str = INT8_PER_TOKEN_SYM
    azp: torch.Tensor | None = None  # int32 zero point: [..., 1] per token (asymmetric), [1] static

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(q [M, K], scale, azp)``: the layout the W8A8 / FP8 kernels take (scale ``[M]`` per token, ``[M, G]`` per
        group, ``[1]`` static; azp ``[M]``, ``[1]`` or None)."""
        s = self.scale
        s = s.reshape(-1, s.shape[-1]) if self.scheme == FP8_PER_GROUP else s.reshape(-1)
        return self.q.reshape(-1, self.q.shape[-1]), s, None if self.azp is None else self.azp.reshape(-1)

    def dequantize(self) -> torch.Tensor:
        """The float activation it approximates (for inspection and tests; the fused path never calls it)."""
        q = self.q.float() - (0 if self.azp is None else self.azp.float())
        s = self.scale
        if self.scheme == FP8_PER_GROUP:
            return (q.unflatten(-1, (s.shape[-1], -1)) * s[..., None]).flatten(-2).to(self.dtype)
        return (q * s).to(self.dtype)
