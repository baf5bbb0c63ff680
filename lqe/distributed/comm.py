"""The collectives of a tensor-parallel forward: each is the identity when the tensor-parallel size is 1."""
from __future__ import annotations

from typing import Any

import torch

from lqe.distributed.parallel_state import get_tp_size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over the ranks (row-parallel linear outputs, vocab-parallel embedding)."""
    if get_tp_size() == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def tp_all_reduce_op(x: torch.Tensor, op: str) -> torch.Tensor:
    """Elementwise ``"min"`` / ``"max"`` of ``x`` over the ranks (the global range of sharded activations)."""
    if get_tp_size() == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, op={"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
    return x


def tp_all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim, in rank order (vocab-parallel logits)."""
    n = get_tp_size()
    if n == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def tp_min_int(value: int) -> int:
    """The smallest ``value`` over the ranks (the KV block count every rank can hold)."""
    if get_tp_size() == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def tp_broadcast_object(obj: Any = None) -> Any:
    """Rank 0's ``obj`` on every rank (the driver's step commands)."""
    if get_tp_size() == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
