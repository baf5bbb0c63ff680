"""Decode steps replayed from CUDA graphs captured at start-up, one per batch-size bucket.

A decode-only step of ``B`` sequences is padded to the smallest bucket ``>= B`` (1, 2, 4, 8, then multiples of
8 up to ``max_cudagraph_batch``). Every graph reads its inputs from fixed views of the model runner's step
buffer (:mod:`lqe.engine.step_inputs`: one host-to-device copy per step fills them) and writes the logits of
all its rows into a fixed output tensor; the model forward and the LM head run inside the graph. Attention
splits are fixed per bucket from ``max_model_len`` (the decode kernel derives each split's range from the
device ``seq_lens``), so nothing in the captured region depends on a host value that changes per step.

Graphs are captured largest first into one shared memory pool (smaller graphs reuse the largest one's
intermediate buffers); capture time and pool memory are logged. Prefill and mixed steps, steps with more
sequences than the largest bucket, and ``enforce_eager=True`` run eagerly.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from lqe.engine.graph_backends import capture_stream
from lqe.engine.scheduler import SchedulerOutput
from lqe.engine.step_inputs import StepInputBuilder, StepLayout, views
from lqe.forward_context import AttentionMetadata, ForwardContext, set_forward_context

logger = logging.getLogger("lqe")


def batch_buckets(max_num_seqs: int, max_cudagraph_batch: int) -> list[int]:
    """Bucket sizes, ascending: 1, 2, 4, 8, 16, 24, ... up to ``min(max_num_seqs, max_cudagraph_batch)``
    (that cap itself is always a bucket)."""
    cap = min(max_num_seqs, max_cudagraph_batch)
    if cap < 1:
        return []
    sizes = [b for b in (1, 2, 4) if b <= cap] + list(range(8, cap + 1, 8))
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``num_seqs`` sequences, or ``None`` when the step is larger than all."""
    for b in buckets:
        if b >= num_seqs:
            return b
    return None


def graphable(sched: SchedulerOutput) -> bool:
    """A step a decode graph can run: one new token per sequence, each sampled, no prompt logprobs wanted."""
    return bool(sched.scheduled) and all(
        s.num_new_tokens == 1 and s.samples and not s.seq.wants_prompt_logprobs for s in sched.scheduled)


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], inputs: StepInputBuilder,
                 buckets: list[int], width: int, max_model_len: int, block_size: int,
                 num_splits: Callable[[int], int]) -> None:
        self.model, self.kv_caches, self.inputs = model, kv_caches, inputs
        self.buckets, self.width, self.max_model_len, self.block_size = buckets, width, max_model_len, block_size
        self.num_splits = num_splits
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # [max bucket, vocab]: every graph writes its rows here
        self.pool = None
        self.capture_stream: torch.cuda.Stream | None = None  # the stream the graphs were captured on (piecewise too)
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        self.launch_s = 0.0  # host seconds inside the decode graphs' replay() (the driver's launch of the graph)

    def _meta(self, b: int, lay: StepLayout) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids, pos, slots, qsl, lens, tables, _ = views(self.inputs.device_buf, lay)
        meta = AttentionMetadata(
            slot_mapping=slots, query_start_loc=qsl, seq_lens=lens, block_tables=tables, max_query_len=1,
            max_seq_len=self.max_model_len, query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=[1] * b,
            block_size=self.block_size, num_splits=self.num_splits(b))
        return ids, pos, meta

    def _fill_synthetic(self, b: int, seq_len: int) -> StepLayout:
        """Inputs of a ``b``-row decode step that stores nothing (slots -1), every row attending to ``seq_len``
        cached tokens of block 0 (0: to nothing); the bucket's layout."""
        lay = StepLayout(b, b, self.width, 0)
        ids, pos, slots, qsl, lens, tables, _ = views(self.inputs.device_buf, lay)
        ids.fill_(1), pos.fill_(max(0, seq_len - 1)), slots.fill_(-1), lens.fill_(seq_len), tables.zero_()
        qsl.copy_(torch.arange(b + 1, dtype=torch.int32, device=qsl.device))
        return lay

    def _forward(self, b: int, lay: StepLayout) -> torch.Tensor:
        ids, pos, meta = self._meta(b, lay)
        return self._run_model(ids, pos, meta)

    def _run_model(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        with set_forward_context(ForwardContext(meta, self.kv_caches)):
            return self.model.compute_logits(self.model(ids, pos))

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        stream = capture_stream()  # one side stream per device for every engine's warm-ups and captures
        for b in sorted(self.buckets, reverse=True):
            lay = self._fill_synthetic(b, 0)  # padding rows only: capture writes nothing to the cache
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside the graph: JIT builds, autotuning, lazily allocated buffers
                    logits = self._forward(b, lay)
            torch.cuda.current_stream().wait_stream(stream)
            if self.logits is None:  # one output buffer, outside the pool, so no graph keeps its own logits alive
                self.logits = torch.empty(b, logits.shape[1], dtype=logits.dtype, device=logits.device)
            del logits
            graph = torch.cuda.CUDAGraph()
            # captured on the warm-up stream, which the piecewise graphs capture on too: a graph pool hands a freed
            # block back only to the stream that freed it, so one stream is what lets them share the pool's memory
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.logits[:b].copy_(self._forward(b, lay))
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = graph
        self.capture_stream = stream
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        self.pool_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
        logger.info("CUDA graphs: %d decode buckets (%s) captured in %.1fs, %.1f MiB of graph memory",
                    len(self.graphs), ",".join(map(str, self.buckets)), self.capture_seconds, self.pool_bytes / 2**20)

    @torch.inference_mode()
    def time_replay(self, bucket: int, seq_len: int, iters: int = 200) -> float:
        """Milliseconds of GPU time per replay of ``bucket``'s graph, back to back (no host work between), every
        row attending to ``seq_len`` cached tokens of block table 0s and storing nothing: the GPU work of one
        decode step."""
        self._fill_synthetic(bucket, seq_len)
        graph = self.graphs[bucket]
        for _ in range(5):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters

    def run(self, sched: SchedulerOutput) -> torch.Tensor | None:
        """Replay the bucket's graph for a decode step; the logits ``[B, vocab]`` of its real rows, or ``None``
        when the step is not one a graph covers."""
        b = len(sched.scheduled)
        bucket = bucket_for(b, self.buckets)
        if bucket is None or not graphable(sched):
            return None
        lay = self.inputs.fill(sched, pad_seqs=bucket, width=self.width, logits_for_all=True)
        self._replay(bucket, lay)
        return self.logits[:b]

    def _replay(self, bucket: int, lay: StepLayout) -> None:
        t0 = time.perf_counter()
        self.graphs[bucket].replay()
        self.launch_s += time.perf_counter() - t0


class EagerPaddedRunner(CudaGraphRunner):
    """The graph runner's bookkeeping (buckets, padding, fixed views and splits) with an eager forward in place
    of each replay: runs on CPU, so tests check the padded decode path without a GPU."""

    def capture(self) -> None:
        return None

    def _replay(self, bucket: int, lay: StepLayout) -> None:
        ids, pos, meta = self._meta(bucket, lay)
        # the graph's metadata has placeholder host lists (the triton decode path never reads them); the torch
        # reference backend does, so give it the real ones
        meta.seq_lens_cpu = self.inputs.last_host()[lay.seq_lens:lay.block_tables].tolist()
        meta.max_seq_len = max(meta.seq_lens_cpu)
        logits = self._run_model(ids, pos, meta)
        if self.logits is None or self.logits.shape[0] < bucket:
            self.logits = torch.empty(max(self.buckets), logits.shape[1], dtype=logits.dtype, device=logits.device)
        self.logits[:bucket].copy_(logits)
