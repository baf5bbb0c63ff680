"""GPU calibration benchmark (issue 18): seconds and peak GPU memory of ``tools.convert`` calibration per method on
a random-weight checkpoint of the llama3-8b shape, calibrated on random tokens (it times the method, not the
accuracy). Calibration streams the checkpoint one decoder layer at a time onto the GPU (``--device``).

Per method it records the calibration seconds, the seconds with the writer, the peak of
``torch.cuda.max_memory_allocated``, the median seconds per decoder layer, and against them a floor counted
first: the fp32 FLOPs of the Hessian sums, the layer forwards GPTQ runs and the GPTQ updates, and the fp64 FLOPs of
the Cholesky factorizations (and of the recipes' extras: drift correction, rotation, code refinement; see
:func:`layer_floor`), over the fp32 / fp64 matmul rates measured in this process, plus the launch-bound column loops
of GPTQ and of the refinement (about 13 small kernels per weight column, at the launch time measured here), which run
after the sums and so add to them. With ``--layers N`` below the shape's count the checkpoint has N layers and
``extrapolated_seconds`` = fixed part + median layer time x the shape's layer count.

Methods: plain GPTQ / AWQ / RTN / SmoothQuant, and ``recipe-sym`` / ``recipe-asym``, the README's two W4 g128
recipes flag for flag (rotation, act-order, clipping search, drift correction; the asym one also per-head rotation
and two refinement passes). Issue 27 asks for the whole 8B shape, each method in its own device call (one call is
10 minutes); ``--work-dir`` on an ignored path inside the tree keeps the 16 GB random checkpoint between calls:

Results go to ``benchmarks/results/calibration-<gpu>.json`` (``calibration-cpu.json`` without a GPU); rows of
other methods / shapes already there are kept.

    python benchmarks/calibration_gpu.py                               # llama3-8b, 32 layers, 128 x 2048 tokens
    python benchmarks/calibration_gpu.py --layers 4 --methods gptq-sym  # a few minutes, extrapolated to 32 layers
    python benchmarks/calibration_gpu.py --quick                        # tiny shape, seconds, CPU or GPU
    python benchmarks/calibration_gpu.py --methods gptq-asym-act --work-dir .cache/calib  # then: --methods recipe-asym
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

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402

from common import env_info, write_random_checkpoint  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)
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
KERNELS_PER_COLUMN = 13  # GPTQ's inner loop: divide, round, add, clamp, cast, store, 4 error ops, outer product, 2 updates


# ------------------------------------------------------------------------------------------------ checkpoint
def build_checkpoint(fields: dict, out_dir: Path, seed: int) -> Path:
    """A bf16 safetensors Llama checkpoint with N(0, 0.02) weights and unit norms (reused when present)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**fields, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1)
    config.architectures = ["LlamaForCausalLM"]
    return write_random_checkpoint(config, LlamaForCausalLM, out_dir, seed, SHARD_BYTES)


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


def run_method(name: str, model_dir: Path, out_dir: Path, args, ids: torch.Tensor, device: torch.device,
               fields: dict, rates: dict) -> dict:
    from tools.convert.quantize import CalibOptions, quantize_checkpoint
    from tools.convert.spec import ExportSpec

    method, spec_fields, *rest = METHODS[name]
    opts_fields = rest[0] if rest else {}
    spec = ExportSpec(**{"group_size": args.group_size, **spec_fields})
    opts = CalibOptions(num_samples=ids.shape[0], seq_len=ids.shape[1], batch_size=args.batch_size, device=str(device),
                        offload_activations=args.offload_activations, **opts_fields)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    _, res = quantize_checkpoint(str(model_dir), str(out_dir), method, spec, opts, overwrite=True, input_ids=ids)
    total = time.perf_counter() - t0
    shutil.rmtree(out_dir, ignore_errors=True)
    layers = len(res.layer_seconds)
    per_layer = statistics.median(res.layer_seconds) if res.layer_seconds else 0.0
    fixed = max(0.0, res.seconds - sum(res.layer_seconds))
    floor = layer_floor(fields, ids.numel(), ids.shape[1], method, rates, drift=spec.drift_alpha > 0,
                        refine_passes=opts.refine_passes, rotate=opts.rotate is not None, zeros=not spec.sym)
    errors = [e for e in res.layer_errors if e is not None]
    row = {"method": name, "quant_method": method, "bits": spec.bits, "group_size": spec.group_size, "sym": spec.sym,
           "desc_act": spec.desc_act, "flags": {k: v for k, v in {**spec_fields, **opts_fields}.items()
                                                 if k not in ("fmt", "bits", "group_size", "sym", "desc_act")},
           "layers": layers, "calib_seconds": round(res.seconds, 2),
           "seconds": round(total, 2), "write_seconds": round(total - res.seconds, 2),
           "layer_seconds_median": round(per_layer, 3), "fixed_seconds": round(fixed, 2),
           "extrapolated_seconds": round(fixed + per_layer * args.full_layers, 1),
           "floor_s_per_layer": float(f"{floor['floor_s']:.4g}"),
           "vs_floor": round(per_layer / floor["floor_s"], 2) if floor["floor_s"] else None,
           "mean_layer_error": round(statistics.mean(errors), 6) if errors else None,
           "floor": {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in floor.items()}}
    if device.type == "cuda":
        row["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        row["peak_gpu_gib_above_start"] = round((torch.cuda.max_memory_allocated(device) - base) / 2**30, 3)
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
    ap.add_argument("--offload-activations", action="store_true",
                    help="calibration activations in CPU memory between layer runs (tools.convert's flag)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=os.environ.get("LQE_BENCH_DIR", str(Path(tempfile.gettempdir()) / "lqe-calib")),
                    help="where the random checkpoint is built (and reused) and outputs are written (then deleted)")
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/calibration-<gpu>.json)")
    ap.add_argument("--quick", action="store_true", help="tiny shape, 4 x 32 tokens: a smoke run of seconds")
    args = ap.parse_args(argv)
    if args.quick:
        args.shape, args.num_samples, args.seq_len = "tiny", min(args.num_samples, 4), min(args.seq_len, 32)
        args.group_size = min(args.group_size, 64)
    methods = args.methods.split(",")
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"unknown method(s) {bad}; choose from {', '.join(METHODS)}")
    from tools.convert.spec import ConvertError
    from tools.convert.streaming import resolve_device

    try:
        device = resolve_device(args.device)
    except ConvertError as e:
        print(f"calibration_gpu.py: {e}")
        return 2
    fields = dict(SHAPES[args.shape])
    args.full_layers = fields["num_hidden_layers"]
    if args.layers is not None:
        fields["num_hidden_layers"] = args.layers
    layers = fields["num_hidden_layers"]
    work = Path(args.work_dir)
    t0 = time.perf_counter()
    model_dir = build_checkpoint(fields, work / f"{args.shape}-{layers}l-seed{args.seed}", args.seed)
    print(f"[{args.shape}, {layers} layers] random bf16 checkpoint at {model_dir} ({time.perf_counter() - t0:.0f}s)",
          flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, fields["vocab_size"], (args.num_samples, args.seq_len), generator=gen)
    rates = measured_rates(device)
    print(f"[{device}] measured: fp32 matmul {rates['fp32_flops'] / 1e12:.1f} TFLOP/s, fp64 "
          f"{rates['fp64_flops'] / 1e12:.1f} TFLOP/s, {rates['launch_s'] * 1e6:.1f} us per small kernel", flush=True)
    out_path = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"calibration-{slug(device)}.json"
    old = json.loads(out_path.read_text()).get("rows", []) if out_path.exists() else []
    key = ("shape", "layers", "num_samples", "seq_len", "method", "offload_activations")
    rows = {tuple(r.get(k) for k in key): r for r in old}
    for name in methods:
        row = run_method(name, model_dir, work / f"out-{name}", args, ids, device, fields, rates)
        row = {"shape": args.shape, "num_samples": args.num_samples, "seq_len": args.seq_len,
               "batch_size": args.batch_size, "offload_activations": args.offload_activations, "device": str(device),
               **row}
        rows[tuple(row.get(k) for k in key)] = row
        f = row["floor"]
        print(f"[{name}] calibration {row['calib_seconds']:.1f}s (+{row['write_seconds']:.1f}s writing), "
              f"{row['layer_seconds_median']:.3g}s/layer against a floor of {row['floor_s_per_layer']:.3g}s "
              f"(fp32 {f['forward_tflop'] + f['hessian_tflop'] + f['gptq_update_tflop']:.3g} TFLOP, fp64 "
              f"{f['fp64_tflop']:.3g} TFLOP, {f['gptq_columns']} GPTQ columns: launch floor "
              f"{f['launch_floor_s']:.3g}s)" + (f" = {row['vs_floor']}x" if row["vs_floor"] else "")
              + (f"; extrapolated to {args.full_layers} layers: {row['extrapolated_seconds']:.0f}s"
                 if layers != args.full_layers else "")
              + (f"; peak GPU memory {row['peak_gpu_gib']:.2f} GiB" if "peak_gpu_gib" in row else ""), flush=True)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else
                                        env_info()["cpu"], "env": env_info(), "rows": list(rows.values())}, indent=1))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
