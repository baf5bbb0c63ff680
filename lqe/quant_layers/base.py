"""The quantization interface: a config parsed from the checkpoint, asked per layer for a linear method.

A linear method is four verbs (DESIGN.md rule 3):

* ``create_weights``: register parameters on the layer, named exactly like the checkpoint tensors, each with
  attributes telling the layer's weight loader where a fused shard goes (``output_dim``, ``packed_dim``,
  ``pack_factor``) or with its own ``weight_loader``;
* the per-parameter ``weight_loader`` (see :mod:`lqe.layers.linear`);
* ``process_weights_after_loading``: decode / repack once into the form ``apply`` consumes;
* ``apply``: the forward pass. Nothing is converted lazily in here.

Model code never branches on quantization: it passes ``quant_config`` and the module's full prefix to every
linear layer, and the layer asks :meth:`QuantConfig.get_linear_method`; ``None`` means unquantized.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from lqe.quant_layers.quantized_activation import ActQuant


class LinearMethod(ABC):
    # every parameter carries ``output_dim`` / ``input_dim`` (or is replicated), so LinearBase.tp_slice can cut
    # each checkpoint tensor for a tensor-parallel rank; a method that cannot be sharded leaves this False
    supports_tensor_parallel: ClassVar[bool] = False

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype
    ) -> None:
        """Register the parameters for a layer computing ``[*, input_size] -> [*, sum(output_sizes)]``.

        ``output_sizes`` has one entry per fused shard (q, k, v or gate, up); a plain layer has one.
        """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        return None

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T + bias`` for ``x`` of shape ``[T, input_size]``."""

    def describe(self, layer: nn.Module) -> str:
        """One line for the start-up log: which path this layer runs on."""
        return type(self).__name__

    def input_quant(self, layer: nn.Module) -> "ActQuant | None":
        """The activation quantization (:class:`lqe.quant_layers.quantized_activation.ActQuant`) in which ``apply``
        also takes its input pre-quantized by the op producing it, or ``None`` (the default: float input only).
        Asked once after ``process_weights_after_loading``."""
        return None


class QuantConfig(ABC):
    """Parsed ``quantization_config`` of a checkpoint."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "QuantConfig":
        """Parse and validate the checkpoint's quantization config (raise ``ValueError`` naming the key)."""

    @abstractmethod
    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        """The method for the linear layer at ``prefix`` (e.g. ``model.layers.3.self_attn.qkv_proj``), or
        ``None`` when that layer is stored unquantized."""

    def supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16, torch.bfloat16]


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Attach loader metadata to a parameter (``output_dim``, ``input_dim``, ``packed_dim``, ``pack_factor``,
    ``weight_loader``)."""
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def empty_param(shape: tuple[int, ...] | list[int], dtype: torch.dtype, **attrs: Any) -> nn.Parameter:
    """A non-trainable parameter with loader metadata; the contents are filled by the weight loader.

    Float tensors start as NaN so a tensor the checkpoint never filled is loud rather than plausible."""
    data = torch.empty(tuple(shape), dtype=dtype)
    if data.is_floating_point():
        data.fill_(float("nan"))
    else:
        data.zero_()
    p = nn.Parameter(data, requires_grad=False)
    set_weight_attrs(p, attrs)
    return p
