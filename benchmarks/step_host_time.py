"""Host time of one mixed step (a prefill chunk beside decodes), per phase, on a random-weight model (issue 26).

A mixed step runs eagerly; on a GPU its cost is the host's (Python, dispatch, kernel launches) whenever that
exceeds the GPU work. This tool drives the real engine (``LLMEngine.step``) through identical mixed steps --
``--decodes`` sequences decoding beside one new ``--chunk``-token prompt prefilled whole in each step -- and times:

* ``schedule``: ``Scheduler.schedule``;
* ``prep``: the runner's input preparation (host buffer fill, metadata, one host-to-device copy);
* ``forward``: the model forward (``forward_per_layer`` = forward / layers): ``model.forward`` on the eager path,
  ``PiecewiseRunner.run`` (every piece replayed, attention between them) on the piecewise path; of which
  ``attention`` is the attention layers (``Attention.attend``: store K/V + attend, called by both paths) and
  ``forward_rest`` the other ops (on the piecewise path: the replays; attention writes into the static buffers the pieces read);
* ``sample``: LM head on the sampled rows + sampler (includes the step's one device-to-host copy);
* ``other``: the rest of ``step()``: the sampling batch and output processing (appending tokens, stop checks).

Every request is greedy (``temperature=0``): the sampler's greedy path makes no host-to-device copy, so ``sample``
is the LM head, the argmax and the step's one device-to-host copy. Every phase is wall time without a device
synchronize, so on CUDA it is the host's time (kernels run asynchronously), except ``sample``, which waits for the
GPU in its one sync: on CUDA ``gpu_wait`` (the time that sync blocks, measured once per step by
``ModelRunner.measure_gpu_wait``) is subtracted from ``step`` for ``host_ms_per_step``. On CPU the compute runs
inside each phase, so by default the model keeps the shape's layer count, head counts and step shape but divides
its widths (hidden, intermediate, vocabulary) by ``--width-div`` (8): the per-op compute becomes small and the
forward time is dominated by its host cost (dispatch of the same ops, Python). ``--width-div 1`` gives the real
widths (compute dominated on CPU). ``ops_per_step`` counts the aten ops of one step (a device-independent proxy for
launches). On CPU the clock is the main thread's CPU time (``time.thread_time``, torch on one thread), so a machine
shared with other jobs inflates the figures less than wall time would; on CUDA it is wall time (``perf_counter``).

    python benchmarks/step_host_time.py                                # CPU, smollm2 shape, JSON in benchmarks/results
    python benchmarks/step_host_time.py --device cuda --width-div 1    # a GPU: the real host time of the eager step
    python benchmarks/step_host_time.py --device cuda --shape qwen2.5-0.5b --decodes 255   # a 256-row mixed step

``--paths eager,piecewise`` (the CUDA default) measures the same steps twice in one run: ``eager`` with decode graphs
only (``cudagraph_mode=FULL_DECODE_ONLY``: the mixed step runs eagerly) and ``piecewise`` (``FULL_AND_PIECEWISE``:
the mixed step replays its token bucket's piecewise graphs, :mod:`lqe.engine.piecewise`); the piecewise row carries
``host_ms_ratio_vs_eager`` and both carry ``gpu_floor_ms`` (the step's weight bytes / peak bandwidth or its matmul
FLOPs / peak FLOP/s, whichever is larger) beside ``host_ms_per_step``. ``steps_by_path`` counts which path the
measured steps took, ``seqs_per_step`` / ``tokens_per_step`` the shapes they were scheduled with (``--decodes 255``:
``[256]`` / ``[479]``). The piecewise path exists on CUDA only (CPU pieces are a recording for tests, not a speed
path; :func:`measure` takes a ``piecewise_backend`` so tests run the piecewise phase split on CPU).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from common import env_info, write_random_checkpoint  # noqa: E402

PHASES = ("schedule", "prep", "forward", "attention", "sample", "step")


def scaled_config(shape: str, width_div: int):
    """The HF config of ``shape`` (benchmarks/e2e_gpu.SHAPES) with hidden/intermediate/vocab divided by
    ``width_div`` (head counts and layer count kept: the same ops run per layer)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from e2e_gpu import SHAPES

    arch, fields = SHAPES[shape]
    f = dict(fields)
    if width_div > 1:
        heads = f["num_attention_heads"]
        head_dim = max(8, f["hidden_size"] // heads // width_div)
        f.update(hidden_size=heads * head_dim, intermediate_size=max(16, f["intermediate_size"] // width_div),
                 vocab_size=max(512, f["vocab_size"] // width_div), head_dim=head_dim)
    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    cfg = cfg_cls(**f, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1)
    cfg.architectures = [model_cls.__name__]
    return cfg, model_cls


class PhaseTimer:
    """Wraps bound methods of live objects with wall-clock accumulators (one ``perf_counter`` pair per call)."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.total: dict[str, float] = {}
        self.clock = clock

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a, **k):
            t0 = self.clock()
            try:
                return fn(*a, **k)
            finally:
                self.total[name] = self.total.get(name, 0.0) + self.clock() - t0
        setattr(obj, attr, timed)

    def take(self) -> dict[str, float]:
        out, self.total = self.total, {}
        return out


def count_ops(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    with Count():
        fn()
    return Count.n


def wrap_phases(timer: PhaseTimer, engine) -> None:
    """Time what a step really calls, on either path: the eager forward is ``model.forward`` (with ``Attention.forward``
    -> ``attend`` per layer inside it); a piecewise step calls neither, but ``PiecewiseRunner.run`` (its pieces'
    replays and ``Attention.attend`` between them). ``attend`` is what both paths run for attention, so ``attention``
    is inside ``forward`` on both."""
    from lqe.layers.attention import Attention

    runner = engine.runner
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(runner, "prepare_inputs", "prep")
    timer.wrap(runner.model, "forward", "forward")
    if runner.piecewise is not None:
        timer.wrap(runner.piecewise, "run", "forward")
    timer.wrap(runner, "_launch_sample", "sample")
    timer.wrap(runner, "to_host_wait", "sample")
    timer.wrap(runner.model, "compute_logits", "sample")
    for m in runner.model.modules():
        if isinstance(m, Attention):
            timer.wrap(m, "attend", "attention")


def engine_config(model_dir: str, args):
    """The engine for ``--decodes`` decoding sequences beside one prefilling prompt per step: ``decodes + 1``
    sequences, ``decodes + chunk`` tokens a step (``--decodes 255``: the 256-row mixed step), ``--kv-mib`` of KV cache
    (:func:`measure` checks it holds every sequence at its longest)."""
    from lqe.config import EngineConfig

    seqs, tokens = args.decodes + 1, args.decodes + args.chunk
    return EngineConfig(model=model_dir, device=args.device, dtype=args.dtype, max_model_len=2048,
                        max_num_seqs=seqs, max_num_batched_tokens=tokens, enable_prefix_caching=False,
                        kv_cache_memory_bytes=args.kv_mib << 20,
                        cudagraph_mode="FULL_AND_PIECEWISE" if args.path == "piecewise" else "FULL_DECODE_ONLY")


def measure(model_dir: str, args, piecewise_backend=None) -> dict:
    """One path's row. ``piecewise_backend`` (tests): capture the piecewise pieces with it (``RecordingBackend`` on
    CPU, where the engine captures none) before measuring, so the piecewise path's phase split runs without a GPU."""
    from lqe.engine.llm_engine import LLMEngine
    from lqe.sampling_params import SamplingParams

    engine = LLMEngine(engine_config(model_dir, args))
    if piecewise_backend is not None and engine.runner.piecewise is None:
        engine.runner.capture_piecewise(piecewise_backend)
    long_steps = args.warmup + args.steps + 2
    blocks = engine.runner.kv_spec.blocks_per_request  # every decode at its longest + one prompt: no preemption
    need = blocks(16 + long_steps + 8) * args.decodes + blocks(args.chunk + 1)
    if engine.runner.num_blocks < need:
        engine.shutdown()
        raise SystemExit(f"--kv-mib {args.kv_mib}: {engine.runner.num_blocks} KV blocks, the steps need {need}; "
                         "raise --kv-mib")
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(2, vocab, (n,), generator=g).tolist()  # noqa: E731
    params = SamplingParams(max_tokens=long_steps + 8, ignore_eos=True, temperature=0)
    for i in range(args.decodes):
        engine.add_request(f"d{i}", rand(16), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # every short request is decoding now
    # one whole prompt of `chunk` tokens prefilled beside the decodes in every step; greedy like the decodes, so the
    # step samples on the greedy path (the random sampler's host-to-device copies would sync inside `sample`)
    prefill = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    for i in range(long_steps):
        engine.add_request(f"p{i}", rand(args.chunk), prefill)
    runner = engine.runner
    clock = time.thread_time if engine.device.type == "cpu" else time.perf_counter
    timer = PhaseTimer(clock)
    wrap_phases(timer, engine)
    shapes = []  # (sequences, tokens) of each measured step, as scheduled: 256 rows with --decodes 255
    schedule = engine.scheduler.schedule

    def schedule_noted(*a, **k):
        out = schedule(*a, **k)
        shapes.append((len(out.scheduled), out.num_batched_tokens))
        return out
    engine.scheduler.schedule = schedule_noted
    steps = []
    runner.measure_gpu_wait = engine.device.type == "cuda"
    paths_before = dict(runner.steps_by_path)
    for i in range(args.warmup + args.steps):
        runner.gpu_wait_s = 0.0
        timer.take()
        t0 = clock()
        engine.step()
        step_s = clock() - t0
        ph = timer.take()
        ph["step"], ph["gpu_wait"] = step_s, runner.gpu_wait_s
        if i >= args.warmup:
            steps.append(ph)
        else:
            paths_before = dict(runner.steps_by_path)
            shapes.clear()
    by_path = {k: v - paths_before[k] for k, v in runner.steps_by_path.items()}  # the measured steps' paths
    layers = engine.model_config.num_hidden_layers
    med = {k: statistics.median(s.get(k, 0.0) for s in steps) * 1e3 for k in PHASES + ("gpu_wait",)}
    row = {f"{k}_ms": round(v, 3) for k, v in med.items()}
    row["host_ms_per_step"] = round(med["step"] - med["gpu_wait"], 3)
    row["forward_rest_ms"] = round(med["forward"] - med["attention"], 3)
    row["forward_per_layer_ms"] = round(med["forward"] / layers, 4)
    row["other_ms"] = round(med["step"] - med["schedule"] - med["prep"] - med["forward"] - med["sample"], 3)
    row["ops_per_step"] = count_ops(engine.step)
    row["layers"] = layers
    row["steps_by_path"] = by_path
    row["seqs_per_step"] = sorted({n for n, _ in shapes[:args.steps]})  # one value when every step had the same
    row["tokens_per_step"] = sorted({t for _, t in shapes[:args.steps]})  # shape (count_ops' step is not counted)
    if runner.piecewise is not None:
        row["piecewise_capture_s"] = round(runner.piecewise.capture_seconds, 2)
        row["piecewise_buckets"] = runner.piecewise.buckets
    if engine.device.type == "cuda":
        row.update(gpu_floor(runner, args.decodes + args.chunk))
    engine.shutdown()  # weights, KV cache and graphs go before the next path's engine
    return row


def gpu_floor(runner, tokens: int) -> dict:
    """The mixed step's GPU floor: its weights read once at peak bandwidth, or its matmul FLOPs (2 x parameters x
    tokens, attention excluded) at peak FLOP/s, whichever is larger."""
    from workload import peaks_for

    peaks = peaks_for(torch.cuda.get_device_name())
    if peaks is None:
        return {"gpu_floor_ms": None, "gpu_floor_note": f"no peaks known for {torch.cuda.get_device_name()}"}
    wbytes = runner.weight_bytes()
    params = wbytes // runner.dtype.itemsize
    return {"gpu_floor_ms": round(max(wbytes / peaks[1], 2 * params * tokens / peaks[0]) * 1e3, 3),
            "weight_bytes": wbytes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--width-div", type=int, default=None, help="divide widths by this (default 8 on CPU, 1 on CUDA)")
    ap.add_argument("--decodes", type=int, default=32, help="sequences decoding in every measured step")
    ap.add_argument("--chunk", type=int, default=224, help="prefill tokens of the long prompt per step")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--kv-mib", type=int, default=512)
    ap.add_argument("--label", default="", help="a name for this row (e.g. before / after); the path is appended")
    ap.add_argument("--paths", default=None,
                    help="comma list of eager,piecewise (default: eager,piecewise on CUDA, eager on CPU)")
    ap.add_argument("--out", default=None, help="JSON file to append the row to (default: print only)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is visible")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.width_div = args.width_div or (1 if args.device == "cuda" else 8)
    paths = (args.paths or ("eager,piecewise" if args.device == "cuda" else "eager")).split(",")
    for p in paths:
        if p not in ("eager", "piecewise"):
            ap.error(f"--paths: unknown path {p!r}; choose from eager, piecewise")
        if p == "piecewise" and args.device != "cuda":
            ap.error("--paths piecewise needs --device cuda: piecewise graphs are CUDA graphs (on CPU the pieces are "
                     "only a recording for tests)")
    if args.device == "cpu":
        torch.set_num_threads(1)  # every op on the timed thread
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg, model_cls = scaled_config(args.shape, args.width_div)
        model_dir = write_random_checkpoint(cfg, model_cls, Path(tmp) / "model", seed=0)
        for p in paths:
            args.path = p
            row = {"label": f"{args.label} {p}".strip(), "path": p, "shape": args.shape, "device": args.device,
                   "dtype": args.dtype, "width_div": args.width_div, "decodes": args.decodes, "chunk": args.chunk,
                   "steps": args.steps, "clock": "thread_time" if args.device == "cpu" else "wall",
                   **measure(str(model_dir), args)}
            if p != "eager" and rows and rows[0]["path"] == "eager":
                row["host_ms_ratio_vs_eager"] = round(row["host_ms_per_step"] / rows[0]["host_ms_per_step"], 3)
            rows.append(row)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    for row in rows:
        print(json.dumps(row))
    if args.out:
        path = Path(args.out)
        doc = json.loads(path.read_text()) if path.exists() else {"env": env_info(), "rows": []}
        doc["rows"].extend(rows)
        path.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
