"""Checkpoints whose ``quantization_config`` says ``"quant_method": "fp8"`` (vLLM / HF ``FineGrainedFP8`` /
DeepSeek layout), and quantization at load time of float checkpoints (``quantization="fp8"`` / ``"int8"``).

fp8 checkpoints: ``weight`` float8_e4m3fn ``[N, K]`` with a per-tensor ``weight_scale`` (one scalar per fused
shard), or with ``weight_block_size: [bh, bw]`` a block scale ``weight_scale_inv [ceil(N/bh), ceil(K/bw)]``
(despite its name, a multiplier: ``w = fp8 * scale``); ``activation_scheme`` ``dynamic`` (per-token scales at run
time) or ``static`` (an ``input_scale`` per layer). Both run through :class:`FP8Method`, the compressed-tensors FP8
path: ``torch._scaled_mm`` where the GPU has FP8 and the scales are per tensor / channel, else dequantize + matmul.
``ignored_layers`` / ``modules_to_not_convert`` stay float.

Online: the float weights load as usual, then each linear (not ``lm_head``) is quantized once in
``process_weights_after_loading`` with :func:`reference.quantize_fp8` (per-channel e4m3) or
:func:`reference.quantize_int8_per_channel`, and runs as the matching compressed-tensors W8A8 method with dynamic
per-token activations.
"""
from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch
from torch import nn

from lqe.distributed.comm import tp_all_reduce_op
from lqe.quant_layers import reference as ref
from lqe.quant_layers.base import LinearMethod, QuantConfig
from lqe.quant_layers.ct_scheme import CTScheme, QArgs
from lqe.quant_layers.fp8 import FP8Method
from lqe.quant_layers.loading import FLOAT_DTYPES, add_param, require_loaded
from lqe.quant_layers.prefixes import is_lm_head, resolve_shards
from lqe.quant_layers.unquantized import UnquantizedLinearMethod
from lqe.quant_layers.w8a8 import W8A8Int8Method

logger = logging.getLogger("lqe")


def _fp8_scheme(block: list[int] | None, dynamic: bool, name: str = "fp8") -> CTScheme:
    w = QArgs(8, "float", True, None, "block" if block else "tensor", False, None, list(block) if block else None)
    a = QArgs(8, "float", True, None, "token" if dynamic else "tensor", dynamic)
    return CTScheme(name, ["Linear"], w, a, "float-quantized", "fp8")


class Fp8Config(QuantConfig):
    name: ClassVar[str] = "fp8"

    def __init__(self, block: list[int] | None, dynamic: bool, ignored: list[str]) -> None:
        self.block, self.dynamic, self.ignored = block, dynamic, ignored
        self.scheme = _fp8_scheme(block, dynamic)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "Fp8Config":
        scheme = str(cfg.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 quantization_config: activation_scheme {cfg.get('activation_scheme')!r} is not "
                             "supported; expected 'dynamic' or 'static'")
        fmt = str(cfg.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"fp8 quantization_config: fmt {fmt!r} is not supported; lqe reads float8_e4m3fn weights")
        block = cfg.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
                raise ValueError(f"fp8 quantization_config: weight_block_size must be [rows, cols] of positive ints, got {block!r}")
            if scheme == "static":
                raise ValueError("fp8 quantization_config: block-scaled weights need activation_scheme 'dynamic' "
                                 "(static activation scales with weight_block_size are not a published format)")
        ignored = list(cfg.get("ignored_layers") or []) + list(cfg.get("modules_to_not_convert") or [])
        return cls(list(block) if block else None, scheme == "dynamic", ignored)

    def _ignored(self, name: str) -> bool:
        return any(name == m or name.startswith(m + ".") or name.endswith("." + m) or m == name.rpartition(".")[2]
                   for m in self.ignored)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if is_lm_head(prefix) and not any(m.endswith("lm_head") for m in self.ignored):
            return None  # vLLM and HF leave lm_head float in these checkpoints
        if resolve_shards(prefix, self._ignored, "`ignored_layers` membership"):
            return None
        return Fp8CheckpointMethod(self.scheme)


class Fp8CheckpointMethod(FP8Method):
    """:class:`FP8Method` with the block scale named ``weight_scale_inv`` as these checkpoints name it."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype) -> None:
        super().create_weights(layer, input_size, output_sizes, params_dtype)
        if self.s.weights.strategy == "block":
            p = layer._parameters.pop("weight_scale")
            bh = self.block[0]
            add_param(layer, "weight_scale_inv", p, FLOAT_DTYPES, packed_size=lambda size: -(-size // bh))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if "weight_scale_inv" in layer._parameters:
            require_loaded(layer, ["weight", "weight_scale_inv"])
            layer._parameters["weight_scale"] = layer._parameters.pop("weight_scale_inv")
        super().process_weights_after_loading(layer)


class OnlineQuantConfig(QuantConfig):
    """``quantization="fp8"`` or ``"int8"`` on a float checkpoint: every linear but ``lm_head`` is quantized
    per output channel when the weights are loaded; activations are quantized per token at run time."""

    name: ClassVar[str] = "online"
    KINDS = ("fp8", "int8")

    def __init__(self, kind: str) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"quantize-on-load supports {self.KINDS}, not {kind!r}")
        self.kind = kind
        if kind == "fp8":
            self.scheme = CTScheme("online-fp8", ["Linear"], QArgs(8, "float", True, None, "channel"),
                                   QArgs(8, "float", True, None, "token", True), "float-quantized", "fp8")
        else:
            self.scheme = CTScheme("online-int8", ["Linear"], QArgs(8, "int", True, None, "channel"),
                                   QArgs(8, "int", True, None, "token", True), "int-quantized", "w8a8_int8")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "OnlineQuantConfig":
        return cls(str(cfg.get("quant_method", "")))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if is_lm_head(prefix):
            return None
        return (OnlineFP8Method if self.kind == "fp8" else OnlineInt8Method)(self.scheme)


def _swap_in_quantized(layer: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Replace the loaded float ``weight`` by ``q`` and add a per-channel ``weight_scale``, both marked loaded."""
    for name, t in (("weight", q), ("weight_scale", scale.float().reshape(-1, 1))):
        p = nn.Parameter(t.contiguous(), requires_grad=False)
        p.loaded_shards = {None}
        layer._parameters[name] = p


class _OnlineMixin:
    """Create the float weight like an unquantized layer; quantize it once after loading."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype) -> None:
        UnquantizedLinearMethod().create_weights(layer, input_size, output_sizes, params_dtype)

    def _quantize(self, w: torch.Tensor, absmax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data
        if torch.isnan(w).any():
            raise ValueError(f"tensor {layer.prefix}.weight is missing from the checkpoint (quantize-on-load)")
        absmax = None
        if getattr(layer, "tp_mode", None) == "row":  # each rank holds part of every row: scale by the whole row
            absmax = tp_all_reduce_op(w.float().abs().amax(dim=1, keepdim=True).contiguous(), "max")
        q, scale = self._quantize(w, absmax)
        _swap_in_quantized(layer, q.to(w.device), scale.to(w.device))
        super().process_weights_after_loading(layer)  # type: ignore[misc]


class OnlineFP8Method(_OnlineMixin, FP8Method):
    def _quantize(self, w: torch.Tensor, absmax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return ref.quantize_fp8(w, per_channel=True, absmax=absmax)


class OnlineInt8Method(_OnlineMixin, W8A8Int8Method):
    def _quantize(self, w: torch.Tensor, absmax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return ref.quantize_int8_per_channel(w, absmax)


def log_online(kind: str) -> None:
    what = ("fp8 e4m3 weights per output channel, fp8 activations per token (torch._scaled_mm on FP8 GPUs, "
            "weight-only dequant elsewhere)" if kind == "fp8" else
            "int8 weights per output channel, int8 activations per token (W8A8)")
    logger.info("quantization=%r on an unquantized checkpoint: quantizing every linear layer except lm_head at load "
                "time to %s", kind, what)

