"""Which tensor-parallel rank this process is, out of how many.

A worker process (:func:`~lqe.distributed.worker.worker_main`) belongs to one engine for its whole life: it joins the
process group with :func:`init_tensor_parallel`, which sets its rank and size for the process. The driver (the
user's process, rank 0) may hold several engines over its life, and a tensor-parallel one beside ones without
tensor parallelism, so there the rank and size are set only inside :func:`tp_scope`, which the engine enters while
it builds its model and while it runs a step (thread-local, so an engine stepping in another thread is not
affected). Layers read them while they are constructed, as vLLM's ``get_tensor_model_parallel_rank()``, and the
collectives (:mod:`lqe.distributed.comm`) while they run.

The process group (``torch.distributed``'s default group) is one per process: one tensor-parallel engine at a
time. :func:`init_tensor_parallel` says so clearly when another one still holds it.
"""
from __future__ import annotations

import datetime
import threading
from contextlib import contextmanager
from typing import Iterator

import torch

_PROCESS = (0, 1)  # (rank, size) of a worker process, set once by init_tensor_parallel
_SCOPE = threading.local()  # .state: the driver's (rank, size) inside tp_scope
_GROUP_OWNER: str | None = None  # what holds the process group this process joined, for error messages


def _state() -> tuple[int, int]:
    return getattr(_SCOPE, "state", None) or _PROCESS


def get_tp_rank() -> int:
    return _state()[0]


def get_tp_size() -> int:
    return _state()[1]


@contextmanager
def tp_scope(rank: int, size: int) -> Iterator[None]:
    """Rank ``rank`` of ``size`` for the code inside (the driver's model build and steps); restored after."""
    prev = getattr(_SCOPE, "state", None)
    _SCOPE.state = (rank, size)
    try:
        yield
    finally:
        _SCOPE.state = prev


def tp_shard_range(total: int, num_chunks: int, index: int) -> tuple[int, int]:
    """(offset, size) of chunk ``index`` when ``total`` is split into ``num_chunks`` equal chunks."""
    if total % num_chunks:
        raise ValueError(f"{total} is not divisible into {num_chunks} equal tensor-parallel chunks")
    size = total // num_chunks
    return index * size, size


def backend_for(device: torch.device) -> str:
    """NCCL on CUDA, gloo elsewhere: the only difference between the GPU and the tested CPU path."""
    return "nccl" if device.type == "cuda" else "gloo"


def check_group_free(size: int) -> None:
    """Raise a clear error when this process already holds a process group (before anything is spawned)."""
    if size <= 1:
        return
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    if _GROUP_OWNER is not None:
        raise RuntimeError(
            f"tensor_parallel_size={size}: {_GROUP_OWNER} is still alive in this process and holds its "
            "torch.distributed process group (one per process). Call its shutdown() (or create it with "
            "`with LLM(...) as llm:`, or `del` it) before creating another tensor-parallel LLM; LLMs with "
            "tensor_parallel_size=1 can run beside it.")
    raise RuntimeError(
        f"tensor_parallel_size={size}: torch.distributed is already initialized in this process (not by lqe); "
        "lqe starts its own process group for tensor parallelism. Call torch.distributed.destroy_process_group() "
        "first, or use tensor_parallel_size=1.")


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float,
                         owner: str | None = None) -> None:
    """Join the process group (``size > 1`` only). A worker (``owner`` None) also takes ``rank``/``size`` as its
    process-wide state; the driver names its ``owner`` and sets its rank per call with :func:`tp_scope`."""
    global _PROCESS, _GROUP_OWNER
    if size > 1:
        import torch.distributed as dist

        check_group_free(size)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        _GROUP_OWNER = owner or f"tensor-parallel rank {rank}"
    if owner is None:
        _PROCESS = (rank, size)


def destroy_tensor_parallel() -> None:
    """Leave the process group this process joined (a no-op when it joined none)."""
    global _PROCESS, _GROUP_OWNER
    if _GROUP_OWNER is not None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    _PROCESS, _GROUP_OWNER = (0, 1), None
