"""End-to-end GPU benchmark (issue 7): random-weight models shaped like real ones, bf16 / W4A16 / W8A8.

Variants: ``bf16``; ``w4a16`` (GPTQ W4 g128 on ``dispatch.WNA16_TABLE``) and ``w4a16-mma`` (the same checkpoint on
``dispatch.WNA16_MMA_TABLE``: the lqe-w4a16-mma GEMM, issue 24; ``w4a16-mma-k2``: on ``WNA16_MMA_K2_TABLE``, its
8-warp k-split kernel), ``w4a16-swap`` (the same on ``WNA16_SWAP_TABLE``: the
swapped-operand Triton GEMM), ``w4a16-ring`` (the same on ``WNA16_RING_TABLE``: the CUDA GEMV's cp.async ring at
M <= 16); ``bf16-pdl`` / ``w4a16-pdl`` / ``w4a16-ring-pdl`` / ``w8a8-pdl`` / ``fp8-pdl`` (those with programmatic
dependent launch, ``LQE_PDL=1``: the default on sm_90+) and ``bf16-nopdl`` / ``w4a16-nopdl`` / ``w8a8-nopdl`` /
``fp8-nopdl`` (without it, ``LQE_PDL=0``); ``w8a8`` (a converted W8A8 checkpoint),
``w8a8-online`` and ``fp8`` (the bf16 checkpoint quantized at load time, issue 25).

Per (model shape, variant) it measures, through the public API (``LLM.generate`` on token-id prompts, greedy,
``ignore_eos``):

* ``decode_tok_s_bs1`` / ``decode_tok_s_bs16``: generated tokens per second after the first token, one request /
  16 requests (128-token prompts, 256 new tokens);
* ``ttft_ms``: time to first token of one 512-token prompt (median of 3, prefix caching off), and ``ttft_ms_reps``
  the three (at 50fb9ce w8a8 gave 49.9 ms with PDL against 30.0 without, in one run: one slow repetition or all?);
* ``throughput_tok_s`` (= ``throughput_256_tok_s``): output tokens per second over N requests (default 256) whose
  input and output lengths are uniform in [100, 1024] (seed 0, ``ignore_eos``: ``benchmarks/workload.py``, the
  nano-vllm protocol); ``total_tok_s`` adds the prompt tokens; ``workload_id`` (a digest of the requests),
  ``workload_input_tokens`` / ``workload_output_tokens``: what identifies the workload, so a later run knows whether
  its throughput is comparable (benchmarks/compare_e2e.py); ``gpu_busy_256``: the GPU span of every step, from its
  inputs on the device to its sampled tokens leaving it (CUDA events, read after the run: no added sync;
  :class:`e2e_measure.StepSpans`), over the run's wall time: host gaps inside a step count as busy, so an upper bound;
  ``floor_256_s`` / ``time_256_s`` / ``floor_256_ratio``: the workload's roofline floor from its FLOPs and bytes
  and the GPU's spec peaks, beside the measured time; ``gpu_kernel_busy_256``: kernel time over wall time from the
  profiler, in a 200-step window of a second, 64-request run stopped after the window (:func:`e2e_measure.kernel_busy`;
  ``--no-kernel-busy`` skips it);
* ``weight_gbps_bs1``: weight bytes read per decoded token (every weight except the embedding table, which is
  gathered, unless tied to the LM head) x ``decode_tok_s_bs1``: compare with the GPU's HBM bandwidth;
* ``gpu_ms_step_bs1``: GPU time of one batch-1 decode step (its CUDA graph replayed back to back, 256 cached
  tokens), and ``gpu_busy_bs1`` = that time x ``decode_tok_s_bs1`` / 1000: the fraction of a step the GPU works;
* ``host_ms_step_bs1``: wall time of ``LLMEngine.step()`` minus the time it waits for the GPU (scheduling, input
  building, sampling bookkeeping, output processing), over 64 batch-1 decode steps, and ``graph_launch_ms_step_bs1``
  the part of it spent inside the decode graph's ``replay()`` (the driver's launch of the graph: at af342f8 the H200
  gave bf16 1.07 ms of host time per step with PDL against 0.32 without, which PDL's kernels alone do not explain);
  ``host_ms_step_bs1_p50`` / ``_max``, the median and largest of those steps, and ``gc_ms_step_bs1``, the time
  Python's garbage collector ran inside them, per step (at 50fb9ce the mean swung between variants of one run, w8a8
  0.92 ms with PDL against 0.54 without, while their GPU time per step held: one pause or every step?);
* the same decode columns with ``_eager`` appended: the engine with ``enforce_eager=True`` (no CUDA graphs), in
  the same run, so the graphs' gain is one division away (skipped with ``--no-eager``);
* ``phase_s``: wall seconds per phase of the variant (load, warm-up, decode, ttft, throughput, kernel_busy, and the
  eager engine's), each also printed as it ends (``[shape/variant] phase: Ns``), and ``seconds``, the whole row.

The measurements themselves are in benchmarks/e2e_measure.py. Nothing timed compiles: before the decode columns each
engine runs :func:`e2e_measure.warm_up_steps`, one step at each M bucket bound of the kernel tables up to a
``max_num_batched_tokens`` step beside 16 decodes (the throughput run's largest steps), so the Triton GEMMs of the
quantized variants compile there and not inside a timed run (cuBLAS bf16 compiles nothing, so compiles in a timed run
bias the quantized / bf16 ratios).

A variant that raises or is skipped (its checkpoint could not be made) loses only its own row: its engine is shut
down and its memory collected before the next variant, the rows that succeed are saved, and the failure is recorded
under ``failures`` in the JSON (with a lost CUDA context also under ``device_faults``). The exit status is then 1
(0: every requested row measured; 2: no GPU; 4: too many device faults).

Results go to ``<--out-dir>/e2e-<gpu>.json`` (default benchmarks/results): rows of other shapes/variants already
there are kept (an out-dir without the file starts from the committed ``benchmarks/results/e2e-<gpu>.json``, so
``--quick``, which runs no llama3-8b row, still leaves the committed one in its file); each new row records its
``commit`` (``LQE_COMMIT`` when set, else git's HEAD). ``benchmarks/compare_e2e.py`` compares them with the committed
rows (issue 27's >= 0.95x).
Quantized variants come from ``python -m tools.convert quantize --method rtn --format gptq|w8a8``; when that
fails the variant is skipped with the reason printed.

    python benchmarks/e2e_gpu.py                      # everything (an 8B model: allow ~20 minutes)
    python benchmarks/e2e_gpu.py --quick              # small shapes, 32 requests: a smoke run of a few minutes
    python benchmarks/e2e_gpu.py --shapes smollm2-135m --variants bf16,w4a16 --num-requests 64
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common import commit, cuda_fault, restart, write_random_checkpoint  # noqa: E402
from e2e_measure import (decode_tok_s, decode_weight_bytes, host_ms_per_step, kernel_busy, throughput_256,  # noqa: E402
                         token_prompts, ttft_times_ms, warm_up_steps, warmup_token_counts)
from workload import peaks_for, workload_floor, workload_id  # noqa: E402

SHAPES = {  # HF config fields of the real models; weights are random
    "llama3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                                max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0,
                                   max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True)),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
                                   max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True)),
}
VARIANTS = {"bf16": None, "w4a16": "gptq", "w4a16-mma": "gptq", "w4a16-mma-k2": "gptq", "w4a16-swap": "gptq",
            "w4a16-ring": "gptq",
            "w8a8": "w8a8", "w8a8-online": "online:int8", "fp8": "online:fp8"}  # variant -> tools.convert --format
# ("online:<kind>": the bf16 checkpoint loaded with quantization=<kind>: per-channel weights, dynamic per-token
# activations, quantized at load time; issue 25)
# the w4a16 checkpoint on a candidate table (issue 24): dispatch.WNA16_MMA_TABLE / WNA16_MMA_K2_TABLE /
# WNA16_SWAP_TABLE / WNA16_RING_TABLE
VARIANT_ENV = {"w4a16-mma": {"LQE_WNA16_TABLE": "mma"}, "w4a16-mma-k2": {"LQE_WNA16_TABLE": "mma-k2"},
               "w4a16-swap": {"LQE_WNA16_TABLE": "swap"}, "w4a16-ring": {"LQE_WNA16_TABLE": "ring"}}
# a variant with programmatic dependent launch (-pdl: LQE_PDL=1, sm_90+: the CUDA GEMV and the Triton kernels of a
# decode step; lqe.kernels.device_info.pdl_enabled) or without it (-nopdl: LQE_PDL=0): bf16 (its Triton kernels;
# cuBLAS keeps the plain order), w4a16 on the default / ring table, w8a8, fp8. PDL is the default on sm_90+ since
# af342f8's H200 rows, so there the plain variants run with it
for _suffix, _pdl, _bases in (("-pdl", "1", ("bf16", "w4a16", "w4a16-ring", "w8a8", "fp8")),
                              ("-nopdl", "0", ("bf16", "w4a16", "w8a8", "fp8"))):
    for _base in _bases:
        VARIANTS[_base + _suffix] = VARIANTS[_base]
        VARIANT_ENV[_base + _suffix] = {**VARIANT_ENV.get(_base, {}), "LQE_PDL": _pdl}
MAX_MODEL_LEN = 2048 + 64
SHARD_BYTES = 4 << 30


# ------------------------------------------------------------------------------------------------ models
def default_work_dir() -> Path:
    """Where random checkpoints are built and reused (``--work-dir``'s default): ``$LQE_BENCH_DIR``, else
    ``<tmp>/lqe-e2e-models``."""
    return Path(os.environ.get("LQE_BENCH_DIR", str(Path(tempfile.gettempdir()) / "lqe-e2e-models")))


def checkpoint_dir(shape: str) -> Path:
    """The bf16 random checkpoint of ``shape`` this script builds with its defaults (``<work dir>/<shape>/bf16``):
    kv_cache_gpu.py, calibration_gpu.py and the engine stage's serving step share it."""
    return default_work_dir() / shape / "bf16"


def build_random_model(shape: str, out_dir: Path, seed: int) -> Path:
    """A bf16 safetensors checkpoint with the shape's config and N(0, 0.02) weights (norm weights 1)."""
    if (out_dir / "config.json").exists():
        return out_dir
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    arch, fields = SHAPES[shape]
    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = cfg_cls(**fields, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1)
    config.architectures = [model_cls.__name__]
    return write_random_checkpoint(config, model_cls, out_dir, seed, SHARD_BYTES)


def quantize_command(src: Path, fmt: str, out_dir: Path) -> list[str]:
    return [sys.executable, "-m", "tools.convert", "quantize", "--method", "rtn", "--format", fmt,
            "--model", str(src), "--out", str(out_dir)]


def quantize(src: Path, fmt: str, out_dir: Path) -> tuple[Path | None, str]:
    if (out_dir / "config.json").exists():
        return out_dir, ""
    cmd = quantize_command(src, fmt, out_dir)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    except Exception as e:  # noqa: BLE001
        return None, f"{' '.join(cmd)} failed: {e}"
    if proc.returncode != 0 or not (out_dir / "config.json").exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return None, f"{' '.join(cmd)} exited {proc.returncode}: " + " | ".join(tail)
    return out_dir, ""


# ------------------------------------------------------------------------------------------------ row columns
def workload_columns(reqs) -> dict:
    """What identifies the throughput run's requests: their digest and token counts (``workload_256`` once drew other
    requests for the same arguments, and throughput over other requests is not comparable)."""
    return {"workload_id": workload_id(reqs), "workload_input_tokens": sum(len(r.prompt) for r in reqs),
            "workload_output_tokens": sum(r.output_len for r in reqs)}


def floor_columns(shape: str, reqs, weight_bytes: int, measured_s: float) -> dict:
    """The workload's roofline floor (:func:`workload.workload_floor`) beside the measured time."""
    f = SHAPES[shape][1]
    h, layers, inter, vocab = f["hidden_size"], f["num_hidden_layers"], f["intermediate_size"], f["vocab_size"]
    head_dim = h // f["num_attention_heads"]
    kv = f["num_key_value_heads"] * head_dim
    params = layers * (h * (h + 2 * kv) + h * h + 3 * h * inter) + h * vocab
    peaks = peaks_for(torch.cuda.get_device_name(0))
    if peaks is None:
        return {"floor_256_s": None, "floor_256_note": f"no peak FLOP/s / bandwidth known for "
                                                      f"{torch.cuda.get_device_name(0)} (benchmarks/workload.PEAKS)"}
    fl = workload_floor(reqs, matmul_params=params, weight_bytes=weight_bytes, layers=layers, q_width=h,
                        kv_bytes_per_token=2 * layers * kv * 2, peak_flops=peaks[0], peak_bw=peaks[1])
    return {"floor_256_s": round(fl["floor_s"], 3), "floor_256_bound": fl["floor_bound"],
            "time_256_s": round(measured_s, 3), "floor_256_ratio": round(measured_s / fl["floor_s"], 2),
            "flops_256": fl["flops"], "bytes_256": fl["bytes"]}


def _llm(model_dir: Path, args, eager: bool):
    from lqe import LLM

    return LLM(model=str(model_dir), quantization=getattr(args, "quantization", None), dtype="bfloat16",
               max_model_len=MAX_MODEL_LEN, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
               gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed, enforce_eager=eager,
               async_scheduling=getattr(args, "async_scheduling", False) and not eager,
               **({"cudagraph_mode": args.cudagraph_mode} if getattr(args, "cudagraph_mode", None) else {}))


class Phases:
    """Wall seconds per phase of a variant's run (``phase_s`` in its row), each printed as it ends, so a device log
    shows where a variant's time went even when the run is cut off inside it."""

    def __init__(self, label: str) -> None:
        self.label, self.seconds, self._t = label, {}, time.perf_counter()

    def mark(self, name: str, note: str = "") -> None:
        now = time.perf_counter()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self._t, 1)
        self._t = now
        print(f"[{self.label}] {name}: {self.seconds[name]:.1f}s{note}", flush=True)

    def restart(self) -> None:
        """Start the next phase's clock now (time since the last mark belongs to no phase)."""
        self._t = time.perf_counter()


def _decode_columns(llm, args, vocab: int, suffix: str, phases: Phases | None = None) -> dict:
    from lqe import SamplingParams

    phases = phases or Phases(f"{getattr(args, 'label', '?')}")
    rng = random.Random(args.seed)
    llm.generate(token_prompts(rng, 2, 64, vocab), SamplingParams(max_tokens=8, ignore_eos=True, temperature=0),
                 use_tqdm=False)  # warm-up: kernel compilation / autotuning
    # every M bucket the timed runs can hit, up to a max_num_batched_tokens step beside decodes (the throughput
    # run's first steps): its compiles are not timed (own rng: the timed prompts stay those of earlier runs)
    counts = warm_up_steps(llm, SamplingParams, vocab, random.Random(args.seed + 7),
                           warmup_token_counts(args.max_num_batched_tokens))
    phases.mark(f"warm-up{suffix}", f" ({len(counts)} steps of {counts[0] if counts else 0}.."
                                    f"{counts[-1] if counts else 0} tokens)")
    n = 256 if not suffix else 64  # the eager engine is ~10x slower: fewer tokens give the same rate
    row = {f"decode_tok_s_bs1{suffix}": decode_tok_s(llm, SamplingParams, 1, vocab, rng, n),
           f"decode_tok_s_bs16{suffix}": decode_tok_s(llm, SamplingParams, 16, vocab, rng, n)}
    row.update({f"{name}{suffix}": v for name, v in host_ms_per_step(llm, SamplingParams, vocab, rng).items()})
    phases.mark(f"decode{suffix}")
    return row


def shutdown_llm(llm) -> None:
    """``llm.shutdown()`` (weights, KV cache, graphs released), never raising: after a failure the engine may be
    half-built or the CUDA context lost, and the failure itself is what gets reported."""
    if llm is None:
        return
    try:
        llm.shutdown()
    except Exception as e:  # noqa: BLE001
        print(f"# engine shutdown failed: {type(e).__name__}: {e}", flush=True)


def check_table_honoured(kernels: str) -> None:
    """A variant that selects a W4A16 table (VARIANT_ENV: LQE_WNA16_TABLE) must run its kernels: when the layers fell
    back (the CUDA extension did not build, or the kernel declines the shapes), its row would report another
    kernel's numbers under its name. Raise, naming what the layers run (``kernels``: the engine's
    quant_description). A ``-pdl`` variant (LQE_PDL=1) on a GPU without programmatic dependent launch raises too."""
    from lqe.kernels.device_info import pdl_enabled

    table = os.environ.get("LQE_WNA16_TABLE", "")
    want = {"mma": "lqe-w4a16-mma (", "mma-k2": ": lqe-w4a16-mma-k2", "swap": "triton-wna16-swap",
            "ring": "lqe-wna16-ring"}.get(table)
    if want and want not in kernels:
        raise RuntimeError(f"LQE_WNA16_TABLE={table}: no layer runs {want.rstrip(' (')}; the layers run: "
                           f"{kernels[:400]}")
    if os.environ.get("LQE_PDL") == "1" and not pdl_enabled(torch.device("cuda")):  # a -pdl row without PDL
        raise RuntimeError("LQE_PDL=1: programmatic dependent launch needs a GPU of compute capability 9.0 or later; "
                           "this one would run the variant without it")


def run_variant(model_dir: Path, args, vocab: int, shape: str) -> dict:
    """One variant's row. Its engines are shut down on every way out (a raising measurement included), so a failed
    variant leaves no weights or KV cache behind for the next one (main then collects what is left)."""
    phases = Phases(getattr(args, "label", shape))
    llm = _llm(model_dir, args, eager=False)
    try:
        kernels = llm.llm_engine.quant_description()
        check_table_honoured(kernels)
        row = _graph_columns(llm, args, vocab, shape, phases)
        row["quant_description"] = kernels
    finally:
        shutdown_llm(llm)
        llm = None
    _free_gpu()
    if not args.no_eager:
        phases.restart()
        try:
            llm = _llm(model_dir, args, eager=True)
            phases.mark("load_eager")
            row.update(_decode_columns(llm, args, vocab, "_eager", phases))
            if "gpu_ms_step_bs1" in row:
                row["gpu_busy_bs1_eager"] = row["gpu_ms_step_bs1"] * row["decode_tok_s_bs1_eager"] / 1e3
            row["graph_speedup_bs1"] = row["decode_tok_s_bs1"] / row["decode_tok_s_bs1_eager"]
        except Exception as e:  # noqa: BLE001 -- keep the graph columns
            row["eager_error"] = f"{type(e).__name__}: {e}"
            _clear_traceback(e)
        finally:
            shutdown_llm(llm)
            llm = None
        _free_gpu()
    row["phase_s"] = dict(phases.seconds)
    return row


def _graph_columns(llm, args, vocab: int, shape: str, phases: Phases) -> dict:
    """The row's columns from the default (CUDA-graph) engine."""
    from lqe import SamplingParams

    runner = llm.llm_engine.runner
    phases.mark("load")
    row = {"attention_backend": runner.attention_backend, "load_s": phases.seconds["load"],
           "cuda_graphs": runner.graph_runner is not None}
    if runner.graph_runner is not None:
        row["graph_capture_s"] = round(runner.graph_runner.capture_seconds, 2)
        row["graph_pool_mib"] = round(runner.graph_runner.pool_bytes / 2**20, 1)
    if runner.piecewise is not None:  # mixed / prefill steps replay piecewise graphs (issue 26)
        row["piecewise_buckets"] = len(runner.piecewise.buckets)
        row["piecewise_capture_s"] = round(runner.piecewise.capture_seconds, 2)
        row["piecewise_pool_mib"] = round(runner.piecewise.pool_bytes / 2**20, 1)
    row.update(_decode_columns(llm, args, vocab, "", phases))
    if runner.graph_runner is not None:
        row["gpu_ms_step_bs1"] = runner.graph_runner.time_replay(1, 128 + 128)
        row["gpu_busy_bs1"] = row["gpu_ms_step_bs1"] * row["decode_tok_s_bs1"] / 1e3
    rng = random.Random(args.seed + 1)
    ttfts = ttft_times_ms(llm, SamplingParams, vocab, rng)
    row["ttft_ms"], row["ttft_ms_reps"] = statistics.median(ttfts), [round(t, 2) for t in ttfts]
    row["weight_bytes"] = decode_weight_bytes(llm)
    phases.mark("ttft")
    # the issue-26 workload: throughput_tok_s / total_tok_s keep their names (same protocol: lengths uniform in
    # [100, 1024], seeded), now with the GPU-busy fraction and the roofline floor of the same run
    paths_before = dict(runner.steps_by_path)
    t = throughput_256(llm, SamplingParams, args.num_requests, vocab, args.seed)
    row["steps_by_path_256"] = {k: v - paths_before[k] for k, v in runner.steps_by_path.items()}
    row["throughput_tok_s"], row["total_tok_s"] = t["out_tok_s"], t["total_tok_s"]
    row["throughput_256_tok_s"] = t["out_tok_s"]
    row.update(workload_columns(t["requests"]))
    row["max_num_seqs"], row["max_num_batched_tokens"] = args.max_num_seqs, args.max_num_batched_tokens
    row["gpu_busy_256"] = round(t["gpu_s"] / t["seconds"], 3)
    row["steps_256"], row["num_requests_256"] = t["steps"], args.num_requests
    row.update(floor_columns(shape, t["requests"], row["weight_bytes"], t["seconds"]))
    phases.mark("throughput", f" ({args.num_requests} requests, {t['steps']} steps)")
    if not args.no_kernel_busy:
        try:
            row.update(kernel_busy(llm, SamplingParams, min(args.num_requests, 64), vocab, args.seed))
        except Exception as e:  # noqa: BLE001 -- the profiler is an extra column, never a lost row
            row["kernel_busy_error"] = f"{type(e).__name__}: {e}"
            _clear_traceback(e)
        phases.mark("kernel_busy")
    row["weight_gbps_bs1"] = row["weight_bytes"] * row["decode_tok_s_bs1"] / 1e9
    return row


def _clear_traceback(exc: BaseException) -> None:
    """Drop the locals of every finished frame in ``exc``'s traceback (and those of the exceptions it chains): a
    failed measurement's frames hold its engine, model runner and tensors, which would outlive the failure for as
    long as the exception (or a reference cycle through it) is alive."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


@contextlib.contextmanager
def variant_env(variant: str):
    """The variant's environment (VARIANT_ENV) while its engine loads and runs, the old one after."""
    env = VARIANT_ENV.get(variant, {})
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _free_gpu() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def release_memory() -> None:
    """After a failed variant: collect what its engine left (reference cycles in a half-built or failed engine keep
    weights and KV cache alive until collected) and hand the cached blocks back to the device, so the next variant
    (an 8B model on an 80 GiB GPU) starts with the memory free. Never raises (the CUDA context may be lost)."""
    try:
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        print(f"# releasing GPU memory failed: {type(e).__name__}: {e}", flush=True)


# ------------------------------------------------------------------------------------------------ main
def environment() -> dict:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "gpu": torch.cuda.get_device_name(0), "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
           "LQE_ATTENTION_BACKEND": os.environ.get("LQE_ATTENTION_BACKEND")}
    for mod in ("triton", "flash_attn", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            env[mod] = None
    env["lqe_commit"] = commit()
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--variants", default="bf16,w4a16,w8a8", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=str(default_work_dir()),
                    help="where random checkpoints are built (and reused)")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--quick", action="store_true", help="small shapes only, 32 requests (a smoke run)")
    ap.add_argument("--no-eager", action="store_true", help="skip the enforce_eager=True decode columns")
    ap.add_argument("--no-kernel-busy", action="store_true",
                    help="skip gpu_kernel_busy_256 (a profiled window of a 64-request run after the throughput run)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="async_scheduling=True (rows stored as variant '<variant>+async', beside the synchronous ones)")
    ap.add_argument("--cudagraph-mode", choices=("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"), default=None,
                    help="the engine's cudagraph_mode (default: the engine's default); FULL_AND_PIECEWISE rows are stored "
                         "as variant '<variant>+piecewise'")
    ap.add_argument("--done", default="", help=argparse.SUPPRESS)  # shape/variant pairs a run that lost its CUDA
    # context had finished (or lost it in): the fresh process it goes on in leaves them out
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("e2e_gpu.py needs a CUDA GPU: none is visible (torch.cuda.is_available() is False). Nothing was run.")
        return 2
    if args.quick:
        args.shapes = ",".join(s for s in args.shapes.split(",") if s != "llama3-8b")
        args.num_requests = min(args.num_requests, 32)
        args.max_num_seqs = min(args.max_num_seqs, 64)  # fewer graph buckets to capture
    shapes, variants = args.shapes.split(","), args.variants.split(",")
    for name, allowed in (("shape", SHAPES), ("variant", VARIANTS)):
        bad = [x for x in (shapes if name == "shape" else variants) if x not in allowed]
        if bad:
            ap.error(f"unknown {name} {bad}; choose from {', '.join(allowed)}")

    gpu_slug = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")
    out_path = Path(args.out_dir) / f"e2e-{gpu_slug}.json"
    doc, seeded = merge_base(out_path)
    rows = {(r["model_shape"], r["variant"]): r for r in doc.get("rows", [])}
    kept = set(rows)  # rows this run does not measure stay as they are (their own "commit")
    extra = {k: v for k, v in doc.items() if k not in ("device", "env", "rows", "date")}  # notes, ...
    if seeded:
        print(f"{out_path} starts from {seeded} ({len(rows)} rows): rows not measured now are kept", flush=True)
    this_commit = commit()
    work = Path(args.work_dir)
    done = [p for p in args.done.split(",") if p]
    label_suffix = (("+piecewise" if args.cudagraph_mode == "FULL_AND_PIECEWISE" else "")
                    + ("+async" if args.async_scheduling else ""))
    if not done:  # a new run: the faults, failures and requests an earlier one recorded are its own
        extra.pop("device_faults", None)
        extra.pop("failures", None)
        # the rows this run was asked for (benchmarks/compare_e2e.py --requested fails each one not measured)
        extra["requested"] = [{"model_shape": s, "variant": v + label_suffix} for s in shapes for v in variants]

    def write():
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"),
                                        "env": environment(), "rows": list(rows.values()), **extra}, indent=1))

    if not done:
        write()  # at once: a run cut off before its first row leaves no earlier run's requests behind

    def failed(shape: str, label: str, kind: str, error: str, seconds: float | None = None) -> None:
        """A requested row this run did not measure: recorded under ``failures`` (kept across a restart), so the
        file says why and the exit status is 1 (benchmarks/compare_e2e.py --shapes/--variants fails it too)."""
        extra["failures"] = [*extra.get("failures", []), {
            "model_shape": shape, "variant": label, "kind": kind, "error": error, "commit": this_commit,
            **({"seconds": round(seconds, 1)} if seconds is not None else {})}]

    run_t0 = time.perf_counter()
    for shape in shapes:
        if all(f"{shape}/{v}" in done for v in variants):
            continue
        vocab = SHAPES[shape][1]["vocab_size"]
        t0 = time.perf_counter()
        base = build_random_model(shape, work / shape / "bf16", args.seed)
        print(f"[{shape}] random bf16 checkpoint at {base} ({time.perf_counter() - t0:.0f}s)", flush=True)
        for variant in variants:
            if f"{shape}/{variant}" in done:
                continue
            label = variant + label_suffix
            args.label = f"{shape}/{label}"  # the prefix of run_variant's per-phase lines
            t0 = time.perf_counter()
            print(f"[{shape}/{label}] start ({t0 - run_t0:.0f}s into this run)", flush=True)
            model_dir, why = base, ""
            online = (VARIANTS[variant] or "").startswith("online:")
            args.quantization = VARIANTS[variant].removeprefix("online:") if online else None
            if VARIANTS[variant] and not online:  # one checkpoint per format (w4a16-mma reads w4a16's)
                model_dir, why = quantize(base, VARIANTS[variant], work / shape / VARIANTS[variant])
            if model_dir is None:
                print(f"[{shape}/{label}] skipped after {time.perf_counter() - t0:.1f}s: {why}", flush=True)
                done.append(f"{shape}/{variant}")
                failed(shape, label, "skipped", why, time.perf_counter() - t0)
                write()
                continue
            error = None
            try:
                with variant_env(variant):
                    row = run_variant(model_dir, args, vocab, shape)
            except Exception as e:  # noqa: BLE001 -- one broken variant must not lose the others
                error = f"{type(e).__name__}: {e}"
                _clear_traceback(e)  # its frames hold the failed engine (weights, KV cache) until they go
            if error is not None:
                seconds = time.perf_counter() - t0
                print(f"[{shape}/{label}] failed after {seconds:.1f}s: {error}", flush=True)
                done.append(f"{shape}/{variant}")
                failed(shape, label, "failed", error, seconds)
                fault = cuda_fault()
                if fault:  # a kernel lost the CUDA context: every later variant would fail in this process
                    print(f"[{shape}/{label}] the CUDA context was lost ({fault})", flush=True)
                    extra["device_faults"] = [*extra.get("device_faults", []), {
                        "model_shape": shape, "variant": variant, "error": fault, "commit": this_commit}]
                    write()
                    if restart(["--done", ",".join(done)]) is False:
                        print("too many device faults: stopped", flush=True)
                        return 4
                release_memory()  # what the failed engine left, before the next variant loads
                write()
                continue
            row = {"model_shape": shape, "variant": label, **row, "num_requests": args.num_requests,
                   "seed": args.seed, "seconds": round(time.perf_counter() - t0, 1), "commit": this_commit}
            rows[(shape, label)] = row
            kept.discard((shape, label))
            done.append(f"{shape}/{variant}")
            print(f"[{shape}/{label}] " + ", ".join(
                f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                if k not in ("model_shape", "variant")), flush=True)
            phases = ", ".join(f"{k} {v:.1f}s" for k, v in row.get("phase_s", {}).items())
            print(f"[{shape}/{label}] done in {row['seconds']:.1f}s" + (f" ({phases})" if phases else ""), flush=True)
            write()
    if kept:
        print("rows kept from before, not measured in this run: " + ", ".join(f"{s}/{v}" for s, v in sorted(kept)))
    write()
    print(f"wrote {out_path} ({time.perf_counter() - run_t0:.0f}s)")
    failures = extra.get("failures", [])
    if failures:  # the rows that did succeed are saved; the run still fails
        print(f"FAILED: {len(failures)} requested row(s) not measured: " + "; ".join(
            f"{f['model_shape']}/{f['variant']} {f['kind']} ({f['error'][:120]})" for f in failures), flush=True)
        return 1
    return 0


def merge_base(out_path: Path) -> tuple[dict, str | None]:
    """The document new rows are merged into: ``out_path`` when it exists, else the committed file of the same name
    in benchmarks/results (a run writing to an empty ``$OUT`` then still leaves every committed row in its file,
    so the file can be committed whole); ``(doc, where it came from when seeded)``."""
    if out_path.exists():
        return json.loads(out_path.read_text()), None
    committed = ROOT / "benchmarks" / "results" / out_path.name
    if committed.exists():
        return json.loads(committed.read_text()), str(committed.relative_to(ROOT))
    return {}, None


if __name__ == "__main__":
    sys.exit(main())
