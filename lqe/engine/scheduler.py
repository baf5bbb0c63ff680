"""Continuous-batching scheduler: FCFS admission, a token budget per step, chunked prefill, mixed
prefill/decode steps, and preemption by recompute when KV blocks run out.

Each step first serves the running sequences in admission order (a decode costs one token, an unfinished
prefill its next chunk), then admits waiting ones while the token budget, ``max_num_seqs`` and free blocks
allow. When a running sequence cannot get a block, the most recently admitted running sequence is preempted:
its blocks are freed and it goes back to the front of the queue, to be recomputed from its tokens later.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lqe.engine.block_manager import BlockManager
from lqe.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (= tokens already in the cache)
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token, so its logits give the next token."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, skip=None) -> SchedulerOutput:
        """``skip(seq)``: running sequences to leave out of this step (async scheduling: those certain to finish
        once the step in flight returns their last token)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if skip is not None and skip(seq):
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self.bm.blocks_needed(seq, seq.num_computed_tokens + n)
            while not self.bm.can_allocate(need) and self.running[-1] is not seq:
                out.preempted.append(self._preempt(self.running.pop()))
            if not self.bm.can_allocate(need):
                out.preempted.append(self._preempt(self.running.pop()))
                break
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
            i += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self.bm.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self.bm.blocks_needed(seq, seq.num_computed_tokens + n)
            if not self.bm.can_allocate(need):
                self.bm.free_seq(seq)  # give back prefix hits; retried next step
                break
            self.bm.allocate(seq, seq.num_computed_tokens + n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, n))
            budget -= n
        return out

    def _preempt(self, seq: Sequence) -> Sequence:
        self.bm.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        return seq

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Mark ``seq`` finished and release its blocks (it may be running or waiting)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
