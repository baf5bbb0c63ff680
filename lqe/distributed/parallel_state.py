"""Which tensor-parallel rank this process is, out of how many.

Set once per process by :func:`init_tensor_parallel` (the driver in :class:`~lqe.distributed.worker.TPWorkerGroup`,
each worker in :func:`~lqe.distributed.worker.worker_main`) before the model is built; layers read it while
they are constructed, as vLLM's ``get_tensor_model_parallel_rank()``.
"""
from __future__ import annotations

import datetime

import torch

_TP_RANK = 0
_TP_SIZE = 1


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def tp_shard_range(total: int, num_chunks: int, index: int) -> tuple[int, int]:
    """(offset, size) of chunk ``index`` when ``total`` is split into ``num_chunks`` equal chunks."""
    if total % num_chunks:
        raise ValueError(f"{total} is not divisible into {num_chunks} equal tensor-parallel chunks")
    size = total // num_chunks
    return index * size, size


def backend_for(device: torch.device) -> str:
    """NCCL on CUDA, gloo elsewhere: the only difference between the GPU and the tested CPU path."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float) -> None:
    """Join the process group (``size > 1`` only) and record this process's rank."""
    global _TP_RANK, _TP_SIZE
    if size > 1:
        import torch.distributed as dist

        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    _TP_RANK, _TP_SIZE = rank, size


def destroy_tensor_parallel() -> None:
    global _TP_RANK, _TP_SIZE
    if _TP_SIZE > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _TP_RANK, _TP_SIZE = 0, 1
