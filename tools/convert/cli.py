"""Command line: ``python -m tools.convert {export,quantize,verify} ...`` (see each subcommand's --help)."""
from __future__ import annotations

import argparse
import os
import sys
import warnings

from tools.convert.spec import FORMATS, ConvertError, ExportSpec, parse_dtype, parse_size


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default after its help (not for flags whose default is None/False)."""

    def _get_help_string(self, action):
        if (action.default is None or action.default is False or action.default == argparse.SUPPRESS or not action.option_strings or action.nargs == 0
                or "default" in (action.help or "")):
            return action.help
        return super()._get_help_string(action)


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="float checkpoint: a Hugging Face directory (safetensors), the demo "
                                                  "name smollm2-135m-instruct, or a hub id org/name (as LLM takes)")
    p.add_argument("--out", required=True, help="output directory (must be empty unless --overwrite)")
    p.add_argument("--format", default="gptq", choices=FORMATS, help="gptq (v1), gptq_v2, awq, w8a8, w4a16-ct")
    p.add_argument("--bits", type=int, default=None, help="4 (default; 8 for w8a8)")
    p.add_argument("--group-size", type=int, default=None, help="128 (default; -1 = per channel, the w8a8 default)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=None,
                     help="symmetric quantization (default for every format but awq)")
    sym.add_argument("--asym", dest="sym", action="store_false", help="asymmetric quantization, with zero points "
                                                                      "(default for awq)")
    p.add_argument("--desc-act", action="store_true", help="act-order (g_idx)")
    p.add_argument("--clamp-zero", action="store_true", help="gptq v1: clamp true zero 0 to 1 (warns) instead of refusing")
    p.add_argument("--quantize-lm-head", action="store_true", help="also quantize lm_head (default: kept float)")
    p.add_argument("--dtype", default=None, help="scale dtype: fp16 (gptq/awq default), bf16, fp32 (CT default)")
    p.add_argument("--float-dtype", default="auto", help="dtype of non-quantized tensors: auto (source), fp16, bf16, fp32")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file written")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out directory")


def _spec(a: argparse.Namespace, **extra) -> ExportSpec:
    w8 = a.format == "w8a8"
    return ExportSpec(fmt=a.format, bits=a.bits or (8 if w8 else 4), group_size=a.group_size or (-1 if w8 else 128),
                      sym=(a.format != "awq") if a.sym is None else a.sym, desc_act=a.desc_act, clamp_zero=a.clamp_zero,
                      quantize_lm_head=a.quantize_lm_head, scale_dtype=parse_dtype(a.dtype),
                      float_dtype=parse_dtype(a.float_dtype), max_shard_size=parse_size(a.max_shard_size), **extra)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.convert", description=__doc__, formatter_class=_Help)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="float weights + params (or fake-quantized weights) -> quantized checkpoint",
                        formatter_class=_Help)
    _add_spec_args(ex)
    ex.add_argument("--params", default=None, help="safetensors/torch file with <layer>.scales [G,N], .zeros [G,N], "
                                                  ".g_idx [K] or .perm [K] (default: none; the weights must then be fake-quantized)")
    q = sub.add_parser("quantize", help="calibrate (rtn, gptq, awq, smoothquant) and export", formatter_class=_Help)
    _add_spec_args(q)
    q.add_argument("--method", default="gptq", choices=("rtn", "gptq", "awq", "smoothquant"), help="calibration method")
    q.add_argument("--static-groups", action="store_true",
                   help="GPTQ with --desc-act: keep groups in the original column order (trivial g_idx)")
    q.add_argument("--mse", action="store_true", help="GPTQ: search each group's clipping range (min |w - q(w)|^2.4)")
    q.add_argument("--drift-alpha", type=float, default=0.0,
                   help="GPTQ: fit the float model's layer outputs, not the quantized stream's (0 = off, 1 = full "
                        "least-squares correction for the drift of earlier quantized layers)")
    q.add_argument("--no-true-sequential", dest="true_sequential", action="store_false",
                   help="GPTQ: quantize q/k/v, o, gate/up, down of a block from the same inputs (default: sequentially)")
    q.add_argument("--calib", default=None,
                   help="calibration text: a .txt (or .tokens/.raw, optionally .gz) file, a .jsonl file (its 'text' "
                        "field), a .parquet file (its 'text' column; needs pyarrow), 'self' (sampled from the model "
                        "itself), or 'wikitext2' (../shared/data/wikitext2-valid.tokens beside the repository, where it "
                        "exists). Default: the packaged public-domain/CC0 text tools/convert/data/calib_default.txt.gz "
                        "(also 'default'; sources in ATTRIBUTION.md there)")
    q.add_argument("--num-samples", type=int, default=32, help="calibration windows")
    q.add_argument("--seq-len", type=int, default=256, help="tokens per calibration window")
    q.add_argument("--seed", type=int, default=0, help="seed of the window positions (and of --calib self)")
    q.add_argument("--damp", type=float, default=0.01, help="GPTQ damping, fraction of mean diag(H)")
    q.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    q.add_argument("--awq-clip", action="store_true", help="AWQ: also search per-group clipping ratios")
    q.add_argument("--awq-duo", action="store_true",
                   help="AWQ: search s = mean|x|^a / mean|w|^(1-a) (AutoAWQ's form) instead of the paper's mean|x|^a")
    q.add_argument("--awq-tokens", type=int, default=2048,
                   help="AWQ: calibration tokens (whole sequences) on which each candidate scale's error is measured")
    q.add_argument("--batch-size", type=int, default=8, help="calibration windows per forward pass")
    q.add_argument("--device", default="auto",
                   help="where calibration runs: auto (cuda when a GPU is visible, else cpu), cpu, cuda or cuda:N. The "
                        "float checkpoint is streamed: one decoder layer on the device at a time")
    q.add_argument("--offload-activations", action="store_true",
                   help="keep the calibration activations in CPU memory, each batch copied to the device for its "
                        "forward (less device memory, some transfer time)")
    q.add_argument("--kv-cache", default="none", choices=("none", "fp8"),
                   help="fp8: also calibrate per-layer KV-cache scales (max|k| / 448, max|v| / 448 over the calibration "
                        "windows, through the written checkpoint) and write them as compressed-tensors' kv_cache_scheme "
                        "+ self_attn.k_scale / v_scale (formats w8a8 and w4a16-ct); lqe and vLLM then run an fp8 KV "
                        "cache by default")
    acc = q.add_argument_group("accuracy methods (each off by default; see the README's ablation)")
    acc.add_argument("--rotate", default="none", choices=("none", "hadamard", "orthogonal"),
                     help="rotate the residual stream, absorbed into the weights (QuaRot/SpinQuant R1): norms folded "
                          "into the next linears, a tied LM head untied")
    acc.add_argument("--rotate-heads", action="store_true",
                     help="with --rotate: also rotate each attention head between v_proj and o_proj (SpinQuant R2)")
    acc.add_argument("--awq-scale", action="store_true",
                     help="GPTQ: fold AWQ's searched per-channel scales into each layer before GPTQ quantizes it")
    acc.add_argument("--refine-passes", type=int, default=0,
                     help="GPTQ: passes of coordinate descent over each layer's codes plus a closed-form refit of its "
                          "scales, on GPTQ's own objective (0 = off)")
    acc.add_argument("--tune-iters", type=int, default=0,
                     help="GPTQ: steps of block-output tuning per decoder layer: Adam on the group scales against the "
                          "layer's output error (0 = off)")
    acc.add_argument("--tune-lr", type=float, default=5e-3, help="learning rate of the scale multipliers (--tune-iters)")
    acc.add_argument("--tune-seqs", type=int, default=4, help="calibration windows per tuning step (--tune-iters)")
    acc.add_argument("--tune-rounding", action="store_true",
                     help="--tune-iters also moves codes by one step (AutoRound-style signed gradient on a rounding "
                          "offset; default: scales only)")
    v = sub.add_parser("verify", help="decode a GPTQ/AWQ/compressed-tensors checkpoint and check it", formatter_class=_Help)
    v.add_argument("dir", help="the quantized checkpoint directory")
    v.add_argument("--against", default=None, help="float (or fake-quantized) checkpoint to compare decoded weights with (default: "
                        "no comparison, only format checks)")
    v.add_argument("--max-error", type=float, default=None, help="fail when a layer's max abs error against --against exceeds this (default: no limit)")
    return ap


def _check_args(a: argparse.Namespace) -> None:
    """Everything that can be checked before a model is read; resolves --model / --against like LLM does."""
    from lqe.loaders.model_source import resolve_model

    if a.cmd == "quantize":
        from tools.convert.calib_data import check_calib_arg

        for name in ("num_samples", "seq_len", "batch_size"):
            if getattr(a, name) < 1:
                raise ConvertError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
        if a.seq_len < 2:
            raise ConvertError(f"--seq-len must be >= 2, got {a.seq_len}")
        if a.damp < 0:
            raise ConvertError(f"--damp must be >= 0, got {a.damp}")
        if a.method != "rtn" or a.kv_cache != "none":
            check_calib_arg(a.calib)
        if a.kv_cache != "none" and a.format not in ("w8a8", "w4a16-ct"):
            raise ConvertError(f"--kv-cache {a.kv_cache} writes compressed-tensors' kv_cache_scheme, which --format "
                               f"{a.format} has no place for: use --format w8a8 or w4a16-ct")
        from tools.convert.streaming import resolve_device

        resolve_device(a.device)  # a missing GPU is an error before any model is read
    if a.cmd in ("export", "quantize"):
        if a.group_size is not None and a.group_size != -1 and a.group_size < 1:
            raise ConvertError(f"--group-size must be -1 (per channel) or a positive size, got {a.group_size}")
        _spec(a)  # format / bits / dtype combinations
        if getattr(a, "params", None) and not os.path.isfile(a.params):
            raise ConvertError(f"--params file {a.params!r} does not exist")
        for attr in ("model",):
            try:
                setattr(a, attr, resolve_model(getattr(a, attr)))
            except FileNotFoundError as e:
                raise ConvertError(str(e)) from None
    if a.cmd == "verify" and a.against:
        try:
            a.against = resolve_model(a.against)
        except FileNotFoundError as e:
            raise ConvertError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    warnings.simplefilter("always")
    try:
        _check_args(a)
        if a.cmd == "export":
            from tools.convert.export import export_checkpoint

            r = export_checkpoint(a.model, a.out, params=a.params, overwrite=a.overwrite, spec=_spec(a))
            print(f"exported {len(r.layers)} layers to {r.out_dir} ({', '.join(r.files)})")
        elif a.cmd == "quantize":
            from tools.convert.quantize import CalibOptions, quantize_checkpoint

            spec = _spec(a, damp_percent=a.damp, static_groups=a.static_groups, true_sequential=a.true_sequential,
                         mse=a.mse, drift_alpha=a.drift_alpha)
            opts = CalibOptions(a.calib, a.num_samples, a.seq_len, a.seed, a.alpha, a.awq_clip, a.batch_size,
                                awq_duo=a.awq_duo, awq_tokens=a.awq_tokens, device=a.device,
                                offload_activations=a.offload_activations,
                                rotate=None if a.rotate == "none" else a.rotate, rotate_heads=a.rotate_heads,
                                awq_scale=a.awq_scale, refine_passes=a.refine_passes, tune_iters=a.tune_iters,
                                tune_lr=a.tune_lr, tune_seqs=a.tune_seqs, tune_rounding=a.tune_rounding,
                                kv_cache=None if a.kv_cache == "none" else a.kv_cache)
            r, res = quantize_checkpoint(a.model, a.out, a.method, spec, opts, a.overwrite)
            print(f"{a.method}: quantized {len(r.layers)} layers in {res.seconds:.1f} s -> {r.out_dir} ({', '.join(r.files)})")
        else:
            from tools.convert.verify import format_table, verify_checkpoint

            res = verify_checkpoint(a.dir, a.against)
            too_big = [c.name for c in res.layers if a.max_error is not None and c.max_err is not None and c.max_err > a.max_error]
            for c in res.layers:
                if c.name in too_big:
                    c.issues.append(f"max abs error {c.max_err:.3g} > --max-error {a.max_error}")
            print(format_table(res))
            return 0 if res.ok else 1
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
