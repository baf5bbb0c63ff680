"""AsyncEngine: many concurrent asyncio requests over one ``LLMEngine``.

The engine is not thread-safe, so every call into it (``step``, ``add_request``, ``abort_request``) runs in one
dedicated worker thread, in submission order. Tokenizing requests (and /detokenize) runs in a second thread on
its own copy of the tokenizer, so neither the event loop nor the engine's steps wait for a long prompt. An asyncio task keeps that thread
busy with ``step()`` while any request is unfinished and sleeps otherwise. Each request delivers its
cumulative ``RequestOutput``s to an ``asyncio.Queue`` owned by the caller; several requests may share one
queue (a completion with several prompts). A failing step does not stop the loop: every request in flight
gets a ``RequestFailed`` on its queue, is aborted in the engine (freeing its KV blocks), and serving goes on.
"""
from __future__ import annotations

import asyncio
import copy
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable

from lqe.engine.llm_engine import EngineStats, LLMEngine
from lqe.outputs import RequestOutput
from lqe.sampling_params import SamplingParams

logger = logging.getLogger("lqe")


class RequestFailed(Exception):
    """The engine step serving this request raised; the request was aborted."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lqe-engine")
        self._queues: dict[str, asyncio.Queue] = {}
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._stats = engine.stats()
        self.num_step_errors = 0
        self._tok_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lqe-tokenizer")
        self._tokenizer = _own_copy(engine.tokenizer)
        self.max_token_chars = _max_token_chars(engine.tokenizer)

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._loop_task is not None and not self._loop_task.done():
            return
        self._wakeup = asyncio.Event()
        self._loop_task = asyncio.get_running_loop().create_task(self._run_loop(), name="lqe-engine-loop")
        self._loop_task.add_done_callback(self._loop_done)

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
            self._loop_task = None
        if self._queues:
            rids = list(self._queues)
            self._fail(rids, RequestFailed("the server is shutting down"))
            await self.run(self.engine.abort_request, rids)

    async def drain(self, grace_s: float) -> list[str]:
        """Graceful shutdown: let in-flight requests finish for up to ``grace_s`` seconds, then fail the rest
        (their clients get an error saying so) and free their KV blocks. Returns the aborted request ids."""
        loop = asyncio.get_running_loop()
        if self._queues:
            logger.warning("lqe: shutting down: waiting up to %g s for %d request(s) in flight", grace_s,
                           len(self._queues))
        deadline = loop.time() + grace_s
        while self._queues and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = list(self._queues)
        if left:
            logger.warning("lqe: shutdown grace period of %g s is over: aborting %d request(s): %s", grace_s,
                           len(left), ", ".join(left))
            self._fail(left, RequestFailed(f"the server is shutting down: this request was aborted after the "
                                           f"{grace_s:g} s grace period (--shutdown-grace-period)"))
            await self.run(self.engine.abort_request, left)
        else:
            logger.info("lqe: shutting down: no request left in flight")
        return left

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._tok_executor.shutdown(wait=True, cancel_futures=True)
        stop = getattr(self.engine, "shutdown", None)  # tensor-parallel workers
        if stop is not None:
            stop()

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    # -- requests -------------------------------------------------------------------------------------
    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the engine thread, between steps, and return its result (or raise its error)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._call, fn, args)

    async def run_tokenizer(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(tokenizer, *args)`` in the tokenizer thread (on its own tokenizer copy)."""
        return await asyncio.get_running_loop().run_in_executor(self._tok_executor, fn, self._tokenizer, *args)

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          queue: asyncio.Queue) -> None:
        """Queue a request; its outputs (then ``RequestFailed`` on an engine error) arrive on ``queue``.

        Raises the engine's ``ValueError`` for a request it rejects."""
        if not self.is_running:
            raise RuntimeError("the engine loop is not running (AsyncEngine.start() not called, or it stopped)")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._queues[request_id] = queue
        try:
            await self.run(self.engine.add_request, request_id, prompt, params)
        except BaseException:
            self._queues.pop(request_id, None)
            # the add may still run after a cancellation: make sure no orphan is left in the engine
            self._executor.submit(self._call, self.engine.abort_request, (request_id,))
            raise
        if request_id not in self._queues:  # failed by a step error while it was being added
            self._executor.submit(self._call, self.engine.abort_request, (request_id,))
        self._wakeup.set()

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests and free their KV blocks; callable from ``finally`` (does not wait)."""
        rids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        live = [r for r in rids if self._queues.pop(r, None) is not None]
        if live:
            self._executor.submit(self._call, self.engine.abort_request, (live,))

    def stats(self) -> EngineStats:
        """Engine statistics as of the last call into the engine thread."""
        return self._stats

    @property
    def num_requests(self) -> int:
        return len(self._queues)

    # -- engine thread --------------------------------------------------------------------------------
    def _call(self, fn: Callable[..., Any], args: tuple) -> Any:
        try:
            return fn(*args)
        finally:
            self._stats = self.engine.stats()

    def _step(self) -> tuple[list[RequestOutput], bool]:
        if not self.engine.has_unfinished():
            return [], False
        outs = self.engine.step()
        return outs, self.engine.has_unfinished()

    # -- the loop -------------------------------------------------------------------------------------
    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        busy = False
        while True:
            if not busy:
                await self._wakeup.wait()
                self._wakeup.clear()
            try:
                outs, busy = await loop.run_in_executor(self._executor, self._call, self._step, ())
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a failing step must not end the loop: fail what was in flight
                self.num_step_errors += 1
                # an error that names its requests (non-finite logits) fails those alone: the others' step is
                # simply run again (nothing of it was committed: tokens are appended after sampling)
                named = [r for r in (getattr(e, "request_ids", None) or []) if r in self._queues]
                rids = named or list(self._queues)
                logger.exception("lqe: engine step failed; failing %d request(s)", len(rids))
                self._fail(rids, RequestFailed(f"the engine failed while serving this request: {type(e).__name__}: {e}"))
                try:
                    await loop.run_in_executor(self._executor, self._call, self.engine.abort_request, (rids,))
                    busy = await loop.run_in_executor(self._executor, self._call, self.engine.has_unfinished, ())
                except Exception:
                    logger.exception("lqe: aborting the failed requests also failed")
                    busy = False
                continue
            for out in outs:
                q = self._queues.get(out.request_id)
                if q is None:
                    continue
                if out.finished:
                    del self._queues[out.request_id]
                q.put_nowait(out)
            await asyncio.sleep(0)  # let handlers run between steps even when the executor returns at once

    def _loop_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("lqe: the engine loop stopped", exc_info=task.exception())
            self._fail(list(self._queues), RequestFailed(f"the engine loop stopped: {task.exception()!r}"))

    def _fail(self, rids: list[str], error: Exception) -> None:
        for rid in rids:
            q = self._queues.pop(rid, None)
            if q is not None:
                q.put_nowait(error)


def _own_copy(tokenizer):
    """A private copy for the tokenizer thread (HF fast tokenizers are not meant to be shared across threads)."""
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # an exotic tokenizer that cannot be copied: share it (the engine only decodes with it)
        logger.warning("lqe: the tokenizer cannot be copied; the tokenizer thread shares the engine's")
        return tokenizer


def _max_token_chars(tokenizer) -> int:
    """The most characters of text one token can stand for (at least the length of its vocabulary string: byte-level
    BPE spells each byte as one character, SentencePiece each character as one). Bounds a prompt's characters
    by ``max_model_len`` before it is tokenized."""
    if tokenizer is None:
        return 1 << 30
    try:
        return max(8, max(len(t) for t in tokenizer.get_vocab()))
    except Exception:
        return 1 << 30
