"""Per-step metadata for attention, set around the model forward and cleared after (DESIGN.md rule 7).

Token layout of one step: the scheduled sequences' new tokens are concatenated ("flattened") into ``T``
tokens; sequence ``i`` owns tokens ``query_start_loc[i]:query_start_loc[i+1]``. Its KV cache after this step
holds ``seq_lens[i]`` tokens, of which the first ``context_lens[i] = seq_lens[i] - query_len`` were computed
in earlier steps (or found in the prefix cache). Token ``j`` of the step writes its K/V to cache slot
``slot_mapping[j] = block * block_size + offset`` (``-1``: padding, write nothing).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32, on device
    seq_lens: torch.Tensor  # [B] int32, on device
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # host copies, so a backend that loops over sequences never syncs with the device
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # decode split count fixed by the caller (a CUDA graph, whose grid cannot follow max_seq_len); None: choose
    num_splits: int | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(slots=True)
class ForwardContext:
    attn_metadata: AttentionMetadata
    # one tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_caches: list[torch.Tensor]
    # values every layer of the step shares (built by the first layer that needs them): see step_cached
    cache: dict = field(default_factory=dict)
    # piecewise-graph capture (lqe.engine.piecewise): when set, every Attention call hands (layer, q, k, v) to it
    # and returns what it returns (the static output the next captured piece reads) instead of attending
    split_attention: Callable | None = None


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: the model must be called inside set_forward_context(...)")
    return _CONTEXT


def step_cached(key: Any, build: Callable[[], Any]) -> Any:
    """``build()`` once per step: the first layer that asks builds it, the others reuse it (per-step metadata
    such as the rotary cos/sin gathered at the step's positions). Outside a forward context, ``build()``."""
    ctx = _CONTEXT
    if ctx is None:
        return build()
    value = ctx.cache.get(key)
    if value is None:
        value = ctx.cache[key] = build()
    return value


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[None]:
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield
    finally:
        _CONTEXT = prev
