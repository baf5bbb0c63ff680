"""Python entry points of ``lqe-w4a16-mma`` (csrc/gemm/w4a16_mma.cu) on the :mod:`lqe.kernels.repack_mma`
layout: the Marlin-class GEMM and, above the crossover of ``dispatch.WNA16_TABLE``, its dequantize + cuBLAS.

Graph capture: a call allocates nothing of its own that depends on more than M (the fp32 reduction workspace, one
``64 x n_pad`` slot per piece above k = 0 of a column tile, and the per-tile counters are one buffer per device,
reserved at load by :func:`reserve_workspace` and reused by every layer; the kernels leave the counters zero), makes no host sync, and picks its kernel from shapes only. The shared
workspace assumes one stream runs these layers at a time (the engine's case).
"""
from __future__ import annotations

import torch

from lqe.kernels.device_info import device_key, sm_count as device_sm_count
from lqe.kernels.mma_ref import workspace_slots
from lqe.kernels.repack_mma import TILE_K, TILE_N, PackedMMA

MAX_ROWS = 64  # kMmaMaxRows: rows of one launch (a larger M runs as several 64-row problems)
MMA_KERNEL = "lqe-w4a16-mma"
# The same GEMM with 8 warps per block splitting each k-tile (warps_k = 2: csrc/gemm/w4a16_mma.cu, KW) where it
# applies (one scale group per 64-row k-tile: g a power of two >= 64, or channel-wise; the device's opt-in shared
# memory holds the ring and the MB x 16 KB hand-over buffer); elsewhere it runs as lqe-w4a16-mma. A candidate until
# measured (benchmarks/kernels_w4a16.py).
MMA_K2_KERNEL = "lqe-w4a16-mma-k2"
# table name -> warps_k of the mma GEMM
MMA_GEMM_NAMES = {MMA_KERNEL: 1, MMA_K2_KERNEL: 2}
# Table names that the mma layout serves with its own dequantize + cuBLAS (its weights are in another layout
# than the wna16 kernels read).
MMA_DEQUANT_NAMES = ("dequant+cublas", "triton-dequant+cublas", "triton-dequant-l2+cublas",
                     "lqe-w4a16-mma-dequant+cublas")

_workspaces: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
# Buffers a larger reserve replaced: a CUDA graph captured earlier (another model's, in the same process) still
# addresses them, so they stay alive instead of going back to the caching allocator.
_retired: list[tuple[torch.Tensor, torch.Tensor]] = []


def workspace_elems(device: torch.device, n_pad: int, k_pad: int | None = None, sms: int | None = None) -> int:
    """fp32 elements of the workspace a launch on ``n_pad`` columns needs: one ``64 x n_pad`` slot per piece above
    k = 0 of a column tile (:func:`lqe.kernels.mma_ref.workspace_slots`), exact for ``k_pad`` and ``sms`` (default:
    the SM count), else the bound for any K: a tile's pieces above k = 0 are at most ``ceil(sms / n_tiles) + 1``."""
    sms = sms or sm_count(device)
    n_tiles = max(1, n_pad // TILE_N)
    slots = (workspace_slots(n_tiles, max(1, k_pad // TILE_K), sms) if k_pad
             else -(-sms // n_tiles) + 1)
    return max(1, slots) * MAX_ROWS * n_pad


def reserve_workspace(device: torch.device | str, n_pad: int, k_pad: int | None = None,
                      sms: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ws fp32, locks int32 [n_pad / 256])`` for ``device``, grown to fit a launch on ``n_pad`` columns
    (:func:`workspace_elems`: for ``k_pad`` rows striped over ``sms`` blocks, or for any K); call it at load time
    (outside graph capture) for every layer."""
    device, key = torch.device(device), device_key(device)
    ws, locks = _workspaces.get(key, (None, None))
    need = workspace_elems(device, n_pad, k_pad, sms)
    if ws is None or ws.numel() < need or locks.numel() < n_pad // TILE_N:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"lqe-w4a16-mma: workspace for n_pad={n_pad}, k_pad={k_pad}, sms={sms} was not reserved "
                               "before CUDA graph capture; call lqe.kernels.gemm_mma.reserve_workspace at load time")
        size = max(need, 0 if ws is None else ws.numel())
        n_locks = max(n_pad // TILE_N, 1, 0 if locks is None else locks.numel())
        if ws is not None:
            _retired.append((ws, locks))
        ws = torch.empty(size, dtype=torch.float32, device=device)
        locks = torch.zeros(n_locks, dtype=torch.int32, device=device)
        _workspaces[key] = (ws, locks)
    return ws, locks


def sm_count(device: torch.device) -> int:
    return device_sm_count(device, cpu_default=1)


def mma_gemm(ext, x2: torch.Tensor, p: PackedMMA, bias: torch.Tensor | None, out: torch.Tensor,
             sms: int | None = None, warps_k: int = 1) -> torch.Tensor:
    """``out = x2 @ W (+ bias)`` with the tensor-core GEMM; ``x2`` already gathered by ``p.perm`` and contiguous.
    ``sms`` overrides the number of stripes (default: the SM count); ``warps_k=2`` asks for the 8-warp k-split
    kernel (:data:`MMA_K2_KERNEL`, where it applies)."""
    if warps_k not in (1, 2):
        raise ValueError(f"lqe-w4a16-mma: warps_k={warps_k!r}: use 1 (4 warps per block) or 2 (8, splitting each "
                         "k-tile)")
    sms = int(sms) if sms else sm_count(x2.device)
    ws, locks = reserve_workspace(x2.device, p.n_pad, p.k_pad, sms)
    if x2.data_ptr() % 16:  # a view at an odd offset: cp.async copies 16-byte chunks (rare; one copy)
        x2 = x2.clone()
    ext.w4a16_mma_gemm(x2, p.qweight, p.scales, p.zeros, bias, out, ws, locks, p.bits, p.group_size, p.k_pad,
                       p.n_pad, sms, warps_k)
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
