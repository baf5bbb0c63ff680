"""Host-side plan of the Triton prefill attention launch: the tile map (no triton import).

A step's prefill rows are the sequences with more than one new token (decode rows, one token, go to the decode
kernel; empty rows are nobody's). The prefill kernel runs one program per (tile, head pack), where a tile is
``tokens_per_tile`` consecutive query tokens of one prefill row: the tile map lists exactly those
``(sequence, m-tile)`` pairs, so a mixed step of 255 decodes and one 512-token chunk launches
``512 / tokens_per_tile`` tiles, not ``cdiv(max_query_len, tokens) * num_seqs``. Tiles come longest first (most
keys to read, causal), so the longest programs start in the first wave.

The map is built from the host lists of :class:`~lqe.forward_context.AttentionMetadata` (no device sync) and copied
to the device once per step (pinned, non-blocking): every layer of a step shares one metadata object, so
:func:`step_plan` keys its cache on that object (it keeps a reference, so a later step's metadata can never reuse
its id). The tile count is a grid dimension, never a compile-time constant.
"""
from __future__ import annotations

import torch

from lqe.forward_context import AttentionMetadata


def build_tile_map(query_start_loc: list[int], seq_lens: list[int], tokens_per_tile: int) -> list[tuple[int, int]]:
    """``(sequence, m-tile)`` for every tile of every sequence with more than one query token, the tiles that
    read the most keys (``min(seq_len, ctx_len + (m + 1) * tokens_per_tile)``) first."""
    if tokens_per_tile < 1:
        raise ValueError(f"tokens_per_tile must be >= 1; got {tokens_per_tile}")
    keyed = []
    for b, seq_len in enumerate(seq_lens):
        q_len = query_start_loc[b + 1] - query_start_loc[b]
        if q_len <= 1:
            continue
        ctx = seq_len - q_len
        for m in range(-(-q_len // tokens_per_tile)):
            keyed.append((-min(seq_len, ctx + (m + 1) * tokens_per_tile), b, m))
    keyed.sort()
    return [(b, m) for _, b, m in keyed]


class StepPlan:
    """What every layer of one step shares: whether it has decode rows, and its tile maps on the device (one
    per tile size: layers of one model share one)."""

    __slots__ = ("meta", "has_decode", "_maps")

    def __init__(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        qsl = meta.query_start_loc_cpu
        self.has_decode = any(qsl[i + 1] - qsl[i] == 1 for i in range(meta.num_seqs))
        self._maps: dict[tuple[int, torch.device], torch.Tensor] = {}

    def tile_map(self, tokens_per_tile: int, device: torch.device) -> torch.Tensor:
        """int32 ``[num_tiles, 2]`` (sequence, m-tile) on ``device``; built and copied once per step."""
        key = (tokens_per_tile, torch.device(device))
        got = self._maps.get(key)
        if got is None:
            tiles = build_tile_map(self.meta.query_start_loc_cpu, self.meta.seq_lens_cpu, tokens_per_tile)
            flat = [x for bm in tiles for x in bm]
            host = torch.tensor(flat, dtype=torch.int32, pin_memory=key[1].type == "cuda")
            got = self._maps[key] = host.to(key[1], non_blocking=True).view(-1, 2)
        return got


_LAST: list = [None]  # the plan of the last step seen: every layer of a step shares its metadata object


def step_plan(meta: AttentionMetadata) -> StepPlan:
    plan = _LAST[0]
    if plan is None or plan.meta is not meta:
        plan = _LAST[0] = StepPlan(meta)
    return plan
