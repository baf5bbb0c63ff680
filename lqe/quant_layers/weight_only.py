"""Shared tail of every weight-only method (GPTQ, AWQ, compressed-tensors pack-quantized): the checkpoint
tensors are decoded once to a CanonicalWeight, handed to the selected kernel and freed; ``apply`` calls it.

On a CUDA device the selected kernel is the lqe W4A16/W8A16 CUDA GEMM when it supports the weight
(:class:`~lqe.quant_layers.wna16_kernels.CudaWNA16`); otherwise the torch path, with the reason logged once per
layer kind and shown by ``describe()``."""
from __future__ import annotations

import warnings

import torch
from torch import nn

from lqe.quant_layers.base import LinearMethod
from lqe.quant_layers.canonical import CanonicalWeight
from lqe.quant_layers.loading import drop_params
from lqe.quant_layers.wna16_kernels import cuda_kernels_declined, layer_kind, log_fallback_once, select_w4a16_kernel


class QuantWarning(UserWarning):
    """A checkpoint oddity lqe can load but the user should know about."""


def warn(msg: str) -> None:
    warnings.warn(msg, QuantWarning, stacklevel=3)


def group_label(group_size: int) -> str:
    return "channel" if group_size == -1 else f"g{group_size}"


class WeightOnlyMethod(LinearMethod):
    """Subclasses implement ``create_weights`` and ``decode(layer) -> (CanonicalWeight, label)``."""

    CHECKPOINT_PARAMS: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.summary = ""

    def decode(self, layer: nn.Module) -> tuple[CanonicalWeight, str]:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        cw, label = self.decode(layer)
        order = " act-order" if cw.g_idx is not None else ""
        device = next((p.device for p in layer.parameters()), torch.device("cpu"))
        kernel, reasons = select_w4a16_kernel(cw, device, layer.params_dtype)
        del cw  # the kernel holds its own (repacked) copy; free the decoded codes now
        drop_params(layer, list(self.CHECKPOINT_PARAMS))
        layer.qkernel = kernel
        if cuda_kernels_declined(device) is None and reasons and getattr(kernel, "why", ""):
            log_fallback_once(layer_kind(layer, label.split(" ")[0] + " weight-only"), kernel.why)
        self.summary = f"{label}{order}, {kernel.describe()}"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        out = layer.qkernel(x.reshape(-1, shape[-1]), bias)
        return out.reshape(*shape[:-1], out.shape[-1]).to(x.dtype)

    def describe(self, layer: nn.Module) -> str:
        return self.summary or f"{type(self).__name__} (weights not processed yet)"
