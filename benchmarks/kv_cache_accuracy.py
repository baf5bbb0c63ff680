"""Perplexity by KV-cache storage through the engine (issue 29), every row in one run: the 16-bit cache, then
fp8 e4m3 / e5m2 with scales from the first prefill or calibrated, keys rotated (lqe's default) or plain (vLLM's).

    python benchmarks/kv_cache_accuracy.py --out benchmarks/results/kv-cache-smollm2-135m-instruct-cpu.json

Each row is ``benchmarks/accuracy.py --dtype bfloat16 --kv-cache-dtype ... --seq-len 1024 --max-windows 8`` with
its flags; the targets (e4m3 with scales <= +1 % ppl, e5m2 <= +3 %) are checked on the default (rotated) rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accuracy  # noqa: E402
from common import env_info  # noqa: E402

ROWS = (  # (kv_cache_dtype, key rotation, scales)
    ("auto", True, "prefill"),
    ("fp8_e4m3", True, "prefill"), ("fp8_e4m3", True, "calibrated"),
    ("fp8_e4m3", False, "prefill"), ("fp8_e4m3", False, "calibrated"),
    ("fp8_e5m2", True, "prefill"), ("fp8_e5m2", False, "prefill"),
)
TARGETS = {"fp8_e4m3": 0.01, "fp8_e5m2": 0.03}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--max-windows", type=int, default=8)
    p.add_argument("--dataset", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    common = ["--model", args.model, "--dtype", args.dtype, "--seq-len", str(args.seq_len),
              "--max-windows", str(args.max_windows)] + (["--dataset", args.dataset] if args.dataset else [])
    rows = []
    for kv, rot, scales in ROWS:
        r = accuracy.main(common + ["--kv-cache-dtype", kv, "--kv-scales", scales,
                                    "--kv-cache-key-rotation" if rot else "--no-kv-cache-key-rotation"])
        rows.append({"kv_cache_dtype": kv, "kv_cache_torch_dtype": r["kv_cache_torch_dtype"],
                     "kv_cache_key_rotation": r["kv_cache_key_rotation"], "kv_scales": r["kv_scales"],
                     "ppl": r["ppl"], "seconds": r["seconds"]})
    base = rows[0]["ppl"]
    for r in rows:
        r["ppl_increase_vs_16bit"] = r["ppl"] / base - 1
    targets = [{"target": f"{r['kv_cache_dtype']}, scales {r['kv_scales']}, keys rotated: ppl increase vs the 16-bit "
                          "cache", "goal": f"<= {TARGETS[r['kv_cache_dtype']]}", "value": r["ppl_increase_vs_16bit"],
                "met": r["ppl_increase_vs_16bit"] <= TARGETS[r["kv_cache_dtype"]]}
               for r in rows if r["kv_cache_key_rotation"]]
    res = {"issue": 29, "what": f"{args.model} WikiText-2 perplexity through the engine (prompt_logprobs), "
                                f"{args.dtype} weights and activations, by KV-cache storage",
           "command": "python benchmarks/kv_cache_accuracy.py", "settings": vars(args),
           "scales": {"prefill": "vLLM's rule on the first window: k_scale = max|k'| / 200 (k' the stored, rotated "
                                 "keys), v_scale = max|v| / 100, then fixed",
                      "calibrated": "what a calibrated checkpoint holds: max / 448 of the unrotated keys and values "
                                    "(llm-compressor's rule), over the first window"},
           "rows": rows, "targets": targets, "env": env_info()}
    for r in rows:
        print(f"{r['kv_cache_dtype']:9s} rotation={str(r['kv_cache_key_rotation']):5s} scales={r['kv_scales']}: "
              f"ppl {r['ppl']:.4f} ({100 * r['ppl_increase_vs_16bit']:+.2f} %)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
