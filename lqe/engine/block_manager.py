"""Paged KV-cache blocks: allocation, reference counts, and prefix caching.

A full block is identified by a chained hash of its tokens and of the hash of the block before it, so equal
hashes mean equal prefixes up to collisions; a hit is confirmed by comparing the block's token ids.
Freed blocks keep their contents and hash and sit in an LRU free list: a later request with the same prefix
takes them back (a hit), and fresh allocations evict the least recently freed first.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from lqe.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.hits = 0
        self.queries = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so that ``num_tokens`` tokens fit in its block table."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # -- prefix cache -------------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> None:
        """Attach the cached blocks matching ``seq``'s leading full blocks (always leaving one token to compute)."""
        assert not seq.block_table, "match_prefix is for a sequence that holds no blocks"
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return
        tokens = seq.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        prev: int | None = None
        for i in range(max_blocks):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(prev, chunk)
            self.queries += 1
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != chunk:
                break
            self.hits += 1
            self._take(bid)
            seq.block_table.append(bid)
            seq.block_hashes.append(h)
            prev = h
        seq.num_hashed_blocks = len(seq.block_table)
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish the blocks of ``seq`` whose tokens are all computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        tokens = seq.all_token_ids
        for i in range(seq.num_hashed_blocks, full):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            prev = seq.block_hashes[i - 1] if i > 0 else None
            h = chain_hash(prev, chunk)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = h, chunk
            self.hash_to_block.setdefault(h, block.block_id)
            seq.block_hashes.append(h)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    # -- allocation ---------------------------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq``'s block table to hold ``num_tokens`` tokens (caller checked ``can_allocate``)."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            bid, _ = self.free.popitem(last=False)
            block = self.blocks[bid]
            if block.hash is not None and self.hash_to_block.get(block.hash) == bid:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids, block.ref_count = None, (), 1
            seq.block_table.append(bid)

    def free_seq(self, seq: Sequence) -> None:
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {bid} freed more often than allocated")
            if block.ref_count == 0:
                self.free[bid] = None  # most recently freed last: evicted last
        seq.block_table = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0

    def _take(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self.free[bid]
        block.ref_count += 1
