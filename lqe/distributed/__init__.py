"""Tensor parallelism: process-group state, the few collectives the model needs, and the worker processes.

With ``tensor_parallel_size=1`` (the default) nothing here touches ``torch.distributed``: the state reports rank 0
of 1 and every collective returns its input unchanged.
"""
from lqe.distributed.parallel_state import get_tp_rank, get_tp_size, tp_shard_range

__all__ = ["get_tp_rank", "get_tp_size", "tp_shard_range"]
