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
