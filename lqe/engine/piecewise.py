"""Piecewise graphs for mixed and prefill steps (issue 26): everything but attention replayed per token bucket.

The design is in :mod:`lqe.engine.token_buckets`. Here:

* **Capture**, per token bucket ``b`` (largest first, every piece of every bucket in one memory pool): the model
  forward runs once on the bucket's fixed input views (token ids ``device_buf[0:b]``, positions
  ``device_buf[b:2b]``: where :meth:`StepInputBuilder.build` with ``pad_tokens=b`` puts them) inside a forward
  context whose ``split_attention`` hook is :meth:`PiecewiseRunner._cut`. Each ``Attention`` call copies its
  ``q``/``k``/``v`` into static buffers (part of the piece being captured), ends that piece, notes the layer,
  begins the next piece and returns the static attention output, which the next piece reads. The last piece
  copies the final hidden states into a static ``hidden`` buffer. ``layers + 1`` pieces per bucket.
* **Replay** (:meth:`PiecewiseRunner.run`): piece ``i``, then layer ``i``'s attention run eagerly on the static
  ``q``/``k``/``v`` with the step's real metadata (stores K/V of the real tokens; padding tokens have slot -1
  and belong to no sequence) into the static output, ..., the last piece; the LM head runs eagerly on the
  sampled rows of ``hidden`` (in the model runner).

The static q/k/v/output buffers are shared by every layer and every bucket (sized for the largest bucket):
replay is sequential on one stream, so layer ``i + 1``'s piece overwrites them only after layer ``i``'s
attention and the piece reading its output ran. Costs one copy of q/k/v per layer (attention writes its output into the static buffer itself).

The graph mechanism is injected (:mod:`lqe.engine.graph_backends`): CUDA graphs on a GPU, a recording of the
aten ops over the same static tensors on CPU (tests prove the piecewise step equals the eager one there).
"""
from __future__ import annotations

import gc
import logging
import time

import torch

from lqe.engine.graph_backends import CudaGraphBackend, NoGraphBackend, capture_stream
from lqe.engine.scheduler import SchedulerOutput
from lqe.engine.step_inputs import StepInputs
from lqe.engine.token_buckets import plan_step
from lqe.forward_context import ForwardContext, set_forward_context

logger = logging.getLogger("lqe")

CAPTURE_SECONDS = 120.0  # stop capturing smaller buckets past this (their steps then run eagerly)
CAPTURE_RESERVE_BYTES = 512 << 20  # ... or when less GPU memory than this is free


class _BucketGraphs:
    __slots__ = ("pieces", "layers")

    def __init__(self) -> None:
        self.pieces: list = []  # layers + 1 replayable pieces
        # (Attention module, its KV cache, the static q/k/v/out as this bucket's row views) between piece i and
        # piece i + 1: everything the replay passes to attention, built once at capture
        self.layers: list = []


class PiecewiseRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], device_buf: torch.Tensor,
                 buckets: list[int], backend=None) -> None:
        self.model, self.kv_caches, self.device_buf = model, kv_caches, device_buf
        self.wanted = sorted(buckets)
        self.backend = backend if backend is not None else CudaGraphBackend()
        self.graphs: dict[int, _BucketGraphs] = {}
        self.buckets: list[int] = []  # captured, ascending
        self.static: dict[tuple, tuple[torch.Tensor, ...]] = {}  # (q, k, v widths, dtype) -> (q, k, v, out) [max b]
        self.hidden: torch.Tensor | None = None  # [max bucket, hidden]: the last piece writes here
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        self._current: _BucketGraphs | None = None
        self._backend = self.backend
        self._rows = 0

    # -- capture ------------------------------------------------------------------------------------------
    def _views(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.device_buf[0:b], self.device_buf[b:2 * b]

    def _static_for(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_width: int):
        key = (q.shape[1], k.shape[1], v.shape[1], out_width, q.dtype)
        bufs = self.static.get(key)
        if bufs is None:  # allocated during the first (largest) bucket's warm-up: outside every graph pool
            n = self._rows
            bufs = self.static[key] = tuple(torch.zeros(n, w, dtype=q.dtype, device=q.device)
                                            for w in key[:4])
        return bufs

    def _cut(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The ``split_attention`` hook: q/k/v into the static buffers, end the piece, begin the next one."""
        t = q.shape[0]
        sq, sk, sv, so = self._static_for(q, k, v, layer.num_heads * layer.head_dim)
        views = (sq[:t], sk[:t], sv[:t], so[:t])
        views[0].copy_(q.reshape(t, -1))
        views[1].copy_(k.reshape(t, -1))
        views[2].copy_(v.reshape(t, -1))
        cur = self._current
        cur.pieces.append(self._backend.end())
        cur.layers.append((layer, self.kv_caches[layer.layer_idx], views))
        self._backend.begin()
        return views[3]

    def _forward_pieces(self, b: int, backend) -> _BucketGraphs:
        """Run the model over bucket ``b``'s fixed views, cut at every attention, pieces made by ``backend``."""
        ids, pos = self._views(b)
        self._backend, self._current = backend, _BucketGraphs()
        ctx = ForwardContext(None, self.kv_caches, split_attention=self._cut)
        try:
            with set_forward_context(ctx):
                backend.begin()
                hidden = self.model(ids, pos)
                if self.hidden is None:  # first pass: the largest bucket's warm-up, outside every graph pool
                    self.hidden = torch.zeros(self._rows, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
                self.hidden[:b].copy_(hidden)
                self._current.pieces.append(backend.end())
            return self._current
        except BaseException:
            backend.abort()
            raise
        finally:
            self._backend, self._current = self.backend, None

    @torch.inference_mode()
    def capture(self, max_seconds: float = CAPTURE_SECONDS, reserve_bytes: int = CAPTURE_RESERVE_BYTES,
                stream: torch.cuda.Stream | None = None) -> None:
        """Capture every wanted bucket, largest first, within the time and free-memory budget; on CUDA on ``stream``
        (the decode graphs' capture stream, so the shared pool reuses their blocks; default a new one)."""
        t0 = time.perf_counter()
        cuda = self.device_buf.device.type == "cuda"
        if cuda:
            gc.collect()  # (as torch.cuda.graph does: no collection frees pinned host memory mid-capture)
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
        self._rows = max(self.wanted)
        stream = (stream or capture_stream(self.device_buf.device)) if cuda else None
        skipped = []
        for b in sorted(self.wanted, reverse=True):
            if self.graphs and (time.perf_counter() - t0 > max_seconds or
                                (cuda and torch.cuda.mem_get_info()[0] < reserve_bytes)):
                skipped.append(b)
                continue
            self.device_buf[:2 * b].zero_()  # token 0 at position 0: in range for every embedding / rotary table
            if cuda:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up outside any graph: JIT builds, autotuning, lazy workspaces
                        self._forward_pieces(b, NoGraphBackend())
                    torch.cuda.synchronize()
                    self.graphs[b] = self._forward_pieces(b, self.backend)
                torch.cuda.current_stream().wait_stream(stream)
            else:
                self._forward_pieces(b, NoGraphBackend())
                self.graphs[b] = self._forward_pieces(b, self.backend)
        self.buckets = sorted(self.graphs)
        if cuda:
            torch.cuda.synchronize()
            self.pool_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
        self.capture_seconds = time.perf_counter() - t0
        pieces = len(next(iter(self.graphs.values())).pieces) if self.graphs else 0
        logger.info("piecewise graphs: %d token buckets (%s) x %d pieces captured in %.1fs, %.1f MiB%s",
                    len(self.buckets), ",".join(map(str, self.buckets)), pieces, self.capture_seconds,
                    self.pool_bytes / 2**20,
                    f"; skipped {','.join(map(str, skipped))} (capture budget)" if skipped else "")

    # -- replay -------------------------------------------------------------------------------------------
    def bucket_for_step(self, sched: SchedulerOutput, decode_buckets: list[int]) -> int | None:
        """The captured token bucket this step replays, or ``None`` (a decode graph or the eager path runs it)."""
        if not self.buckets:
            return None
        route, bucket = plan_step(sched, decode_buckets, self.wanted)
        # a bucket the capture budget skipped runs eagerly rather than padded to a much larger captured bucket
        return bucket if route == "piecewise" and bucket in self.graphs else None

    def run(self, bucket: int, inp: StepInputs) -> torch.Tensor:
        """Replay ``bucket`` for a step built with ``pad_tokens=bucket``; its hidden states ``[bucket, hidden]``
        (a view of the static buffer: read the rows before the next step)."""
        ids, _ = self._views(bucket)
        if inp.input_ids.data_ptr() != ids.data_ptr() or inp.input_ids.shape[0] != bucket:
            raise RuntimeError(f"step inputs are not laid out for token bucket {bucket} (build with pad_tokens={bucket})")
        g = self.graphs[bucket]
        meta = inp.meta
        for piece, (layer, cache, (q, k, v, o)) in zip(g.pieces, g.layers):
            piece.replay()
            layer.attend(q, k, v, meta, cache, out=o)
        g.pieces[-1].replay()
        return self.hidden[:bucket]
