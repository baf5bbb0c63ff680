"""Facts about the device that kernel planning needs (no triton import)."""
from __future__ import annotations

import functools

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
