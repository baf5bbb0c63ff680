"""The flattened inputs of one step, built on the host into one int32 buffer and moved with one copy.

A step's token ids, positions, slot mapping, query start locations, sequence lengths, block tables and the
rows whose logits are needed all live in one int32 array (:class:`StepLayout` gives the offsets). On CUDA the
array is filled in pinned memory and copied with a single non-blocking transfer into a persistent device
buffer; the model then reads views of that buffer. Two pinned buffers alternate, each guarded by an event, so
filling the next step never overwrites a transfer still in flight.

A CUDA-graph decode step uses the same layout, padded to its batch bucket (:func:`pad_decode`): padding rows
have token 0 at position 0, slot ``-1`` (store nothing) and sequence length 0 (attend to nothing), so they cost a
few idle threads and change no real row.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lqe.engine.scheduler import SchedulerOutput
from lqe.forward_context import AttentionMetadata


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Offsets into the step buffer: ``T`` tokens, ``B`` sequences, block tables ``W`` wide, ``S`` sample rows."""

    num_tokens: int
    num_seqs: int
    width: int
    num_sample: int

    @property
    def ids(self) -> int:
        return 0

    @property
    def positions(self) -> int:
        return self.num_tokens

    @property
    def slots(self) -> int:
        return 2 * self.num_tokens

    @property
    def query_start_loc(self) -> int:
        return 3 * self.num_tokens

    @property
    def seq_lens(self) -> int:
        return self.query_start_loc + self.num_seqs + 1

    @property
    def block_tables(self) -> int:
        return self.seq_lens + self.num_seqs

    @property
    def sample_rows(self) -> int:
        return self.block_tables + self.num_seqs * self.width

    @property
    def size(self) -> int:
        return self.sample_rows + self.num_sample


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32
    meta: AttentionMetadata
    sample_rows: torch.Tensor | None  # [S] int32 rows of the hidden states to turn into logits; None = all rows
    num_sample: int


def token_slice(seq, start: int, n: int) -> list[int]:
    """``seq.all_token_ids[start:start + n]`` without concatenating the whole sequence (decode: the last token)."""
    p = seq.num_prompt_tokens
    if start >= p:
        return seq.output_token_ids[start - p:start - p + n]
    if start + n <= p:
        return seq.prompt_token_ids[start:start + n]
    return seq.prompt_token_ids[start:] + seq.output_token_ids[:start + n - p]


def fill_host(buf: np.ndarray, sched: SchedulerOutput, block_size: int, pad_seqs: int | None = None,
              width: int | None = None, logits_for_all: bool = False, pad_tokens: int | None = None) -> StepLayout:
    """Write the step's inputs into ``buf`` (int32) and return their layout.

    ``pad_seqs``: a decode-only step padded to that many sequences (one token each), with block tables
    ``width`` wide (the CUDA-graph layout). ``logits_for_all``: no sample-row list (every row is sampled).
    ``pad_tokens``: any step's flat token batch padded to that many tokens (a token bucket,
    :mod:`lqe.engine.token_buckets`): the padding tokens follow the real ones, belong to no sequence
    (``query_start_loc`` ends at the real count), have token 0 at position 0 and slot ``-1``."""
    scheduled = sched.scheduled
    b = len(scheduled)
    num_tokens = sum(s.num_new_tokens for s in scheduled)
    real_tokens = num_tokens
    if pad_tokens is not None:
        if pad_seqs is not None or pad_tokens < num_tokens:
            raise ValueError(f"pad_tokens={pad_tokens} must hold the step's {num_tokens} tokens and excludes pad_seqs")
        num_tokens = pad_tokens
    if pad_seqs is not None:
        if num_tokens != b or pad_seqs < b:
            raise ValueError(f"pad_seqs={pad_seqs} needs a decode-only step of at most that many sequences "
                             f"(got {b} sequences, {num_tokens} tokens)")
        num_tokens = b_pad = pad_seqs
    else:
        b_pad = b
    w = width if width is not None else max(len(s.seq.block_table) for s in scheduled)
    num_sample = 0 if logits_for_all else sum(s.samples for s in scheduled)
    lay = StepLayout(num_tokens, b_pad, w, num_sample)
    if lay.size > buf.shape[0]:
        raise ValueError(f"step needs {lay.size} input slots, the buffer holds {buf.shape[0]}")
    ids = buf[lay.ids:lay.positions]
    pos = buf[lay.positions:lay.slots]
    slots = buf[lay.slots:lay.query_start_loc]
    qsl = buf[lay.query_start_loc:lay.seq_lens]
    lens = buf[lay.seq_lens:lay.block_tables]
    tables = buf[lay.block_tables:lay.sample_rows].reshape(b_pad, w)
    sample_rows = buf[lay.sample_rows:lay.size]
    tables.fill(0)
    t = k = 0
    qsl[0] = 0
    for i, s in enumerate(scheduled):
        seq, start, n = s.seq, s.start, s.num_new_tokens
        bt = seq.block_table
        if n == 1:
            ids[t] = token_slice(seq, start, 1)[0]
            pos[t] = start
            slots[t] = bt[start // block_size] * block_size + start % block_size
        else:
            ids[t:t + n] = token_slice(seq, start, n)
            p = np.arange(start, start + n, dtype=np.int64)
            pos[t:t + n] = p
            slots[t:t + n] = np.asarray(bt, dtype=np.int64)[p // block_size] * block_size + p % block_size
        t += n
        qsl[i + 1] = t
        lens[i] = start + n
        tables[i, :len(bt)] = bt
        if num_sample and s.samples:
            sample_rows[k] = t - 1
            k += 1
    if num_tokens > real_tokens and pad_seqs is None:  # token-bucket padding: no sequence owns these rows
        ids[t:] = 0
        pos[t:] = 0
        slots[t:] = -1
    if b_pad > b:  # padding rows: one token each, stored nowhere, attending to nothing
        ids[t:] = 0
        pos[t:] = 0
        slots[t:] = -1
        qsl[b + 1:] = np.arange(t + 1, t + 1 + b_pad - b)
        lens[b:] = 0
    return lay


def views(dev: torch.Tensor, lay: StepLayout) -> tuple[torch.Tensor, ...]:
    """(ids, positions, slots, query_start_loc, seq_lens, block_tables, sample_rows) as views of ``dev``."""
    return (dev[lay.ids:lay.positions], dev[lay.positions:lay.slots], dev[lay.slots:lay.query_start_loc],
            dev[lay.query_start_loc:lay.seq_lens], dev[lay.seq_lens:lay.block_tables],
            dev[lay.block_tables:lay.sample_rows].view(lay.num_seqs, lay.width),
            dev[lay.sample_rows:lay.size])


class StepInputBuilder:
    """Owns the host (pinned on CUDA) and device step buffers; :meth:`build` turns a schedule into tensors."""

    def __init__(self, device: torch.device, block_size: int, capacity: int) -> None:
        self.device, self.block_size, self.capacity = device, block_size, capacity
        self.on_cuda = device.type == "cuda"
        n_host = 2 if self.on_cuda else 1
        self._host = [torch.zeros(capacity, dtype=torch.int32, pin_memory=self.on_cuda) for _ in range(n_host)]
        self._host_np = [h.numpy() for h in self._host]
        self._events: list[torch.cuda.Event | None] = [None] * n_host
        self._turn = 0
        self.device_buf = torch.zeros(capacity, dtype=torch.int32, device=device) if self.on_cuda else self._host[0]
        # async scheduling: (device token ids of the step in flight, {seq_id: (position, row in those ids)}) -- the
        # next fill writes those tokens into its ids on the device (the host only has placeholders for them)
        self.pending: tuple[torch.Tensor, dict[int, tuple[int, int]]] | None = None

    def fill(self, sched: SchedulerOutput, pad_seqs: int | None = None, width: int | None = None,
             logits_for_all: bool = False, pad_tokens: int | None = None) -> StepLayout:
        """Fill the next host buffer and start its copy into :attr:`device_buf` (on the current stream)."""
        i = self._turn
        self._turn = (i + 1) % len(self._host)
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()  # the copy that last read this pinned buffer has finished
        host = self._host_np[i]
        lay = fill_host(host, sched, self.block_size, pad_seqs, width, logits_for_all, pad_tokens)
        n = self._pending_rows(host, lay, sched)
        if self.on_cuda:
            self.device_buf[:lay.size + 2 * n].copy_(self._host[i][:lay.size + 2 * n], non_blocking=True)
            if ev is None:
                ev = self._events[i] = torch.cuda.Event()
            ev.record()
        if n:
            src, dev = self.pending[0], self.device_buf
            rows, idx = dev[lay.size:lay.size + n].long(), dev[lay.size + n:lay.size + 2 * n].long()
            dev.index_copy_(0, rows, src.index_select(0, idx).to(dev.dtype))
        self.pending = None
        return lay

    def _pending_rows(self, host: np.ndarray, lay: StepLayout, sched: SchedulerOutput) -> int:
        """Write the rows of the step's pending tokens (placeholders in the host ids) and their source rows after
        the layout, for :meth:`fill` to copy and scatter; their count."""
        if self.pending is None:
            return 0
        where = self.pending[1]
        rows, src = [], []
        qsl = host[lay.query_start_loc:lay.seq_lens]
        for k, s in enumerate(sched.scheduled):
            w = where.get(s.seq.seq_id)
            if w is not None and s.start <= w[0] < s.start + s.num_new_tokens:
                rows.append(int(qsl[k]) + w[0] - s.start)
                src.append(w[1])
        n = len(rows)
        ids = host[lay.ids:lay.positions]
        if int((ids < 0).sum()) != n or any(ids[r] >= 0 for r in rows):
            raise RuntimeError(f"async scheduling: {int((ids < 0).sum())} placeholder token ids in the step but {n} "
                               "pending tokens to fill them")
        host[lay.size:lay.size + n] = rows
        host[lay.size + n:lay.size + 2 * n] = src
        return n

    def last_host(self) -> np.ndarray:
        """The host array :meth:`fill` wrote last."""
        return self._host_np[(self._turn - 1) % len(self._host)]

    def build(self, sched: SchedulerOutput, pad_tokens: int | None = None) -> StepInputs:
        """Eager-step inputs: compact layout (``pad_tokens``: padded to that token bucket), logits rows listed."""
        lay = self.fill(sched, pad_tokens=pad_tokens)
        ids, pos, slots, qsl, lens, tables, sample = views(self.device_buf, lay)
        host = self.last_host()
        qsl_cpu = host[lay.query_start_loc:lay.seq_lens].tolist()
        lens_cpu = host[lay.seq_lens:lay.block_tables].tolist()
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=qsl, seq_lens=lens, block_tables=tables,
            max_query_len=max(s.num_new_tokens for s in sched.scheduled), max_seq_len=max(lens_cpu),
            query_start_loc_cpu=qsl_cpu, seq_lens_cpu=lens_cpu, block_size=self.block_size)
        all_rows = lay.num_sample == lay.num_tokens  # every token samples (an unpadded decode-only step): no gather
        return StepInputs(ids, pos, meta, None if all_rows else sample, lay.num_sample)
