"""Accuracy next to speed for every quantization variant of one model: a JSON file, a Markdown table and a PNG.

    python benchmarks/accuracy_vs_throughput.py --model smollm2-135m-instruct --max-windows 8 --seq-len 1024

Each variant except ``float`` is built by ``python -m tools.convert quantize ...`` into ``--cache`` (reused when
it was built with the same command). Accuracy: perplexity on the dataset's first windows, and the KL divergence
KL(float || variant) and top-1 agreement of the next-token distributions at every scored position, all from one
pass of full ``[L, vocab]`` distributions through each engine's ModelRunner (``lqe.eval.window_logprobs``; the
perplexity equals the ``prompt_logprobs`` one of benchmarks/accuracy.py, tests/test_benchmarks.py checks it).
Speed: batch-1 decode tokens/s and weight GB/s (benchmarks/latency.py) and offline throughput on a small fixed
workload (benchmarks/throughput.py ``run_lqe``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# WikiText-2 validation split beside the repository: the README rows were calibrated on it
SHARED_CALIB = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "wikitext2-valid.tokens"))
sys.path.insert(0, HERE)
from common import env_info, random_lengths, random_prompts  # noqa: E402

# name -> (method, format, bits, group_size, sym, desc_act, extra tools.convert flags); None = the float checkpoint.
# GPTQ sym runs act-order with static groups (columns quantized in decreasing diag(H) order, groups fixed on the
# original order: g_idx stays trivial, so the checkpoint is as fast as plain GPTQ), plus the clipping search and
# the drift-corrected target; AWQ searches scales on the attention / MLP outputs and clipping ratios.
ROT_SYM = ("--static-groups", "--mse", "--drift-alpha", "0.25", "--rotate", "hadamard")
ROT_ASYM = ("--mse", "--drift-alpha", "0.25", "--rotate", "hadamard", "--rotate-heads", "--refine-passes", "2")
BIG_CALIB = ("--num-samples", "64", "--seq-len", "512")
VARIANTS: dict[str, tuple | None] = {
    "float": None,
    "rtn-w4g128-sym": ("rtn", "gptq", 4, 128, True, False, ()),
    "rtn-w4g128-asym": ("rtn", "gptq", 4, 128, False, False, ()),
    "gptq-w4g128-sym": ("gptq", "gptq", 4, 128, True, True, ("--static-groups", "--mse", "--drift-alpha", "0.25")),
    "gptq-w4g128-asym-actorder": ("gptq", "gptq", 4, 128, False, True, ("--mse", "--drift-alpha", "0.25")),
    "rtn-w4g64-asym": ("rtn", "gptq", 4, 64, False, False, ()),
    "awq-w4g64": ("awq", "awq", 4, 64, False, False, ("--awq-clip", "--awq-tokens", "4096")),
    "w8a16": ("rtn", "gptq", 8, -1, True, False, ()),
    "w8a8-smoothquant": ("smoothquant", "w8a8", 8, -1, True, False, ()),
    "fp8-w8a8": ("rtn", "fp8", 8, -1, True, False, ()),  # Hopper only, and only when tools.convert writes fp8
    # the accuracy recipes (issue 18): a Hadamard rotation of the residual stream folded into the weights, and
    # 64 x 512 calibration tokens (128 x 512 for g128 asym); asym adds the per-head rotation and two passes of code
    # refinement
    "gptq-w4g128-sym-rot": ("gptq", "gptq", 4, 128, True, True, ROT_SYM + BIG_CALIB),
    "gptq-w4g128-asym-rot": ("gptq", "gptq", 4, 128, False, True, ROT_ASYM + ("--num-samples", "128", "--seq-len", "512")),
    "gptq-w4g64-asym-rot": ("gptq", "gptq", 4, 64, False, True, ROT_ASYM + BIG_CALIB),
    # fp8 KV cache (issue 29): the float weights with kv_cache_dtype (scales from the first prefill, vLLM's rule), and
    # W8A8 with scales calibrated by tools.convert --kv-cache fp8 (its kv_cache_scheme turns the cache fp8 on 'auto')
    "float-kv-fp8-e4m3": None,
    "float-kv-fp8-e5m2": None,
    "w8a8-smoothquant-kv-fp8": ("smoothquant", "w8a8", 8, -1, True, False, ("--kv-cache", "fp8")),
}
KV_CACHE_DTYPE = {"float-kv-fp8-e4m3": "fp8_e4m3", "float-kv-fp8-e5m2": "fp8_e5m2"}  # others: auto
RECIPES = [n for n in VARIANTS if n.endswith("-rot")]  # not in the default set: each takes minutes to calibrate


def default_variants() -> list[str]:
    names = [n for n in VARIANTS if n != "fp8-w8a8" and n not in RECIPES]
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        names.append("fp8-w8a8")
    return names


def model_name(model: str, model_dir: str) -> str:
    from lqe.loaders.model_source import DEMO_MODEL

    if model.lower() == DEMO_MODEL or os.path.basename(os.path.normpath(model_dir)) == DEMO_MODEL:
        return DEMO_MODEL
    return os.path.basename(os.path.normpath(model_dir))


def device_name() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-")


def convert_command(model_dir: str, out: str, spec: tuple, args) -> list[str]:
    method, fmt, bits, group, sym, desc_act, extra = spec
    cmd = [sys.executable, "-m", "tools.convert", "quantize", "--model", model_dir, "--out", out, "--method", method,
           "--format", fmt, "--bits", str(bits), "--group-size", str(group), "--sym" if sym else "--asym"]
    if desc_act:
        cmd.append("--desc-act")
    cmd += list(extra)
    if method != "rtn":
        if "--num-samples" not in extra:  # a variant may name its own calibration size
            cmd += ["--num-samples", str(args.calib_samples)]
        if "--seq-len" not in extra:
            cmd += ["--seq-len", str(args.calib_seq_len)]
        cmd += ["--seed", str(args.seed)]
        if args.calib:
            cmd += ["--calib", args.calib]
    return cmd


CALIB_LINE = re.compile(r"quantized \d+ layers in ([0-9.]+) s")


def build_variant(name: str, model_dir: str, args) -> tuple[str, float | None, list[str] | None, float | None]:
    """The checkpoint directory of ``name`` (built unless the cache holds one made by the same command), the
    convert command's wall time when it ran now, the command, and its calibration seconds (what ``tools.convert``
    reports, kept beside the cached checkpoint)."""
    spec = VARIANTS[name]
    if spec is None:
        return model_dir, None, None, None
    if spec[1] not in _convert_formats():
        raise RuntimeError(f"tools.convert cannot write format {spec[1]!r}")
    out = os.path.join(args.cache, name)
    cmd = convert_command(model_dir, out, spec, args)
    stamp, timing = out + ".cmd.json", out + ".calib.json"
    if os.path.isfile(os.path.join(out, "config.json")) and os.path.isfile(stamp):
        with open(stamp) as f:
            if json.load(f) == cmd[1:]:
                calib_s = None
                if os.path.isfile(timing):
                    with open(timing) as f:
                        calib_s = json.load(f).get("calib_s")
                return out, None, cmd, calib_s
    os.makedirs(args.cache, exist_ok=True)
    t = time.perf_counter()
    r = subprocess.run(cmd + ["--overwrite"], cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    wall = time.perf_counter() - t
    m = CALIB_LINE.search(r.stdout)
    calib_s = float(m.group(1)) if m else None
    with open(stamp, "w") as f:
        json.dump(cmd[1:], f)
    with open(timing, "w") as f:
        json.dump({"calib_s": calib_s, "convert_s": wall}, f)
    return out, wall, cmd, calib_s


def _convert_formats() -> tuple[str, ...]:
    try:
        from tools.convert.spec import FORMATS
    except ImportError:
        return ()
    return FORMATS


def measure_variant(name: str, ckpt: str, windows, ref, args) -> dict:
    from lqe import LLM
    from lqe.eval import compare, window_logprobs
    from latency import measure
    from throughput import run_lqe

    kv = KV_CACHE_DTYPE.get(name, "auto")
    llm = LLM(ckpt, dtype=args.dtype, max_model_len=max(args.seq_len, 256), kv_cache_memory_bytes=256 << 20,
              kv_cache_dtype=kv)
    eng = llm.llm_engine
    t = time.perf_counter()
    if name == "float":  # the reference itself: its distributions are kept for the other variants
        ref.extend(window_logprobs(eng, w)[:-1] for w in windows)
    acc = compare(None if name == "float" else eng, ref, windows)
    acc_s = time.perf_counter() - t
    lat = measure(llm, 1, args.latency_prompt_len, args.latency_gen_len, reps=1, seed=args.seed)
    row = {"name": name, "quantization": eng.quant_description() or "none", "dtype": str(eng.dtype).removeprefix("torch."),
           "ppl": acc.ppl, "kl": acc.kl, "top1_agree": acc.top1_agree, "tokens": acc.tokens,
           "decode_tok_s": lat["decode_tok_s"], "ttft_s": lat["ttft_s"], "weight_gb_s": lat["weight_gb_s"],
           "weight_bytes": lat["weight_bytes"], "accuracy_s": acc_s,
           "kv_cache": str(eng.runner.kv_cache.dtype).removeprefix("torch.")}
    del llm, eng
    gc.collect()
    tp = argparse.Namespace(model=ckpt, quantization=None, dtype=args.dtype, max_num_seqs=64, max_model_len=512,
                            max_num_batched_tokens=2048, kv_cache_dtype=kv)
    prompts = random_prompts(args.tp_prompts, *args.tp_input_len, vocab=_vocab(ckpt), seed=args.seed)
    out_lens = random_lengths(args.tp_prompts, *args.tp_output_len, seed=args.seed)
    secs, n = run_lqe(tp, prompts, out_lens)
    row["throughput_tok_s"] = n / secs
    gc.collect()
    return row


def _vocab(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def write_outputs(res: dict, base: str) -> None:
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=2)
    with open(base + ".md", "w") as f:
        f.write(markdown(res))
    plot(res, base + ".png")


def markdown(res: dict) -> str:
    e, s = res["env"], res["settings"]
    rows = [v for v in res["variants"] if "ppl" in v]
    fl = next((v for v in rows if v["name"] == "float"), None)
    out = [f"## {res['model']} on {res['device']}: accuracy vs throughput", "",
           f"Perplexity on `{os.path.basename(s['dataset'])}` ({s['windows']} windows x {s['seq_len']} tokens, "
           f"{s['tokens']} scored tokens); KL(float || variant) in nats/token and top-1 agreement with float on the same "
           f"positions. Decode: batch 1, {s['latency_prompt_len']}-token prompt, {s['latency_gen_len']} tokens. "
           f"Throughput: {s['tp_prompts']} prompts of {s['tp_input_len'][0]}-{s['tp_input_len'][1]} tokens, "
           f"{s['tp_output_len'][0]}-{s['tp_output_len'][1]} output tokens. Calibration: {s['calib_samples']} x "
           f"{s['calib_seq_len']} tokens of `{os.path.basename(s['calib'] or 'calib_default.txt.gz')}`, seed {s['seed']}.",
           "", "| variant | format | bits | group | KV cache | ppl | Δppl | KL | top-1 | decode tok/s | GB/s | throughput tok/s "
               "| weights MiB | calib s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in rows:
        d = f"{(v['ppl'] / fl['ppl'] - 1) * 100:+.1f}%" if fl else ""
        g = {None: "–", -1: "channel"}.get(v["group_size"], v["group_size"])
        mark = " †" if v.get("earlier_run") else ""
        out.append(f"| {v['name']}{mark} | {v['format']} | {v['bits']} | {g} | {v.get('kv_cache', v['dtype'])} "
                   f"| {v['ppl']:.2f} | {d} | {v['kl']:.4f} "
                   f"| {v['top1_agree'] * 100:.1f}% | {v['decode_tok_s']:.1f} | {v['weight_gb_s']:.2f} | "
                   f"{v['throughput_tok_s']:.1f} | {v['weight_bytes'] / 2**20:.1f} | {_calib(v)} |")
    earlier = sorted({v["earlier_run"] for v in rows if v.get("earlier_run")})
    if earlier:
        out += ["", f"† measured in an earlier run (lqe {', '.join(earlier)}) on the same windows; its speed columns "
                    "are from that run."]
    recipes = [(v["name"], recipe(v["convert_cmd"])) for v in rows if v.get("convert_cmd")]
    if recipes:
        out += ["", "Variants are built with `python -m tools.convert quantize --model MODEL --out DIR` plus:", ""]
        out += [f"- `{n}`: `{r}`" for n, r in recipes]
    for v in res["variants"]:
        if "skipped" in v:
            out.append(f"\n{v['name']}: skipped ({v['skipped']})")
    if res.get("targets"):
        out += ["", "| target | value | goal | met |", "|---|---|---|---|"]
        out += [f"| {t['target']} | {t['value']:.3f} | {t['goal']} | {'yes' if t['met'] else 'no'} |" for t in res["targets"]]
    out += ["", f"{e['cpu']} ({e['cpu_count']} CPUs, {e['torch_threads']} torch threads), GPU {e['gpu']}, torch {e['torch']}, "
                f"CUDA {e['cuda']}, python {e['python']}, lqe {e['lqe_commit']}; model `{res['model']}`; matrix run "
                f"{res['seconds']:.0f} s.", ""]
    return "\n".join(out)


def _earlier_rows(path: str, names: list[str], settings: dict) -> list[dict]:
    """Rows of an earlier results file for the variants not in ``names`` (same dataset, windows and seed only), each
    marked with the lqe commit of the run that measured it."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        old = json.load(f)
    same = all(old.get("settings", {}).get(k) == settings[k] for k in ("dataset", "seq_len", "seed", "windows"))
    if not same:
        raise SystemExit(f"--merge: {path} was measured with other settings; run without --merge")
    commit = old.get("env", {}).get("lqe_commit")
    return [{**v, "earlier_run": v.get("earlier_run") or commit} for v in old.get("variants", [])
            if v["name"] not in names and "ppl" in v]


def _calib(v: dict) -> str:
    """Calibration seconds of a row, as ``tools.convert`` reported them ("–" for float, "?" when not recorded)."""
    if v.get("method") is None:
        return "–"
    return "?" if v.get("calib_s") is None else f"{v['calib_s']:.0f}"


def recipe(cmd: str) -> str:
    """The flags of a recorded convert command (``-m tools.convert quantize ...``) without the model and output
    paths; other paths shortened to their file name."""
    out, skip = [], False
    for w in cmd.split():
        if skip:
            skip = False
        elif w in ("--model", "--out"):
            skip = True
        elif w not in ("-m", "tools.convert", "quantize"):
            out.append(os.path.basename(w) if "/" in w else w)
    return " ".join(out)


def targets(rows: list[dict]) -> list[dict]:
    by = {v["name"]: v["ppl"] for v in rows if "ppl" in v}
    out = []
    def closed(method: str, base: str, goal: float, label: str) -> None:
        if {"float", method, base} <= by.keys() and by[base] != by["float"]:
            f = (by[base] - by[method]) / (by[base] - by["float"])
            out.append({"target": label, "value": f, "goal": f">= {goal}", "met": f >= goal})
    closed("gptq-w4g128-sym", "rtn-w4g128-sym", 0.5, "GPTQ W4 g128 sym: fraction of RTN sym gap closed")
    closed("gptq-w4g128-asym-actorder", "rtn-w4g128-asym", 0.5, "GPTQ W4 g128 asym act-order: fraction of RTN asym gap closed")
    closed("awq-w4g64", "rtn-w4g64-asym", 0.4, "AWQ W4 g64: fraction of RTN W4 g64 asym gap closed")
    for name, goal in (("gptq-w4g128-sym-rot", 0.135), ("gptq-w4g128-asym-rot", 0.084), ("gptq-w4g64-asym-rot", 0.084)):
        if {"float", name} <= by.keys():  # issue 18: ppl <= 33.5 (sym) and <= 32.0 against SmolLM2's 29.51
            r = by[name] / by["float"] - 1
            out.append({"target": f"{name}: ppl increase over float", "value": r, "goal": f"<= {goal}", "met": r <= goal})
    for name, goal in (("float-kv-fp8-e4m3", 0.01), ("float-kv-fp8-e5m2", 0.03)):  # issue 29
        if {"float", name} <= by.keys():
            r = by[name] / by["float"] - 1
            out.append({"target": f"{name}: ppl increase over the model-dtype cache", "value": r, "goal": f"<= {goal}",
                        "met": r <= goal})
    if {"float", "w8a8-smoothquant"} <= by.keys():
        r = by["w8a8-smoothquant"] / by["float"] - 1
        out.append({"target": "W8A8 SmoothQuant: ppl increase over float", "value": r, "goal": "<= 0.02", "met": r <= 0.02})
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [v for v in res["variants"] if "ppl" in v]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in rows:
        ax.scatter(v["throughput_tok_s"], v["ppl"], s=30)
        ax.annotate(v["name"], (v["throughput_tok_s"], v["ppl"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("throughput, output tokens/s")
    ax.set_ylabel(f"perplexity ({res['settings']['windows']} x {res['settings']['seq_len']} tokens)")
    ax.set_title(f"{res['model']} on {res['device']}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--variants", default=None, help=f"comma-separated; default: {','.join(default_variants())}; "
                   f"the accuracy recipes ({','.join(RECIPES)}) run when named, or all of them with 'recipes'")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for <model>-<device>.json/.md/.png")
    p.add_argument("--dataset", default=None, help="text file (default ../shared/data/wikitext2-test.raw)")
    p.add_argument("--max-windows", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--cache", default=None, help="converted checkpoints (default $LQE_CACHE_DIR/bench/<model>)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--calib", default=None,
                   help="calibration text for tools.convert (default: ../shared/data/wikitext2-valid.tokens where it "
                        "exists, as the README rows used; else tools.convert's packaged default text)")
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--latency-prompt-len", type=int, default=32)
    p.add_argument("--latency-gen-len", type=int, default=32)
    p.add_argument("--tp-prompts", type=int, default=8)
    p.add_argument("--tp-input-len", type=int, nargs=2, default=[32, 96])
    p.add_argument("--tp-output-len", type=int, nargs=2, default=[32, 64])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of the existing results file for variants not run now (marked as earlier runs; "
                        "the float row is always measured again, as every KL is against it)")
    args = p.parse_args(argv)
    if args.calib is None and os.path.isfile(SHARED_CALIB):
        args.calib = SHARED_CALIB  # explicit: tools.convert's own default is its packaged text
    from lqe.eval import DEFAULT_DATASET, load_windows
    from lqe.loaders.model_source import cache_dir, resolve_model
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    model_dir = resolve_model(args.model)
    name = model_name(args.model, model_dir)
    args.cache = args.cache or os.path.join(cache_dir(), "bench", name)
    args.dataset = args.dataset or DEFAULT_DATASET
    names = [v for v in (args.variants.split(",") if args.variants else default_variants()) if v]
    names = [r for v in names for r in (RECIPES if v == "recipes" else [v])]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    names = ["float"] + [v for v in names if v != "float"]  # float first: it is everyone's reference
    windows = load_windows(AutoTokenizer.from_pretrained(model_dir), args.dataset, args.seq_len, args.max_windows)
    settings = {k: getattr(args, k) for k in ("dataset", "seq_len", "seed", "calib", "calib_samples", "calib_seq_len",
                                              "latency_prompt_len", "latency_gen_len", "tp_prompts", "tp_input_len",
                                              "tp_output_len", "dtype")}
    settings.update(windows=len(windows), tokens=sum(len(w) - 1 for w in windows))
    res = {"model": name, "model_dir": model_dir, "device": device_name(), "env": env_info(), "settings": settings,
           "variants": [], "targets": [], "seconds": 0.0}
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"{name}-{res['device']}")
    kept = _earlier_rows(base + ".json", names, res["settings"]) if args.merge else []
    ref: list[torch.Tensor] = []
    for v in names:
        spec = VARIANTS[v]
        meta = {"name": v, "format": spec[1] if spec else "float", "bits": spec[2] if spec else None,
                "group_size": spec[3] if spec else None, "method": spec[0] if spec else None,
                "seq_len": args.seq_len, "windows": len(windows), "seed": args.seed}
        try:
            ckpt, conv_s, cmd, calib_s = build_variant(v, model_dir, args)
        except RuntimeError as e:
            print(f"{v}: skipped: {e}", file=sys.stderr)
            res["variants"].append({**meta, "skipped": str(e).splitlines()[0]})
            continue
        row = {**meta, "convert_s": conv_s, "calib_s": calib_s, "convert_cmd": " ".join(cmd[1:]) if cmd else None,
               **measure_variant(v, ckpt, windows, ref, args)}
        if row["bits"] is None:
            row["bits"] = {"float32": 32, "bfloat16": 16, "float16": 16}[row["dtype"]]
        res["variants"].append(row)
        if v == "float":
            res["variants"] += kept
        print(f"{v:28s} ppl {row['ppl']:8.3f}  kl {row['kl']:.4f}  top1 {row['top1_agree']:.3f}  decode "
              f"{row['decode_tok_s']:6.1f} tok/s  throughput {row['throughput_tok_s']:6.1f} tok/s", flush=True)
        res["targets"], res["seconds"] = targets(res["variants"]), time.perf_counter() - t0
        write_outputs(res, base)
    res["seconds"] = time.perf_counter() - t0
    write_outputs(res, base)
    print(f"wrote {base}.json/.md/.png in {res['seconds']:.0f} s")
    return res


if __name__ == "__main__":
    main()
