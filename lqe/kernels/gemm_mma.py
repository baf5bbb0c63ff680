"""Python entry points of ``lqe-w4a16-mma`` (csrc/gemm/w4a16_mma.cu) on the :mod:`lqe.kernels.repack_mma`
layout: the Marlin-class GEMM and, above the crossover of ``dispatch.WNA16_TABLE``, its dequantize + cuBLAS.

Graph capture: a call allocates nothing of its own that depends on more than M (the fp32 reduction workspace and
the per-tile locks are one buffer per device, reserved at load by :func:`reserve_workspace` and reused by every
layer; the kernels leave the locks zero), makes no host sync, and picks its kernel from shapes only. The shared
workspace assumes one stream runs these layers at a time (the engine's case).
"""
from __future__ import annotations

import torch

from lqe.kernels.device_info import device_key, sm_count as device_sm_count
from lqe.kernels.repack_mma import TILE_N, PackedMMA

MAX_ROWS = 64  # kMmaMaxRows: rows of one launch (a larger M runs as several 64-row problems)
MMA_KERNEL = "lqe-w4a16-mma"
# Table names that the mma layout serves with its own dequantize + cuBLAS (its weights are in another layout
# than the wna16 kernels read).
MMA_DEQUANT_NAMES = ("dequant+cublas", "triton-dequant+cublas", "triton-dequant-l2+cublas",
                     "lqe-w4a16-mma-dequant+cublas")

_workspaces: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
# Buffers a larger reserve replaced: a CUDA graph captured earlier (another model's, in the same process) still
# addresses them, so they stay alive instead of going back to the caching allocator.
_retired: list[tuple[torch.Tensor, torch.Tensor]] = []


def reserve_workspace(device: torch.device | str, n_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ws fp32 [64 * n_pad], locks int32 [n_pad / 256])`` for ``device``, grown to fit ``n_pad``; call it at
    load time (outside graph capture) for every layer's ``n_pad``."""
    device, key = torch.device(device), device_key(device)
    ws, locks = _workspaces.get(key, (None, None))
    if ws is None or ws.numel() < MAX_ROWS * n_pad:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"lqe-w4a16-mma: workspace for n_pad={n_pad} was not reserved before CUDA graph "
                               "capture; call lqe.kernels.gemm_mma.reserve_workspace at load time")
        size = max(MAX_ROWS * n_pad, 0 if ws is None else ws.numel())
        if ws is not None:
            _retired.append((ws, locks))
        ws = torch.empty(size, dtype=torch.float32, device=device)
        locks = torch.zeros(max(size // (MAX_ROWS * TILE_N), 1), dtype=torch.int32, device=device)
        _workspaces[key] = (ws, locks)
    return ws, locks


def sm_count(device: torch.device) -> int:
    return device_sm_count(device, cpu_default=1)


def mma_gemm(ext, x2: torch.Tensor, p: PackedMMA, bias: torch.Tensor | None, out: torch.Tensor,
             sms: int | None = None) -> torch.Tensor:
    """``out = x2 @ W (+ bias)`` with the tensor-core GEMM; ``x2`` already gathered by ``p.perm`` and contiguous.
    ``sms`` overrides the number of stripes (default: the SM count)."""
    ws, locks = reserve_workspace(x2.device, p.n_pad)
    if x2.data_ptr() % 16:  # a view at an odd offset: cp.async copies 16-byte chunks (rare; one copy)
        x2 = x2.clone()
    ext.w4a16_mma_gemm(x2, p.qweight, p.scales, p.zeros, bias, out, ws, locks, p.bits, p.group_size, p.k_pad,
                       p.n_pad, int(sms) if sms else sm_count(x2.device))
    return out


def mma_dequantize(ext, p: PackedMMA) -> torch.Tensor:
    """Dense ``[K, N]`` weights (sorted-K order), bit-identical to the GEMM's B fragments."""
    w = torch.empty(p.k, p.n, dtype=p.scales.dtype, device=p.qweight.device)
    return ext.w4a16_mma_dequant(p.qweight, p.scales, p.zeros, w, p.bits, p.group_size, p.k_pad, p.n_pad)


def mma_dequant_matmul(ext, x2: torch.Tensor, p: PackedMMA, bias: torch.Tensor | None,
                       out: torch.Tensor) -> torch.Tensor:
    torch.matmul(x2, mma_dequantize(ext, p), out=out)
    if bias is not None:
        out.add_(bias)
    return out
