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
from lqe.kernels.canonical import CanonicalWeight, build_canonical
from lqe.quant_layers.loading import drop_params
from lqe.quant_layers.wna16_kernels import cuda_kernels_declined, layer_kind, log_fallback_once, select_w4a16_kernel


class QuantWarning(UserWarning):
    """A checkpoint oddity lqe can load but the user should know about."""


def warn(msg: str) -> None:
    warnings.warn(msg, QuantWarning, stacklevel=3)


def group_label(group_size: int) -> str:
    return "channel" if group_size == -1 else f"g{group_size}"


def replicated_groups(layer: nn.Module, group_size: int) -> bool:
    """True for a grouped row-parallel (tensor-parallel) layer: it loads the scales / zero points of every group
    of the whole K, replicated over the ranks, because with act-order its rows read groups anywhere in K (vLLM's
    rule for act-order GPTQ on row-parallel layers). :func:`shard_canonical` keeps only this rank's groups when
    the rows turn out to be in plain order."""
    return getattr(layer, "tp_mode", None) == "row" and group_size != -1


def check_row_groups(layer: nn.Module, group_size: int, where: str, act_order: bool) -> None:
    """A row-parallel shard in plain group order must start on a group boundary (act-order shards need not)."""
    k = layer.input_size
    if replicated_groups(layer, group_size) and k % group_size and not act_order:
        raise ValueError(
            f"{where}: tensor_parallel_size={layer.tp_size} splits K={k * layer.tp_size} into shards of {k} rows, "
            f"which do not start on group_size={group_size} boundaries; use a tensor_parallel_size for which "
            f"K / N is a multiple of {group_size}")


def group_rows(layer: nn.Module, group_size: int) -> int:
    """Rows of the scales / zero-point parameters: this rank's groups, or every group when replicated."""
    from lqe.quant_layers.reference import num_groups

    k = layer.input_size
    return num_groups(k * layer.tp_size, group_size) if replicated_groups(layer, group_size) else num_groups(k, group_size)


def shard_canonical(layer: nn.Module, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    g_idx: torch.Tensor | None, bits: int, group_size: int) -> CanonicalWeight:
    """The CanonicalWeight of this rank's rows. On a replicated-groups layer ``scales`` / ``zeros`` hold every
    group and ``g_idx`` (this rank's rows) global group ids: rows in plain order keep only their own groups, so
    the same kernels run as with one rank; act-order rows keep every group and their global ``g_idx`` (the
    dequantize path runs them, as vLLM's non-Marlin path does)."""
    if not replicated_groups(layer, group_size):
        return build_canonical(codes, scales, zeros, g_idx, bits, group_size)
    k, rank, g = layer.input_size, layer.tp_rank, group_size
    rows = torch.arange(rank * k, (rank + 1) * k, device=codes.device)
    gi = rows // g if g_idx is None else g_idx.to(device=codes.device, dtype=torch.int64)
    total = scales.shape[0]
    if len(gi) and (int(gi.min()) < 0 or int(gi.max()) >= total):
        raise ValueError(f"tensor {layer.prefix}.g_idx: group ids must lie in [0, {total}) for K={k * layer.tp_size}, "
                         f"group_size={g}; found [{int(gi.min())}, {int(gi.max())}]")
    if (rank * k) % g == 0 and torch.equal(gi, rows // g):  # plain order from a group boundary: own groups only
        lo, hi = rank * k // g, rank * k // g + -(-k // g)
        return build_canonical(codes, scales[lo:hi], None if zeros is None else zeros[lo:hi], None, bits, g)
    return build_canonical(codes, scales, zeros, gi.to(torch.int32), bits, g, num_groups=total)


class WeightOnlyMethod(LinearMethod):
    """Subclasses implement ``create_weights`` and ``decode(layer) -> (CanonicalWeight, label)``."""

    supports_tensor_parallel = True

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
