"""The measurements of an e2e row (benchmarks/e2e_gpu.py), each through the public API of a loaded ``LLM``: decode
tokens/s, time to first token, the host time of a decode step, the warm-up that compiles every M bucket before
anything is timed, the issue-26 throughput workload with its GPU-busy spans and the profiler's kernel-busy window,
and the weight bytes a decode step reads. e2e_gpu.py turns them into row columns; the columns are described there."""
from __future__ import annotations

import contextlib
import gc
import random
import statistics
import time

import torch

from workload import workload_256


def token_prompts(rng: random.Random, n: int, length: int | tuple[int, int], vocab: int) -> list[list[int]]:
    """``n`` prompts of random token ids in [2, vocab), each ``length`` tokens or a length drawn from the (lo, hi)
    pair, from ``rng`` (its state carries over between calls, so every call draws fresh prompts)."""
    out = []
    for _ in range(n):
        k = length if isinstance(length, int) else rng.randint(*length)
        out.append([rng.randrange(2, vocab) for _ in range(k)])
    return out


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_tok_s(llm, sp_cls, batch: int, vocab: int, rng: random.Random, new_tokens: int = 256) -> float:
    prompts = token_prompts(rng, batch, 128, vocab)
    _sync()
    outs = llm.generate(prompts, sp_cls(max_tokens=new_tokens, ignore_eos=True, temperature=0), use_tqdm=False)
    _sync()
    end = time.monotonic()
    firsts = [o.metrics.first_token_time for o in outs if o.metrics and o.metrics.first_token_time]
    if len(firsts) != batch:
        raise RuntimeError("the engine reported no first-token times (RequestOutput.metrics)")
    generated = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return generated / (end - max(firsts))


def ttft_times_ms(llm, sp_cls, vocab: int, rng: random.Random, prompt_len: int = 512, reps: int = 3) -> list[float]:
    """Milliseconds from ``generate`` to its one token, for each of ``reps`` fresh ``prompt_len``-token prompts (the
    row keeps their median as ``ttft_ms`` and all of them as ``ttft_ms_reps``)."""
    times = []
    for p in token_prompts(rng, reps, prompt_len, vocab):
        _sync()
        t0 = time.perf_counter()
        llm.generate([p], sp_cls(max_tokens=1, ignore_eos=True, temperature=0), use_tqdm=False)
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


# the kernel modules whose module-level tables map token counts to kernels or tile configurations: lists of
# ``(max_m, ...)`` rows, first row covering M wins (lqe.kernels.dispatch and the Triton GEMMs' config tables)
M_TABLE_MODULES = ("lqe.kernels.dispatch", "lqe.kernels.triton_wna16", "lqe.kernels.triton_w8a8",
                   "lqe.kernels.triton_fp8", "lqe.kernels.triton_gemv_w8a8")


def m_bucket_bounds(modules=M_TABLE_MODULES) -> set[int]:
    """Every ``max_m`` of the ``(max_m, ...)`` tables in ``modules`` (a module that does not import is skipped)."""
    import importlib

    bounds = set()
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 -- a kernel module that cannot load picks nothing
            continue
        for value in vars(mod).values():
            if (isinstance(value, list) and value and all(isinstance(r, tuple) and len(r) == 2 for r in value)
                    and all(r[0] is None or (isinstance(r[0], int) and not isinstance(r[0], bool)) for r in value)):
                bounds.update(r[0] for r in value if r[0] is not None)
    return bounds


def warmup_token_counts(max_tokens: int, bounds: set[int] | None = None) -> list[int]:
    """The step sizes (flat tokens, M of every linear layer) whose warm-up compiles every kernel configuration a step
    of up to ``max_tokens`` tokens can pick: each M bucket's bound below ``max_tokens`` (:func:`m_bucket_bounds`) and
    ``max_tokens`` itself, each with the count one below it (Triton specializes an integer argument that is 1 or
    divisible by 16, so M = 64 and M = 63 are two compilations of one tile configuration)."""
    bounds = m_bucket_bounds() if bounds is None else bounds
    tops = {b for b in bounds if 1 <= b < max_tokens} | {max_tokens}
    return sorted({c for b in tops for c in (b, b - 1) if c >= 1})


def warm_up_steps(llm, sp_cls, vocab: int, rng: random.Random, counts: list[int], decodes: int = 16) -> list[int]:
    """One engine step of each of ``counts`` flat tokens, before anything is timed, so the kernels of every M bucket
    a timed run can hit are compiled (Triton JIT per tile configuration: the quantized GEMMs compile, cuBLAS bf16
    does not, so a compile inside a timed run biases quantized / bf16 ratios). The larger steps run their prompt
    tokens beside ``decodes`` running decodes (a mixed step, as in the throughput run); the smaller ones are a prompt
    alone. Every warm-up prompt asks for one token (it finishes in its step); the decodes are aborted at the end.
    Returns the step sizes asked for (those above ``max_num_batched_tokens`` are left out)."""
    engine = llm.llm_engine
    max_prompt = engine.max_model_len - 1
    cfg = engine.config
    counts = sorted({c for c in counts if 1 <= c <= cfg.max_num_batched_tokens})
    if not counts:
        return []
    seqs_for = lambda tokens: -(-tokens // max_prompt)  # noqa: E731 -- prompts a step of that many tokens needs
    decodes = max(0, min(decodes, cfg.max_num_seqs - 1 - seqs_for(counts[-1])))
    small = [c for c in counts if c <= 2 * decodes]  # too few tokens to sit beside the decodes
    large = [c for c in counts if c > 2 * decodes]
    ids = iter(range(1 << 30))
    params = sp_cls(max_tokens=1, ignore_eos=True, temperature=0)

    def step_until(rids: set[str]) -> None:  # step until each request in ``rids`` has finished
        pending = set(rids)
        while pending and engine.has_unfinished():
            pending -= {o.request_id for o in engine.step() if o.finished}

    def prompts_of(tokens: int) -> set[str]:
        rids = set()
        while tokens > 0:
            k = min(tokens, max_prompt)
            rid = f"warm-up-{next(ids)}"
            engine.add_request(rid, token_prompts(rng, 1, k, vocab)[0], params)
            rids.add(rid)
            tokens -= k
        return rids

    for c in small:
        step_until(prompts_of(c))
    running = [f"warm-up-decode-{i}" for i in range(decodes if large else 0)]
    try:
        if running:
            plen = 8
            for rid in running:
                engine.add_request(rid, token_prompts(rng, 1, plen, vocab)[0],
                                   sp_cls(max_tokens=engine.max_model_len - plen - 1, ignore_eos=True, temperature=0))
            started: set[str] = set()
            while len(started) < len(running) and engine.has_unfinished():  # their prefill: then they decode
                started |= {o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids}
        for c in large:
            step_until(prompts_of(c - len(running)))
    finally:
        engine.abort_request(running)
        while engine.has_unfinished():  # async scheduling: the step still in flight
            engine.step()
    return counts


@contextlib.contextmanager
def wrapped(hooks):
    """For the block, each ``(obj, name, wrap)`` of ``hooks`` replaces ``obj.name`` with ``wrap(obj.name)``; after it,
    what the instance had before comes back: an instance attribute already there (another wrapper), or none, and then
    the class's method again."""
    saved = [(obj, name, vars(obj).get(name)) for obj, name, _ in hooks]
    for obj, name, wrap in hooks:
        setattr(obj, name, wrap(getattr(obj, name)))
    try:
        yield
    finally:
        for obj, name, before in saved:
            if before is None:
                delattr(obj, name)
            else:
                setattr(obj, name, before)


class StepSpans:
    """CUDA events around the device part of every engine step, for ``gpu_busy_256``. A step's span starts at an
    event recorded right after its inputs are enqueued (the first ``StepInputBuilder.fill`` of the step: host buffer
    filled, host-to-device copy queued) and ends at one recorded right after its device-to-host copy of the sampled
    tokens is queued (``ModelRunner.to_host_start``), or when ``execute`` / ``execute_async`` returns for a step that
    samples nothing. An event's time is when the GPU reaches it, so a span is the GPU's time from the step's inputs
    being on the device to its sampled tokens leaving it: the host's input building before it and its bookkeeping after
    the device-to-host copy (waiting for it, output processing, scheduling) are outside every span. Inside a span, GPU
    idle time while the host still launches the step's work (eager layers, piecewise replays, attention between them)
    counts as busy, so the sum of spans over the run's wall time is still an upper bound of kernel time over wall time
    (``gpu_kernel_busy_256``, from the profiler, is the kernel time itself). Events are only recorded, read after the
    run: no added sync. ``event`` makes an event (default: a timing ``torch.cuda.Event``; tests pass a fake)."""

    def __init__(self, runner, event=None) -> None:
        self.runner = runner
        self.event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self.spans: list = []  # (start, end) events, one pair per step
        self.steps_without_inputs = 0  # steps that filled no inputs (none expected): no span
        self._step: list | None = None  # [start, end] of the step in progress

    def _mark(self, slot: int) -> None:
        if self._step is not None and self._step[slot] is None:
            ev = self.event()
            ev.record()
            self._step[slot] = ev

    def _step_hook(self, fn):
        def run(*a, **k):
            self._step = [None, None]
            try:
                return fn(*a, **k)
            finally:
                self._mark(1)
                start, end = self._step
                self._step = None
                if start is None:
                    self.steps_without_inputs += 1
                else:
                    self.spans.append((start, end))
        return run

    def _after(self, fn, slot: int):
        def run(*a, **k):
            out = fn(*a, **k)
            self._mark(slot)
            return out
        return run

    def __enter__(self) -> "StepSpans":
        r = self.runner
        self._hooks = wrapped([(r, "execute", self._step_hook), (r, "execute_async", self._step_hook),
                               (r, "to_host_start", lambda fn: self._after(fn, 1)),
                               (r.inputs, "fill", lambda fn: self._after(fn, 0))])
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def seconds(self) -> float:
        return sum(s.elapsed_time(e) for s, e in self.spans) / 1e3


def throughput_256(llm, sp_cls, n: int, vocab: int, seed: int, lo: int = 100, hi: int = 1024, event=None) -> dict:
    """The issue-26 workload (:func:`workload.workload_256`) through ``LLM.generate``: output and total tokens/s,
    wall seconds, and the GPU time of every step (:class:`StepSpans`: from its inputs on the device to its sampled
    tokens leaving it, the host's input building and bookkeeping excluded)."""
    reqs = workload_256(vocab, n, lo, hi, seed=seed)
    prompts = [r.prompt for r in reqs]
    params = [sp_cls(max_tokens=r.output_len, ignore_eos=True, temperature=0) for r in reqs]
    with StepSpans(llm.llm_engine.runner, event) as spans:
        _sync()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync()
        dt = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"out_tok_s": out_tokens / dt, "total_tok_s": (out_tokens + sum(map(len, prompts))) / dt, "seconds": dt,
            "gpu_s": spans.seconds(), "steps": len(spans.spans) + spans.steps_without_inputs, "requests": reqs,
            "out_tokens": out_tokens}


def kernel_busy(llm, sp_cls, n: int, vocab: int, seed: int, skip_steps: int = 50, steps: int = 200, lo: int = 100,
                hi: int = 1024, activities=None) -> dict:
    """GPU kernel time over wall time from the profiler: the first ``n`` requests of the same workload, CUDA activity
    only (CUPTI records each kernel / copy with its device timestamps; no CPU-op tracing, so the host is barely
    slowed), in a window of ``steps`` engine steps after ``skip_steps`` (and the profiler's 2 warm-up steps).
    ``gpu_kernel_busy_256`` is the union of the window's kernel and copy intervals over the span from its first start
    to its last end: a lower bound where the profiler slows the host at all, beside ``gpu_busy_256`` (CUDA events
    around each step), an upper bound. A separate run, so the throughput run is never profiled; it stops once the
    window's last step has run (the requests still unfinished are aborted through ``LLMEngine.abort_request``), so
    it costs the window, not a whole generation."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from workload import busy_union, kernel_breakdown

    reqs = workload_256(vocab, n, lo, hi, seed=seed)
    params = [sp_cls(max_tokens=r.output_len, ignore_eos=True, temperature=0) for r in reqs]
    engine = llm.llm_engine
    window = skip_steps + 2 + steps  # the schedule's steps: wait, warmup, active; the trace is complete after them
    ids = [f"kernel-busy-{i}" for i in range(n)]
    with profile(activities=activities or [ProfilerActivity.CUDA],
                 schedule=schedule(wait=skip_steps, warmup=2, active=steps, repeat=1)) as prof:
        def stepped(execute):
            def run(*a, **k):
                try:
                    return execute(*a, **k)
                finally:
                    prof.step()
            return run
        with wrapped([(engine.runner, name, stepped) for name in ("execute", "execute_async")]):
            try:
                for rid, r, p in zip(ids, reqs, params):
                    engine.add_request(rid, r.prompt, p)
                while engine.has_unfinished() and prof.step_num < window:
                    engine.step()
                _sync()
            finally:  # the window is over: the requests still running are aborted, not generated to their end
                engine.abort_request(ids)
                while engine.has_unfinished():  # async scheduling: the step still in flight
                    engine.step()
    events = [e for e in prof.profiler.kineto_results.events() if e.device_type() == torch.autograd.DeviceType.CUDA]
    busy, span = busy_union([(e.start_ns(), e.end_ns()) for e in events])
    return {"gpu_kernel_busy_256": round(busy / span, 3) if span else None, "kernel_busy_window_steps": steps,
            "kernel_busy_window_ms": round(span / 1e6, 1), "kernel_busy_requests": n,
            "kernel_busy_gpu_events": len(events), "kernel_busy_steps_run": prof.step_num,
            # where the window's GPU time went, longest first: [kernel, calls, ms, share] (workload.kernel_breakdown)
            "kernel_busy_top": kernel_breakdown([(e.name(), e.start_ns(), e.end_ns()) for e in events])}


def decode_weight_bytes(llm) -> int:
    """Bytes of weights one decode step reads: all of them, less the gathered embedding table when untied."""
    runner = llm.llm_engine.runner
    total = runner.weight_bytes()
    model = runner.model
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if emb is not None and not getattr(model, "tied", False):
        total -= sum(p.numel() * p.element_size() for p in emb.parameters())
    return total


def host_ms_per_step(llm, sp_cls, vocab: int, rng: random.Random, steps: int = 64) -> dict[str, float]:
    """Host time of a batch-1 decode step, over ``steps`` steps: ``host_ms_step_bs1``, the mean wall time of
    ``step()`` minus its wait for the GPU; ``_p50`` / ``_max`` of it per step (one pause moves the mean, not the
    median); ``gc_ms_step_bs1``, the time Python's cyclic garbage collector ran inside those steps, per step; and
    ``graph_launch_ms_step_bs1``, the part inside the decode graph's ``replay()`` (left out without decode graphs)."""
    engine = llm.llm_engine
    engine.add_request("host-time", token_prompts(rng, 1, 128, vocab)[0],
                       sp_cls(max_tokens=steps + 2, ignore_eos=True, temperature=0))
    engine.step()  # prefill
    runner = engine.runner
    graphs = getattr(runner, "graph_runner", None)
    launch0 = graphs.launch_s if graphs is not None else 0.0
    gc_s, gc_start = [0.0], [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_s[0] += time.perf_counter() - gc_start[0]

    per_step = []
    runner.measure_gpu_wait, runner.gpu_wait_s = True, 0.0
    gc.callbacks.append(on_gc)
    try:
        for _ in range(steps):
            s0, wait0 = time.perf_counter(), runner.gpu_wait_s
            engine.step()
            per_step.append(time.perf_counter() - s0 - (runner.gpu_wait_s - wait0))
    finally:
        gc.callbacks.remove(on_gc)
        runner.measure_gpu_wait = False
    cols = {"host_ms_step_bs1": statistics.fmean(per_step) * 1e3,
            "host_ms_step_bs1_p50": statistics.median(per_step) * 1e3, "host_ms_step_bs1_max": max(per_step) * 1e3,
            "gc_ms_step_bs1": gc_s[0] / steps * 1e3}
    if graphs is not None:
        cols["graph_launch_ms_step_bs1"] = (graphs.launch_s - launch0) / steps * 1e3
    while engine.has_unfinished():
        engine.step()
    return cols
