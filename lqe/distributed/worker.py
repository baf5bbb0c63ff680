"""Worker processes of a tensor-parallel engine and the driver's handle on them.

Rank 0 is the driver (the user's process): it runs the scheduler, block manager and sampler, and before each
model step broadcasts the step (the scheduler output, without the sequences' random generators) to ranks
1..N-1. Each worker builds the same model on its shard, allocates its share of the KV cache and runs every
broadcast step; the row-parallel all-reduces and the logits all-gather inside the forward keep the ranks in
lockstep. Workers are daemon processes started with ``spawn``; the driver stops them (and leaves the process
group, so another tensor-parallel engine can start in the same process) on ``shutdown()``, when the group is
garbage-collected (``del llm``), at interpreter exit, or when one of them fails (a dead rank is reported with its
exit code and its traceback). Nothing global holds the group: its stop is a ``weakref.finalize``.
"""
from __future__ import annotations

import copy
import logging
import multiprocessing as mp
import os
import socket
import traceback
import weakref
from typing import Any, Callable

import torch

from lqe.distributed.comm import tp_broadcast_object
from lqe.distributed.parallel_state import check_group_free, destroy_tensor_parallel, init_tensor_parallel, tp_scope

logger = logging.getLogger("lqe")

_STOP, _EXECUTE = "stop", "execute"


def tp_timeout_s() -> float:
    return float(os.environ.get("LQE_TP_TIMEOUT", "600"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rendezvous() -> tuple[str, int]:
    """Address and port of the process group's store: ``LQE_TP_PORT`` (or ``MASTER_PORT``) when set, else a free port."""
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = os.environ.get("LQE_TP_PORT") or os.environ.get("MASTER_PORT")
    if port is None:
        return addr, _free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # fail before spawning anything
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, int(port)))
        except OSError as e:
            raise RuntimeError(f"tensor parallelism cannot bind its rendezvous port {addr}:{port} ({e}); "
                               "free the port or set LQE_TP_PORT to another one (unset it to pick a free port)") from e
    return addr, int(port)


def strip_step(sched: Any) -> Any:
    """A picklable copy of a scheduler output for the workers: sequences without their ``torch.Generator``."""
    out = copy.copy(sched)
    seqs: dict[int, Any] = {}

    def strip(seq):
        if id(seq) not in seqs:
            c = copy.copy(seq)
            c.generator = None
            seqs[id(seq)] = c
        return seqs[id(seq)]

    out.scheduled = [copy.copy(s) for s in sched.scheduled]
    for s in out.scheduled:
        s.seq = strip(s.seq)
    out.preempted = []
    return out


def worker_main(rank: int, size: int, init_method: str, build: Callable[[], Any], errors: Any) -> None:
    """Entry point of ranks 1..N-1: join the group, build the runner with ``build()``, run broadcast steps."""
    try:
        build.set_rank(rank)
        device = build.device
        init_tensor_parallel(rank, size, init_method, device, tp_timeout_s())
        runner = build()
        while True:
            cmd = tp_broadcast_object(None)
            if cmd[0] == _STOP:
                break
            if cmd[0] == _EXECUTE:
                runner.execute(cmd[1], None)
    except KeyboardInterrupt:
        pass
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1)
    finally:
        try:
            destroy_tensor_parallel()
        except Exception:
            pass


class RunnerBuilder:
    """Picklable recipe for a rank's ModelRunner (built inside the worker, after it joined the group)."""

    def __init__(self, config, model_dir, model_cfg, quant_config, device: torch.device, dtype: torch.dtype,
                 max_model_len: int) -> None:
        self.args = (config, model_dir, model_cfg, quant_config, device, dtype)
        self.device, self.max_model_len = device, max_model_len

    def set_rank(self, rank: int) -> None:
        """One device per rank: ``cuda:rank`` on CUDA (rank 0, the driver, keeps its own)."""
        if self.device.type == "cuda":
            self.device = torch.device("cuda", rank)
            self.args = self.args[:4] + (self.device,) + self.args[5:]

    def __call__(self):
        from lqe.engine.model_runner import ModelRunner

        torch.manual_seed(self.args[0].seed)
        runner = ModelRunner(*self.args)
        runner.allocate_kv_cache(self.max_model_len)
        return runner


class TPWorkerGroup:
    """The driver's side: spawns ranks 1..N-1, joins the group as rank 0, forwards steps, detects dead ranks."""

    def __init__(self, size: int, builder: RunnerBuilder) -> None:
        self.size = size
        self.procs: list[mp.Process] = []
        check_group_free(size)  # another tensor-parallel engine alive: say so before spawning anything
        addr, port = _rendezvous()
        init_method = f"tcp://{addr}:{port}"
        ctx = mp.get_context("spawn")
        self.errors = ctx.Queue()
        for rank in range(1, size):
            p = ctx.Process(target=worker_main, args=(rank, size, init_method, builder, self.errors), daemon=True,
                            name=f"lqe-tp-rank{rank}")
            p.start()
            self.procs.append(p)
        self._graceful = [True]  # shutdown(graceful=False) clears it before the stop runs
        self._stop = weakref.finalize(self, _stop_group, self.procs, self.errors, size, self._graceful)
        with self.guard("joining the tensor-parallel group"):
            try:
                init_tensor_parallel(0, size, init_method, builder.device, tp_timeout_s(),
                                     owner=f"an LLM with tensor_parallel_size={size}")
            except Exception as e:
                if "bind" in str(e).lower() or "address already in use" in str(e).lower():
                    raise RuntimeError(f"tensor parallelism cannot bind its rendezvous port {addr}:{port} ({e}); "
                                       "set LQE_TP_PORT to a free port") from e
                raise

    @property
    def closed(self) -> bool:
        return not self._stop.alive

    def scope(self):
        """Rank 0 of ``size`` for the driver's code inside (model build, steps)."""
        return tp_scope(0, self.size)

    # -- failures ---------------------------------------------------------------------------------------
    def dead_ranks(self) -> list[tuple[int, int | None]]:
        return [(i + 1, p.exitcode) for i, p in enumerate(self.procs) if not p.is_alive()]

    def _failure(self, what: str, cause: BaseException | None) -> RuntimeError:
        import queue

        tracebacks = {}
        while True:
            try:
                rank, tb = self.errors.get(timeout=0.5 if not tracebacks else 0.05)
            except (queue.Empty, OSError, ValueError):
                break
            tracebacks[rank] = tb
        dead = self.dead_ranks()
        parts = [f"tensor-parallel engine failed while {what}"]
        if dead:
            parts.append("; ".join(f"worker rank {r} exited with code {c}" for r, c in dead))
        for rank, tb in sorted(tracebacks.items()):
            parts.append(f"rank {rank} raised:\n{tb.rstrip()}")
        if cause is not None and not tracebacks:
            parts.append(f"rank 0 saw: {type(cause).__name__}: {cause}")
        parts.append("all tensor-parallel workers were shut down")
        self.shutdown(graceful=False)
        return RuntimeError("\n".join(parts))

    def fail(self, what: str, cause: BaseException) -> BaseException:
        """Shut every worker down after rank 0 saw ``cause``; the exception to raise: ``cause`` itself when it
        is the user's error (a bad option, a bad checkpoint), else one naming the failed ranks."""
        if isinstance(cause, (ValueError, TypeError, MemoryError, FileNotFoundError, KeyboardInterrupt)) and not self.dead_ranks():
            self.shutdown(graceful=False)
            return cause
        return self._failure(what, cause)

    def guard(self, what: str):
        group = self

        class _Guard:
            def __enter__(self):
                if group.closed:
                    raise RuntimeError("the tensor-parallel engine was shut down (a worker failed or shutdown() was called)")
                if group.dead_ranks():
                    raise group._failure(what, None)

            def __exit__(self, et, e, tb):
                if e is None:
                    return False
                if not isinstance(e, Exception):  # Ctrl-C: the ranks may be mid-collective; stop them all
                    group.shutdown(graceful=False)
                    return False
                # an error on rank 0 mid-step leaves the workers out of step with it: stop every rank
                raise group._failure(what, e) from e

        return _Guard()

    # -- steps ------------------------------------------------------------------------------------------
    def execute(self, runner, sched, sampling):
        with self.guard("running a model step"), self.scope():
            tp_broadcast_object((_EXECUTE, strip_step(sched)))
            return runner.execute(sched, sampling)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every worker and leave the process group; idempotent."""
        if not graceful:
            self._graceful[0] = False
        self._stop()


def _stop_group(procs: list, errors: Any, size: int, graceful: list[bool]) -> None:
    """The group's stop (its ``weakref.finalize``: runs once, from ``shutdown()``, garbage collection or exit)."""
    if graceful[0] and all(p.is_alive() for p in procs):
        try:
            with tp_scope(0, size):
                tp_broadcast_object((_STOP,))
        except Exception:
            pass
        for p in procs:
            p.join(timeout=10)
    _terminate(procs)
    try:
        destroy_tensor_parallel()
    except Exception:
        pass
    try:
        errors.close()
        errors.join_thread()
    except Exception:
        pass


def _terminate(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
