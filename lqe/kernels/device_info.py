"""Facts about the device that kernel planning needs (no triton import)."""
from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device | None, cpu_default: int) -> int:
    """Multiprocessors of a CUDA ``device``; ``cpu_default`` for anything else (the interpreter and CPU tests,
    where the callers want a small fixed grid)."""
    if device is None or device.type != "cuda":
        return cpu_default
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def device_key(device: torch.device | str) -> str:
    """The name a per-device buffer is kept under: ``"cuda"`` and ``"cuda:<current>"`` are one device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def cuda_fault() -> str | None:
    """The error every CUDA call of this process now raises, or None while the CUDA context is usable.

    A kernel that faults on the device (an illegal or misaligned address, a trap) leaves the context unusable: each
    later call fails with the same error, so a test run or a benchmark that goes on in the same process reports a
    failure for everything after the culprit. Callers that isolate work (tests/device_faults.py, the GPU
    benchmarks) ask this after a failure and go on in a fresh process. A non-sticky error (out of memory, a bad
    launch argument, a Triton kernel that does not fit) leaves the context usable and gives None.
    """
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    try:
        torch.empty(1, device="cuda").zero_()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 -- whatever the runtime raises is the answer
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return None


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


PDL_ENV = "LQE_PDL"


def pdl_enabled(device: torch.device) -> bool:
    """Launch the kernels that support it with programmatic dependent launch (PDL): on by default on a CUDA device of
    compute capability 9.0 or later (Hopper), ``LQE_PDL=0`` turns it off. Such a kernel is scheduled while the kernel
    before it on the stream still runs and waits for that kernel's results in the kernel (``pdl_wait`` in
    csrc/gemm/gemm_common.cuh, :mod:`lqe.kernels.triton_pdl`), hiding the launch of each kernel of a decode step; the
    GEMVs also start on their weights before the wait. Same results either way (tests/gpu/test_gemm_wna16.py,
    test_pdl_models.py). Measured on the H200 at af342f8 (benchmarks/results/e2e-nvidia-h200.json, smollm2 shape,
    each variant beside its LQE_PDL=1 twin): the GPU time of a batch-1 decode step 0.96 -> 0.83 ms (bf16), 1.01 ->
    0.75 (W4A16), 0.92 -> 0.68 (W8A8); decode at batch 1 / 16 +24 / +9 % (W4A16) and +29 / +24 % (W8A8); the CUDA
    GEMV alone 1.54 -> 1.69x cuBLAS bf16 at M = 1 (kernels-w4a16-nvidia-h200.json). The bf16 pair's decode tok/s
    fell then (867 -> 703 at batch 1) with its host time per step at 1.07 ms against 0.32, which PDL does not touch.
    Measured again at 50fb9ce with PDL the default (same file, each variant beside its LQE_PDL=0 twin): the GPU time
    per step 0.96 -> 0.82 (bf16), 1.01 -> 0.77 (W4A16), 0.91 -> 0.68 ms (W8A8), and decode at batch 1 faster for all
    three (786 -> 822, 727 -> 932, 772 -> 930 tok/s); at batch 16 bf16 +19 %, W4A16 +10 %, W8A8 -3 %. Read per call,
    as ``LQE_WNA16_TABLE`` is, so a benchmark can compare both in one process. Any other value than ``0`` / ``1`` /
    unset is an error naming them."""
    value = os.environ.get(PDL_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{PDL_ENV}={value!r}: use 0 (no programmatic dependent launch), or 1 / unset (on, on sm_90+)")
    return value != "0" and pdl_supported(device)


def pdl_supported(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or later (``griddepcontrol``)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9
