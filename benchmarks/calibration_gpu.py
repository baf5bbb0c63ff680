"""GPU calibration benchmark (issue 18, issue 27): seconds and peak GPU memory of ``tools.convert`` calibration per
method on a random-weight checkpoint of the llama3-8b shape, calibrated on random tokens (it times the method, not
the accuracy). Calibration streams the checkpoint one decoder layer at a time onto the GPU (``--device``); the input
embedding stays on the CPU (a lookup), and the calibration activations go to pinned CPU memory between layer runs
when they would exceed ``--activations-budget-gib`` (``--offload-activations auto``, the default: on for 128 x 2048
tokens of the 8B shape, whose activations take 4 GiB, 8 GiB with drift correction).

Per method it records the calibration seconds, the seconds with the writer, the peaks of
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` beside :func:`memory_plan`'s estimate, the median
seconds per decoder layer, and against them a floor counted first: the fp32 FLOPs of the Hessian sums, the layer
forwards GPTQ runs and the GPTQ updates, and the fp64 FLOPs of the Cholesky factorizations (and of the recipes'
extras: drift correction, rotation, code refinement; see :func:`layer_floor`), over the fp32 / fp64 matmul rates
measured in this process, plus the launch-bound column loops of GPTQ and of the refinement (about 13 small kernels
per weight column, at the launch time measured here), which run after the sums and so add to them. With ``--layers N``
below the shape's count the checkpoint has N layers and ``extrapolated_seconds`` = fixed part + median layer time x
the shape's layer count.

Methods: plain GPTQ / AWQ / RTN / SmoothQuant, and ``recipe-sym`` / ``recipe-asym``, the README's two W4 g128
recipes flag for flag (rotation, act-order, clipping search, drift correction; the asym one also per-head rotation
and two refinement passes).

The checkpoint (``--source``): ``random`` (the default) draws it as calibration reads it, each tensor on the GPU
(``common.RandomCheckpointReader``: N(0, 0.02) bf16 weights, unit norms, every tensor seeded by ``--seed`` and its
name, so the same at every read), with nothing written but its config.json under ``--work-dir``: no 16 GB build
before the 8B run, whose setup is seconds. ``disk`` reads a bf16 safetensors checkpoint: with all of the shape's
layers e2e_gpu.py's (the same config and seed, under its ``$LQE_BENCH_DIR/<shape>/bf16``: one 16 GB copy serves
e2e_gpu.py, kv_cache_gpu.py and this; 2-3 min to build), with ``--layers N`` an N-layer one of its own under
``--work-dir``. The two hold different random values of the same distribution (the time and memory of calibration
are the same; each row says its ``source``). The calibration tokens are saved under ``--work-dir``.

Longer than one call: ``--stop-after-s S`` stops cleanly between two decoder layers before S seconds from the
start (the next layer predicted as 1.25 x the slowest so far, the writer as ``--tail-s``), saves the state under
``--work-dir`` (the next layer, the activations entering it, the quantized layers so far, each call's seconds and
peak memory: tools.convert.streaming.LayerCheckpoint) and exits 3; the same command again continues there and gives
the weights of an uninterrupted run. The final row's ``calib_seconds`` sums the calls, its peaks are the largest of
any call, and ``calls`` / ``resumed`` say so. With ``--stop-after-s``, a method finished in an earlier call is
skipped (its row kept; ``--restart`` measures again), and no method starts with under ``--min-start-s`` left.
``--build-only`` writes the checkpoint and the calibration tokens and exits.

With ``LQE_BUDGET_S`` set (the seconds the device call has left as the script starts, as benchmarks/stages/budget.sh
reads it), the stop is at most ``LQE_BUDGET_S - 20`` s from the start, so the script pauses before the call is
killed. A pause also writes the method's partial row (``complete: false``, ``paused_before_layer``, ``layers_done``,
each layer's seconds and their median, ``extrapolated_seconds`` = fixed part + median x the shape's layers, and
``extrapolated_with_tail_s`` with ``--tail-s`` for the LM head and the writer, peak GPU memory so far), which the
complete row replaces: even a call cut short measures the seconds per layer and the peak memory.

Results go to ``benchmarks/results/calibration-<gpu>.json`` (``calibration-cpu.json`` without a GPU); rows of
other methods / shapes already there are kept.

    python benchmarks/calibration_gpu.py                               # llama3-8b, 32 layers, 128 x 2048 tokens
    python benchmarks/calibration_gpu.py --layers 4 --methods gptq-sym  # a few minutes, extrapolated to 32 layers
    python benchmarks/calibration_gpu.py --quick                        # tiny shape, seconds, CPU or GPU

Issue 27 on an H100: one device call (600 s; a session has 15 minutes of device time, the machine's start included),
on a bare machine, nothing to build first:

    LQE_BUDGET_S=590 PYTHONUNBUFFERED=1 python benchmarks/calibration_gpu.py --methods gptq-asym-act \
        --work-dir /tmp/calib --out $OUT/calibration-h100.json 2>&1 | tee $OUT/calibration.log

(run's timeout_s 600): setup ~10 s, 32 layers at ~12 s, the writer ~50 s; exit 0 and a complete row, or exit 3 and
a partial one (per-layer seconds, peak memory, the 32-layer extrapolation) if the layers run slower than that. Copy
``$OUT/calibration-h100.json`` to ``benchmarks/results/calibration-nvidia-h100-80gb-hbm3.json``. ``recipe-asym``
(~14 min of layers at its floor) does not fit one call: ``--methods recipe-asym --layers 8`` extrapolated, or its
partial row from the same one-call command.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

T_START = time.monotonic()  # --stop-after-s counts from here
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402

from common import RandomCheckpointReader, env_info, write_random_checkpoint  # noqa: E402
from e2e_gpu import SHAPES as E2E_SHAPES, build_random_model, checkpoint_dir  # noqa: E402

LLAMA3_8B = E2E_SHAPES["llama3-8b"][1]  # e2e_gpu.py's config of the shape: its checkpoint is this one's
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, rope_theta=10000.0, max_position_embeddings=512, rms_norm_eps=1e-5,
            tie_word_embeddings=False)
SHAPES = {"llama3-8b": LLAMA3_8B, "tiny": TINY}
# name -> (method, ExportSpec fields[, CalibOptions fields]); W4 g128 unless said otherwise
METHODS = {
    "gptq-sym": ("gptq", dict(fmt="gptq", sym=True)),
    "gptq-asym": ("gptq", dict(fmt="gptq_v2", sym=False)),
    "gptq-asym-act": ("gptq", dict(fmt="gptq_v2", sym=False, desc_act=True)),
    "awq": ("awq", dict(fmt="awq", sym=False)),
    "rtn": ("rtn", dict(fmt="gptq", sym=True)),
    "smoothquant": ("smoothquant", dict(fmt="w8a8", bits=8, group_size=-1)),
    # the README's two W4 recipes ("Accuracy methods and recipes"), flag for flag
    "recipe-sym": ("gptq", dict(fmt="gptq", sym=True, desc_act=True, static_groups=True, mse=True, drift_alpha=0.25),
                   dict(rotate="hadamard")),
    "recipe-asym": ("gptq", dict(fmt="gptq", sym=False, desc_act=True, mse=True, drift_alpha=0.25),
                    dict(rotate="hadamard", rotate_heads=True, refine_passes=2)),
}
DEFAULT_METHODS = "gptq-sym,gptq-asym,awq,rtn"
SHARD_BYTES = 4 << 30
GPTQ_BLOCK = 128
BUDGET_MARGIN_S = 20.0  # kept from LQE_BUDGET_S: the pause's own save and exit, the call's transfers
KERNELS_PER_COLUMN = 13  # GPTQ's inner loop: divide, round, add, clamp, cast, store, 4 error ops, outer product, 2 updates


# ------------------------------------------------------------------------------------------------ checkpoint
def llama_config(fields: dict):
    """The Llama config (bf16) of ``fields``, and its model class."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**fields, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1)
    config.architectures = ["LlamaForCausalLM"]
    return config, LlamaForCausalLM


def build_checkpoint(fields: dict, out_dir: Path, seed: int) -> Path:
    """A bf16 safetensors Llama checkpoint with N(0, 0.02) weights and unit norms (reused when present)."""
    config, model_cls = llama_config(fields)
    return write_random_checkpoint(config, model_cls, out_dir, seed, SHARD_BYTES)


def random_source(fields: dict, config_dir: Path, seed: int) -> tuple[Path, RandomCheckpointReader]:
    """``--source random``: the checkpoint of ``fields`` drawn as calibration reads it (common.RandomCheckpointReader,
    on the GPU when there is one; nothing on disk but ``config_dir/config.json``), and that folder."""
    config, model_cls = llama_config(fields)
    reader = RandomCheckpointReader(config, model_cls, seed)
    reader.save_config(config_dir)
    return config_dir, reader


def budget_stop_after(stop_after_s: float | None, env: dict | None = None) -> float | None:
    """The effective ``--stop-after-s``: with ``LQE_BUDGET_S`` set (the seconds the device call has left when the
    script starts, as in benchmarks/stages/budget.sh), at most that less :data:`BUDGET_MARGIN_S`, so the script pauses
    (state saved, a partial row written, exit 3) before the call is killed."""
    env = os.environ if env is None else env
    budget = env.get("LQE_BUDGET_S")
    if not budget:
        return stop_after_s
    limit = float(budget) - BUDGET_MARGIN_S
    return limit if stop_after_s is None else min(stop_after_s, limit)


def same_random_model(model_dir: Path, fields: dict, seed: int) -> bool:
    """Whether ``model_dir`` is the random checkpoint of ``fields`` drawn with ``seed``: its config has the fields,
    and its first drawn tensor (``common.write_random_checkpoint`` draws them in the index's order from one generator,
    norms aside) equals a fresh draw with ``seed`` on the same kind of device."""
    from safetensors import safe_open

    try:
        config = json.loads((model_dir / "config.json").read_text())
        index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    except (OSError, ValueError, KeyError):
        return False
    if any(config.get(k) != v for k, v in fields.items()):
        return False
    name = next(k for k in index if not k.endswith("norm.weight"))
    with safe_open(str(model_dir / index[name]), framework="pt") as f:
        stored = f.get_tensor(name)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(seed)
    drawn = (torch.randn(tuple(stored.shape), generator=gen, device=dev) * 0.02).to(torch.bfloat16).cpu()
    return torch.equal(drawn, stored)


def shared_random_model(shape: str, seed: int, fallback: Path) -> tuple[Path, bool]:
    """e2e_gpu.py's bf16 checkpoint of ``shape`` (``e2e_gpu.checkpoint_dir``; built there with its ``build_random_model``
    when absent and ``seed`` is e2e_gpu.py's default, 0) when it is the model of this seed, else one built in
    ``fallback``; and whether it is e2e_gpu.py's."""
    fields = E2E_SHAPES[shape][1]
    shared = checkpoint_dir(shape)
    if (shared / "config.json").exists():
        if same_random_model(shared, fields, seed):
            return shared, True
        print(f"[{shape}] {shared} is not the random model of seed {seed}: using {fallback}", flush=True)
    elif seed == 0:
        return build_random_model(shape, shared, seed), True
    return build_random_model(shape, fallback, seed), False


def calibration_ids(work: Path, vocab: int, num_samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """Random token ids ``[num_samples, seq_len]`` (seeded), saved in ``work`` and read back from there."""
    path = work / f"ids-{num_samples}x{seq_len}-v{vocab}-seed{seed}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (num_samples, seq_len), generator=gen)
    work.mkdir(parents=True, exist_ok=True)
    torch.save(ids, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)
    return ids


# ------------------------------------------------------------------------------------------------ memory
def memory_plan(fields: dict, num_samples: int, seq_len: int, batch_size: int, name: str, offload: bool,
                device: str = "cuda", group_size: int = 128) -> dict:
    """Bytes the calibration of ``name`` holds on its device (``cuda``; ``cpu``: everything, the device being the
    host) at its largest moments, counted from the tensors the code makes; ``peak`` is the largest phase. Phases:

    * ``capture``: the stored activations (one batch on the device when offloaded) and the embedding (on the host);
    * ``forward``: the down_proj statistics pass: one layer (two with drift correction: the float copy), the fp32
      sums (Hessian, and the drift's), the gate/up Hessian still referenced, one batch's MLP temporaries (gate,
      silu, up, product: three alive; the float stream's input and the difference with drift correction);
    * ``hessian``: the fp32 sum becoming the float64 Hessian (both alive);
    * ``gptq``: the Hessian, GPTQ's two float64 working matrices (tools.convert.gptq), the weight's fp32 copy; with drift correction the drift sum and ``drift_target``'s solve (a copy of H,
      its LU factor, the solution) first; with refinement its float64 Hessian copy, fp32 copy, and the normal
      equations of :mod:`tools.convert.refine` (the ``[N, P, P]`` system, its ridge, its LU);
    * ``finish``: the LM head in fp32 (and its float64 rotation).

    The largest linear input (down_proj's, the intermediate size) sets the Hessian terms. Not counted: cuBLAS /
    cuSOLVER workspaces, the allocator's rounding and fragmentation (``max_memory_reserved`` shows them), attention
    temporaries (below the MLP's)."""
    method, spec_fields, *rest = METHODS[name]
    opts = rest[0] if rest else {}
    h, inter, vocab = fields["hidden_size"], fields["intermediate_size"], fields["vocab_size"]
    kv = fields["num_key_value_heads"] * (h // fields["num_attention_heads"])
    layers = fields["num_hidden_layers"]
    host = device == "cpu"
    offload = offload and not host
    drift = spec_fields.get("drift_alpha", 0) > 0
    streams = 2 if drift else 1
    b = min(batch_size, num_samples)
    f32, f64 = 4, 8
    acts = streams * num_samples * seq_len * h * f32
    batch = b * seq_len * h * f32  # one batch's hidden states
    mlp_t = b * seq_len * inter * f32  # one batch's intermediate activation
    layer = f32 * (2 * h * h + 2 * kv * h + 3 * h * inter + 2 * h)
    emb = f32 * vocab * h
    held = (2 * streams * batch) if offload else acts  # offloaded: one batch in, its output out
    lay = streams * layer
    k2, n_down = inter * inter, h  # down_proj: K = intermediate, N = hidden
    g = spec_fields.get("group_size", group_size)
    groups = inter // g if g > 0 else 1
    # what the host holds besides (device == cpu only): the table, the finished layers' codes and scales
    canon_layer = (layer // f32) + 2 * f32 * sum(n * (k // g if g > 0 else 1) for n, k in (
        (h + 2 * kv, h), (h, h), (2 * inter, h), (h, inter)))
    host_base = emb if host else 0
    done = canon_layer * (layers - 1) if host else 0
    phases = {"capture": acts if not offload else 2 * batch}
    if host:
        phases["capture"] += emb
    if method in ("gptq", "awq", "smoothquant"):
        fwd = held + lay + 3 * mlp_t + 3 * batch
        if method == "gptq":
            fwd += f32 * k2 * streams + f64 * h * h
            if drift:
                fwd += 2 * mlp_t
        phases["forward"] = host_base + done + fwd
    if method == "gptq":
        phases["hessian"] = host_base + done + held + lay + (f32 * k2 * (streams - 1)) + (f32 + f64) * k2 + f64 * h * h
        gptq = f64 * k2 + 2 * f64 * k2 + f32 * n_down * inter  # H, two working matrices, the weight's copy
        extra = 0
        if drift:  # drift sum + drift_target: H copy, its LU, the solution; the float64 weight and product
            gptq += f64 * k2
            extra = max(extra, 3 * f64 * k2 + 2 * f64 * n_down * inter - 2 * f64 * k2)
        if opts.get("refine_passes"):  # H copy (f64) and its fp32 copy; [N, P, P] normal equations x 3
            p = (2 if not spec_fields.get("sym", True) else 1) * groups
            extra = max(extra, f64 * k2 + f32 * k2 + 3 * f64 * n_down * p * p + 2 * f64 * n_down * inter
                        - 2 * f64 * k2)
        phases["gptq"] = host_base + done + held + lay + gptq + max(0, extra)
    head = f32 * vocab * h * (0 if fields.get("tie_word_embeddings") and not opts.get("rotate") else 1)
    phases["finish"] = head + (4 * head if opts.get("rotate") else 0) + (emb + canon_layer * layers if host else 0)
    peak_phase = max(phases, key=phases.get)
    return {"activations": acts, "offload": offload, "layer": layer, "embedding": emb, "hessian": f64 * k2,
            "phases": phases, "peak_phase": peak_phase, "peak": phases[peak_phase]}


def _timed(fn, device: torch.device, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measured_rates(device: torch.device) -> dict:
    """fp32 and fp64 matmul FLOP/s (full-precision fp32: no TF32) and seconds per small kernel launch, here."""
    from tools.convert.streaming import fp32_matmuls

    n32, n64 = (8192, 4096) if device.type == "cuda" else (1024, 512)
    out = {}
    with fp32_matmuls():
        for key, n, dtype in (("fp32_flops", n32, torch.float32), ("fp64_flops", n64, torch.float64)):
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            out[key] = 2 * n ** 3 / _timed(lambda: a @ b, device)
    x = torch.zeros(128, device=device)

    def launches():
        for _ in range(1000):
            x.add_(1.0)

    out["launch_s"] = _timed(launches, device) / 1000
    return out


def layer_floor(fields: dict, tokens: int, seq_len: int, method: str, rates: dict, drift: bool = False,
                refine_passes: int = 0, rotate: bool = False, zeros: bool = False) -> dict:
    """Counted work of one decoder layer for ``method`` and the time it takes at ``rates`` (what the hardware did on
    plain matmuls in this process): the floor the measured time is compared with. GPTQ's extras, when on: ``drift``
    (one more float forward, the drift sums beside the Hessians, and per linear a float64 solve and correction),
    ``refine_passes`` (per pass the residual ``H (w~ - w)`` twice over, a column loop, and the float64 scale refit;
    ``zeros``: asymmetric, whose refit solves for the zero points too), ``rotate`` (one float64 matmul per linear).
    The clipping search of ``mse`` is elementwise work and not counted."""
    h, inter = fields["hidden_size"], fields["intermediate_size"]
    hd = h // fields["num_attention_heads"]
    kv = fields["num_key_value_heads"] * hd
    qkv, o, gu, d = h * (h + 2 * kv), h * h, 2 * h * inter, inter * h  # parameters of each linear group
    attn = 2 * seq_len * h  # per token: Q K^T and P V over the causal half of the sequence, 2 FLOPs a MAC
    linears = [(h + 2 * kv, h), (h, h), (inter, h), (inter, h), (h, inter)]  # [N, K]: q/k/v as one, o, gate, up, down
    per_linear = [(h, h), (kv, h), (kv, h)] + linears[1:]  # q, k, v quantized separately, one Hessian each
    fp64 = 0.0
    if method == "gptq":
        forward = 2 * tokens * (4 * qkv + 3 * o + 2 * gu + d) + 4 * tokens * attn  # 4 cut-short passes + advance
        hessian = 2 * tokens * (3 * h * h + inter * inter)  # X^T X of q/k/v, o, gate/up, down inputs
        # GPTQ: lazy block updates ~ N K^2 + N K B
        update = sum(n * k * k + n * k * GPTQ_BLOCK for n, k in linears)
        fp64 = sum(4 / 3 * k ** 3 for _, k in per_linear)  # per linear: chol, inverse, chol
        columns = sum(k for _, k in per_linear)
        if drift:  # the float stream's forward, D = sum (x_fp - x) x^T beside H, then W + a W D H^-1 per linear
            forward += 2 * tokens * (qkv + o + gu + d) + 2 * tokens * attn
            hessian *= 2
            fp64 += sum(8 / 3 * k ** 3 + 2 * n * k * k for n, k in per_linear)
        if refine_passes:  # per pass: r = H (w~ - w), its block updates, the in-block rank-1 steps; then the refit
            update += refine_passes * sum(4 * n * k * k + 2 * n * k * GPTQ_BLOCK for n, k in per_linear)
            bases = 3 if zeros else 1  # normal equations: [codes, -1] for (s, s z), then codes - z for s
            fp64 += sum((refine_passes * (2 * bases + 4) + 4) * n * k * k for n, k in per_linear)  # + row errors
            columns += refine_passes * sum(k for _, k in per_linear)
        if rotate:
            fp64 += sum(2 * n * k * k for n, k in per_linear)
    elif method == "rtn":
        forward = hessian = update = columns = 0
    else:  # awq / smoothquant: a statistics pass (cut short before down_proj) + advance; AWQ's search not counted
        forward = 2 * tokens * (2 * qkv + 2 * o + 2 * gu + d) + 2 * tokens * attn
        hessian = update = columns = 0
    fp32 = forward + hessian + update
    floor = fp32 / rates["fp32_flops"] + fp64 / rates["fp64_flops"]
    launch = columns * KERNELS_PER_COLUMN * rates["launch_s"]
    return {"forward_tflop": forward / 1e12, "hessian_tflop": hessian / 1e12, "gptq_update_tflop": update / 1e12,
            "fp64_tflop": fp64 / 1e12, "gptq_columns": columns, "flop_floor_s": floor,
            "launch_floor_s": launch, "floor_s": floor + launch}  # serial phases: the column loop waits for the sums


# ------------------------------------------------------------------------------------------------ main
def slug(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def resolve_offload(args, name: str, fields: dict) -> bool:
    """``--offload-activations``: on, off, or auto = on when the stored activations (both streams with drift
    correction) exceed ``--activations-budget-gib`` on a GPU."""
    if args.offload_activations != "auto":
        return args.offload_activations == "on"
    plan = memory_plan(fields, args.num_samples, args.seq_len, args.batch_size, name, False, group_size=args.group_size)
    return args.device_type == "cuda" and plan["activations"] > args.activations_budget_gib * 2**30


def resume_key(args, name: str, model_dir: Path, offload: bool, device: torch.device) -> dict:
    return {"shape": args.shape, "layers": args.layers_built, "seed": args.seed, "model_dir": str(model_dir),
            "source": args.source,
            "num_samples": args.num_samples, "seq_len": args.seq_len, "batch_size": args.batch_size,
            "group_size": args.group_size, "method": name, "offload_activations": offload, "device": str(device)}


def method_setup(name: str, args, ids: torch.Tensor, device: torch.device, fields: dict):
    """``name``'s quantization method, ExportSpec, CalibOptions, and the fields its rows share (partial ones too)."""
    from tools.convert.quantize import CalibOptions
    from tools.convert.spec import ExportSpec

    method, spec_fields, *rest = METHODS[name]
    opts_fields = rest[0] if rest else {}
    offload = resolve_offload(args, name, fields)
    spec = ExportSpec(**{"group_size": args.group_size, **spec_fields})
    opts = CalibOptions(num_samples=ids.shape[0], seq_len=ids.shape[1], batch_size=args.batch_size, device=str(device),
                        offload_activations=offload, **opts_fields)
    floor = layer_floor(fields, ids.numel(), ids.shape[1], method, args.rates, drift=spec.drift_alpha > 0,
                        refine_passes=opts.refine_passes, rotate=opts.rotate is not None, zeros=not spec.sym)
    plan = memory_plan(fields, ids.shape[0], ids.shape[1], args.batch_size, name, offload, device.type,
                       args.group_size)
    head = {"method": name, "quant_method": method, "source": args.source, "bits": spec.bits,
            "group_size": spec.group_size, "sym": spec.sym, "desc_act": spec.desc_act,
            "flags": {k: v for k, v in {**spec_fields, **opts_fields}.items()
                      if k not in ("fmt", "bits", "group_size", "sym", "desc_act")},
            "offload_activations": offload}
    tail = {"floor_s_per_layer": float(f"{floor['floor_s']:.4g}"),
            "floor": {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in floor.items()},
            "planned_peak_gib": round(plan["peak"] / 2**30, 3), "planned_peak_phase": plan["peak_phase"],
            "setup_seconds": round(args.setup_s, 2)}
    return method, spec, opts, head, tail


def run_method(name: str, model_dir: Path, out_dir: Path, args, ids: torch.Tensor, device: torch.device,
               fields: dict, rates: dict, ckpt=None, reader=None) -> dict:
    """One method's row; with ``ckpt`` (a LayerCheckpoint) the calibration resumes from its saved state and may stop
    (CalibrationStopped, after saving) when its deadline comes. ``reader``: the checkpoint's tensors (None: read
    from ``model_dir``'s shards)."""
    from tools.convert.quantize import quantize_checkpoint
    from tools.convert.resume import resumable

    args.rates = rates
    method, spec, opts, head, tail = method_setup(name, args, ids, device, fields)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    if ckpt is not None:
        with resumable(ckpt):
            _, res = quantize_checkpoint(str(model_dir), str(out_dir), method, spec, opts, overwrite=True,
                                         input_ids=ids, reader=reader)
    else:
        _, res = quantize_checkpoint(str(model_dir), str(out_dir), method, spec, opts, overwrite=True, input_ids=ids,
                                     reader=reader)
    total = time.perf_counter() - t0
    shutil.rmtree(out_dir, ignore_errors=True)
    before = ckpt.previous_calls if ckpt is not None else []
    calib = res.seconds + sum(c["seconds"] for c in before)
    layers = len(res.layer_seconds)
    per_layer = statistics.median(res.layer_seconds) if res.layer_seconds else 0.0
    fixed = max(0.0, calib - sum(res.layer_seconds))
    errors = [e for e in res.layer_errors if e is not None]
    floor_s = tail["floor"]["floor_s"]
    row = {**head, "complete": True, "layers": layers, "calib_seconds": round(calib, 2),
           "seconds": round(calib + total - res.seconds, 2), "write_seconds": round(total - res.seconds, 2),
           "layer_seconds_median": round(per_layer, 3), "fixed_seconds": round(fixed, 2),
           "extrapolated_seconds": round(fixed + per_layer * args.full_layers, 1),
           "vs_floor": round(per_layer / floor_s, 2) if floor_s else None,
           "mean_layer_error": round(statistics.mean(errors), 6) if errors else None,
           **tail, "resumed": bool(before), "calls": len(before) + 1}
    if before:
        row["seconds_per_call"] = [c["seconds"] for c in before] + [round(res.seconds, 2)]
    if device.type == "cuda":
        peak = max([torch.cuda.max_memory_allocated(device)] + [c.get("peak_allocated", 0) for c in before])
        reserved = max([torch.cuda.max_memory_reserved(device)] + [c.get("peak_reserved", 0) for c in before])
        row["peak_gpu_gib"] = round(peak / 2**30, 3)
        row["peak_gpu_reserved_gib"] = round(reserved / 2**30, 3)
        row["peak_gpu_gib_above_start"] = round((torch.cuda.max_memory_allocated(device) - base) / 2**30, 3)
    return row


def partial_row(name: str, args, ids: torch.Tensor, device: torch.device, fields: dict, ckpt, tail_s: float) -> dict:
    """The row of a calibration paused before its end (CalibrationStopped; its state just saved by ``ckpt``): the
    layers done, their median seconds, the 32-layer seconds extrapolated from them (the fixed part so far, this pause's
    save left out, + median x the shape's layers; ``extrapolated_with_tail_s`` adds ``--tail-s``, the
    allowance for the LM head and the writer), the peak device memory of every call so far; ``complete`` false and
    ``paused_before_layer``. A complete row of the method replaces it."""
    _, _, _, head, tail = method_setup(name, args, ids, device, fields)
    state = ckpt.read_state()
    done, secs, calls = state["next_layer"], state["layer_seconds"], state["calls"]
    calib = sum(c["seconds"] for c in calls) - state.get("save_seconds", 0.0)
    per_layer = statistics.median(secs) if secs else 0.0
    fixed = max(0.0, calib - sum(secs))
    errors = [e for e in state["layer_errors"] if e is not None]
    floor_s = tail["floor"]["floor_s"]
    row = {**head, "complete": False, "paused_before_layer": done, "layers": args.layers_built, "layers_done": done,
           "calib_seconds": round(calib, 2), "layer_seconds": [round(t, 3) for t in secs],
           "layer_seconds_median": round(per_layer, 3), "fixed_seconds": round(fixed, 2),
           "extrapolated_seconds": round(fixed + per_layer * args.full_layers, 1),
           "extrapolated_with_tail_s": round(fixed + per_layer * args.full_layers + tail_s, 1),
           "vs_floor": round(per_layer / floor_s, 2) if floor_s and per_layer else None,
           "mean_layer_error": round(statistics.mean(errors), 6) if errors else None,
           **tail, "calls": len(calls), "seconds_per_call": [c["seconds"] for c in calls],
           "stop_after_s": args.stop_after_s}
    if device.type == "cuda":
        peak = max([torch.cuda.max_memory_allocated(device)] + [c.get("peak_allocated", 0) for c in calls])
        reserved = max([torch.cuda.max_memory_reserved(device)] + [c.get("peak_reserved", 0) for c in calls])
        row["peak_gpu_gib"] = round(peak / 2**30, 3)
        row["peak_gpu_reserved_gib"] = round(reserved / 2**30, 3)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers built and calibrated (default: the shape's)")
    ap.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma list of {', '.join(METHODS)}")
    ap.add_argument("--num-samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8, help="calibration sequences per forward")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    ap.add_argument("--offload-activations", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                    help="calibration activations in pinned CPU memory between layer runs (tools.convert's flag); "
                         "auto (default): on a GPU when they exceed --activations-budget-gib")
    ap.add_argument("--activations-budget-gib", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=os.environ.get("LQE_BENCH_DIR", str(Path(tempfile.gettempdir()) / "lqe-calib")),
                    help="where an N-layer checkpoint, the calibration tokens, outputs (deleted after) and resumable "
                         "state live")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/calibration-<gpu>.json)")
    ap.add_argument("--quick", action="store_true", help="tiny shape, 4 x 32 tokens: a smoke run of seconds")
    ap.add_argument("--source", default="random", choices=("random", "disk"),
                    help="random (default): the random checkpoint drawn on the device as calibration reads it, "
                         "nothing written first (common.RandomCheckpointReader); disk: a bf16 safetensors checkpoint "
                         "(e2e_gpu.py's for the whole shape, else an N-layer one built under --work-dir)")
    ap.add_argument("--build-only", action="store_true", help="write the checkpoint and the calibration tokens, exit")
    ap.add_argument("--stop-after-s", type=float, default=None,
                    help="stop between decoder layers (state saved under --work-dir, a partial row written, exit 3) "
                         "before this many seconds from the start; the same command again resumes. With LQE_BUDGET_S "
                         f"set (the device call's seconds left): at most LQE_BUDGET_S - {BUDGET_MARGIN_S:.0f}")
    ap.add_argument("--save-every", type=int, default=0,
                    help="also save the state after every N layers (0: only when stopping; each save writes the "
                         "activations, 4-8 GiB on the 8B shape)")
    ap.add_argument("--tail-s", type=float, default=None,
                    help="seconds asked for what follows the last layer (LM head, writer; default: estimated from "
                         "the checkpoint's size)")
    ap.add_argument("--min-start-s", type=float, default=90.0,
                    help="with --stop-after-s: after a method finished, start the next only with this much time left")
    ap.add_argument("--restart", action="store_true", help="drop saved states and finished-method marks first")
    args = ap.parse_args(argv)
    if args.quick:
        args.shape, args.num_samples, args.seq_len = "tiny", min(args.num_samples, 4), min(args.seq_len, 32)
        args.group_size = min(args.group_size, 64)
    methods = args.methods.split(",")
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"unknown method(s) {bad}; choose from {', '.join(METHODS)}")
    from tools.convert.spec import ConvertError
    from tools.convert.resume import CalibrationStopped, LayerCheckpoint
    from tools.convert.streaming import resolve_device

    try:
        device = resolve_device(args.device)
    except ConvertError as e:
        print(f"calibration_gpu.py: {e}")
        return 2
    args.device_type = device.type
    fields = dict(SHAPES[args.shape])
    args.full_layers = fields["num_hidden_layers"]
    if args.layers is not None:
        fields["num_hidden_layers"] = args.layers
    layers = args.layers_built = fields["num_hidden_layers"]
    work = Path(args.work_dir)
    args.stop_after_s = budget_stop_after(args.stop_after_s)
    t0 = time.perf_counter()
    reader = None
    if args.source == "random":
        model_dir, reader = random_source(fields, work / f"{args.shape}-{layers}l-random-config", args.seed)
        print(f"[{args.shape}, {layers} layers] random bf16 checkpoint drawn on {reader.draw_device} as it is read "
              f"({reader.nbytes() / 1e9:.1f} GB, nothing on disk; config in {model_dir}): set up in "
              f"{time.perf_counter() - t0:.1f}s, {time.monotonic() - T_START:.1f}s from the start", flush=True)
    elif layers == args.full_layers and args.shape in E2E_SHAPES:  # the whole shape: e2e_gpu.py's checkpoint
        model_dir, shared = shared_random_model(args.shape, args.seed, work / f"{args.shape}-{layers}l-seed{args.seed}")
    else:
        model_dir, shared = build_checkpoint(fields, work / f"{args.shape}-{layers}l-seed{args.seed}", args.seed), False
    if reader is None:
        print(f"[{args.shape}, {layers} layers] random bf16 checkpoint at {model_dir}"
              f"{' (e2e_gpu.py s)' if shared else ''} ({time.perf_counter() - t0:.0f}s)", flush=True)
    ids = calibration_ids(work, fields["vocab_size"], args.num_samples, args.seq_len, args.seed)
    if args.build_only:
        print(f"built: {model_dir} and {args.num_samples} x {args.seq_len} calibration tokens in {work}")
        return 0
    rates = args.rates = measured_rates(device)
    print(f"[{device}] measured: fp32 matmul {rates['fp32_flops'] / 1e12:.1f} TFLOP/s, fp64 "
          f"{rates['fp64_flops'] / 1e12:.1f} TFLOP/s, {rates['launch_s'] * 1e6:.1f} us per small kernel", flush=True)
    out_path = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"calibration-{slug(device)}.json"
    old = json.loads(out_path.read_text()).get("rows", []) if out_path.exists() else []
    key = ("shape", "layers", "num_samples", "seq_len", "method", "offload_activations", "source")
    rows = {tuple(r.get(k) for k in key): r for r in old}
    from tools.convert.writer import CheckpointReader

    src = reader if reader is not None else CheckpointReader(str(model_dir))  # (shard headers only)
    ckpt_bytes = sum(t.numel() * t.element_size() for t in src.meta.values())
    tail_s = args.tail_s if args.tail_s is not None else 20.0 + 2.0 * ckpt_bytes / 1e9
    deadline = None if args.stop_after_s is None else T_START + args.stop_after_s
    args.setup_s = time.monotonic() - T_START
    print(f"setup: {args.setup_s:.1f}s from the start"
          + (f"; stopping by {args.stop_after_s:.0f}s (tail {tail_s:.0f}s)" if deadline is not None else ""),
          flush=True)
    paused = progressed = False
    for name in methods:
        offload = resolve_offload(args, name, fields)
        state_dir = work / "resume" / f"{name}-{args.shape}-{layers}l-{args.num_samples}x{args.seq_len}-seed{args.seed}"
        ckpt = LayerCheckpoint(state_dir, resume_key(args, name, model_dir, offload, device), deadline, tail_s,
                               args.save_every)
        done = state_dir / "done.json"
        if args.restart:
            ckpt.clear()
        if ckpt.exists():
            try:
                ckpt.read_state()
            except ConvertError as e:
                print(f"[{name}] {e}: starting again", flush=True)
                ckpt.clear()
        if done.exists() and deadline is not None:
            saved = json.loads(done.read_text())
            if saved["key"] == ckpt.key:
                row = saved["row"]
                rows[tuple(row.get(k) for k in key)] = row
                print(f"[{name}] done in an earlier call ({row['calib_seconds']:.1f}s); --restart measures again",
                      flush=True)
                continue
        if progressed and not ckpt.exists() and deadline is not None and deadline - time.monotonic() < args.min_start_s:
            print(f"[{name}] not started: {deadline - time.monotonic():.0f}s left (--min-start-s "
                  f"{args.min_start_s:.0f}); run the same command again", flush=True)
            paused = True
            break
        progressed = True  # (a call always makes progress: one layer at least, see LayerCheckpoint)
        try:
            row = run_method(name, model_dir, work / f"out-{name}", args, ids, device, fields, rates, ckpt, reader)
        except CalibrationStopped as e:
            shutil.rmtree(work / f"out-{name}", ignore_errors=True)
            print(f"[{name}] PAUSED before layer {e.next_layer} of {e.num_layers} after "
                  f"{time.monotonic() - T_START:.0f}s: state in {e.path}; run the same command again to continue",
                  flush=True)
            paused = True
            row = {"shape": args.shape, "num_samples": args.num_samples, "seq_len": args.seq_len,
                   "batch_size": args.batch_size, "device": str(device),
                   **partial_row(name, args, ids, device, fields, ckpt, tail_s)}
            rows[tuple(row.get(k) for k in key)] = row
            print(f"[{name}] partial: {row['layers_done']} of {row['layers']} layers, "
                  f"{row['layer_seconds_median']:.3g}s/layer (median), extrapolated to {args.full_layers} layers: "
                  f"{row['extrapolated_seconds']:.1f}s ({row['extrapolated_with_tail_s']:.1f}s with the tail)"
                  + (f"; peak GPU memory so far {row['peak_gpu_gib']:.2f} GiB allocated, "
                     f"{row['peak_gpu_reserved_gib']:.2f} reserved" if "peak_gpu_gib" in row else ""), flush=True)
            break
        row = {"shape": args.shape, "num_samples": args.num_samples, "seq_len": args.seq_len,
               "batch_size": args.batch_size, "device": str(device), **row}
        rows[tuple(row.get(k) for k in key)] = row
        ckpt.clear()
        if args.stop_after_s is not None:
            state_dir.mkdir(parents=True, exist_ok=True)
            done.write_text(json.dumps({"key": ckpt.key, "row": row}, indent=1))
        f = row["floor"]
        print(f"[{name}] calibration {row['calib_seconds']:.1f}s (+{row['write_seconds']:.1f}s writing)"
              + (f" over {row['calls']} calls" if row["resumed"] else "") + ", "
              f"{row['layer_seconds_median']:.3g}s/layer against a floor of {row['floor_s_per_layer']:.3g}s "
              f"(fp32 {f['forward_tflop'] + f['hessian_tflop'] + f['gptq_update_tflop']:.3g} TFLOP, fp64 "
              f"{f['fp64_tflop']:.3g} TFLOP, {f['gptq_columns']} GPTQ columns: launch floor "
              f"{f['launch_floor_s']:.3g}s)" + (f" = {row['vs_floor']}x" if row["vs_floor"] else "")
              + (f"; extrapolated to {args.full_layers} layers: {row['extrapolated_seconds']:.0f}s"
                 if layers != args.full_layers else "")
              + (f"; peak GPU memory {row['peak_gpu_gib']:.2f} GiB allocated, {row['peak_gpu_reserved_gib']:.2f} "
                 f"reserved (planned {row['planned_peak_gib']:.2f}, offload {'on' if row['offload_activations'] else 'off'})"
                 if "peak_gpu_gib" in row else ""), flush=True)
        write_rows(out_path, rows, device)
    write_rows(out_path, rows, device)
    if paused:
        return 3
    print(f"wrote {out_path}")
    return 0


def write_rows(path: Path, rows: dict, device: torch.device) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else
                                env_info()["cpu"], "env": env_info(), "rows": list(rows.values())}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
