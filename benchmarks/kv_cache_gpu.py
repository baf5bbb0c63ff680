"""fp8 vs bf16 KV cache on one GPU, same run (issue 29): decode speed at long contexts and capacity.

    python benchmarks/kv_cache_gpu.py --out benchmarks/results/kvcache-<gpu>.json

On a random-weight checkpoint of a real model's shape (default llama3-8b, bf16 weights, written once into
``--cache``), for ``kv_cache_dtype`` = auto (bf16), fp8 (e4m3, scales from the first prefill, keys rotated: the
default) and fp8-plain (the same without key rotation: what the rotation's two small matmuls per layer cost):

* decode: ``--batch`` prompts of ``--context`` random tokens prefilled together, then ``--new-tokens`` tokens each;
  decode tokens/s counts the tokens after each request's first, from the last first token to the end (every
  sequence decodes together over ~``--context`` cached tokens). Beside it, the bytes one decode step must read
  (weights + every sequence's K/V at the mean context) and the floor time at ``--hbm-gbs``.
* capacity at a fixed ``--gpu-memory-utilization``: the allocator's blocks, and how many sequences of
  ``context + new_tokens`` tokens fit at once.

Prints the fp8 / bf16 ratios (targets: >= 1.4x decode tok/s, >= 1.9x concurrent sequences).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_gpu import SHAPES, build_random_model, environment  # noqa: E402


def _free_gpu() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


VARIANTS = {"auto": ("auto", True), "fp8": ("fp8", True), "fp8-plain": ("fp8", False)}  # name -> (dtype, rotation)


def run(model_dir: Path, variant: str, args) -> dict:
    from lqe import LLM, SamplingParams

    t0 = time.perf_counter()
    max_len = args.context + args.new_tokens
    kv, rotation = VARIANTS[variant]
    llm = LLM(str(model_dir), dtype="bfloat16", kv_cache_dtype=kv, kv_cache_key_rotation=rotation,
              max_model_len=max_len, max_num_seqs=args.batch,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
              gpu_memory_utilization=args.gpu_memory_utilization, max_cudagraph_batch=args.batch, seed=0)
    eng = llm.llm_engine
    r = eng.runner
    row = {"variant": variant, "kv_cache_dtype": kv, "kv_cache_key_rotation": rotation and kv != "auto",
           "kv_torch_dtype": str(r.kv_cache.dtype).removeprefix("torch."),
           "attention_backend": r.attention_backend, "load_s": round(time.perf_counter() - t0, 1),
           "num_blocks": r.num_blocks, "block_size": r.block_size, "kv_bytes_per_token": r.kv_spec.bytes_per_block() // r.block_size,
           "kv_cache_gib": r.kv_cache.numel() * r.kv_cache.element_size() / 2**30,
           "concurrent_seqs": r.num_blocks // -(-max_len // r.block_size), "cuda_graphs": r.graph_runner is not None}
    vocab = eng.model_config.vocab_size
    rng = random.Random(args.seed)
    llm.generate([[rng.randrange(2, vocab) for _ in range(64)]] * 2,
                 SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False)  # warm-up
    prompts = [[rng.randrange(2, vocab) for _ in range(args.context)] for _ in range(args.batch)]
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, temperature=0),
                        use_tqdm=False)
    torch.cuda.synchronize()
    end = time.monotonic()
    firsts = [o.metrics.first_token_time for o in outs]
    decoded = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    row["decode_s"] = end - max(firsts)
    row["decode_tok_s"] = decoded / row["decode_s"]
    row["prefill_and_decode_s"] = time.perf_counter() - t
    weights = r.weight_bytes()
    kv_read = args.batch * (args.context + args.new_tokens / 2) * row["kv_bytes_per_token"]
    step_ms = 1e3 * args.batch / row["decode_tok_s"]
    row.update(weight_bytes=weights, kv_bytes_per_step=kv_read, step_ms=step_ms,
               floor_ms=1e3 * (weights + kv_read) / (args.hbm_gbs * 1e9),
               achieved_gbs=(weights + kv_read) / (step_ms / 1e3) / 1e9)
    print(f"{variant:9s} [{row['kv_torch_dtype']}, {row['attention_backend']}] decode {row['decode_tok_s']:8.1f} tok/s "
          f"(step {step_ms:.2f} ms, floor {row['floor_ms']:.2f} ms at {args.hbm_gbs:.0f} GB/s, "
          f"{row['achieved_gbs']:.0f} GB/s); {row['num_blocks']} blocks = {row['concurrent_seqs']} sequences of "
          f"{max_len} tokens ({row['kv_cache_gib']:.1f} GiB)", flush=True)
    llm.shutdown()
    del llm, eng, r, outs
    _free_gpu()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--cache", default=os.path.join(os.environ.get("LQE_CACHE_DIR", "/tmp"), "lqe-bench-models"))
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--hbm-gbs", type=float, default=3350.0, help="memory bandwidth for the floor (H100 SXM: 3350)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="auto,fp8,fp8-plain", help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--out", default=None, help="JSON results file")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    if not {"auto", "fp8"} <= set(variants) or not set(variants) <= set(VARIANTS):
        p.error(f"--variants {args.variants!r}: give auto and fp8 (the ratios' two sides), optionally fp8-plain")
    if not torch.cuda.is_available():
        print("kv_cache_gpu: no CUDA GPU visible", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    model_dir = build_random_model(args.shape, Path(args.cache) / f"{args.shape}-bf16", args.seed)
    res = {"shape": args.shape, "settings": {k: v for k, v in vars(args).items() if k not in ("out", "cache")},
           "env": environment(), "variants": {}}
    for v in variants:
        res["variants"][v] = run(model_dir, v, args)
    b, f = res["variants"]["auto"], res["variants"]["fp8"]
    res["ratios"] = {"decode_tok_s": f["decode_tok_s"] / b["decode_tok_s"],
                     "blocks": f["num_blocks"] / b["num_blocks"],
                     "concurrent_seqs": f["concurrent_seqs"] / max(1, b["concurrent_seqs"])}
    if "fp8-plain" in res["variants"]:  # the key rotation's cost: >= 0.97 expected (two [T*H, D] x [D, D] matmuls)
        res["ratios"]["decode_tok_s_rotated_vs_plain"] = f["decode_tok_s"] / res["variants"]["fp8-plain"]["decode_tok_s"]
    res["targets"] = [
        {"target": "decode tok/s, fp8 / bf16 KV", "value": res["ratios"]["decode_tok_s"], "goal": ">= 1.4",
         "met": res["ratios"]["decode_tok_s"] >= 1.4},
        {"target": "concurrent sequences at fixed gpu_memory_utilization, fp8 / bf16", "goal": ">= 1.9",
         "value": res["ratios"]["concurrent_seqs"], "met": res["ratios"]["concurrent_seqs"] >= 1.9},
    ]
    res["seconds"] = time.perf_counter() - t0
    for t in res["targets"]:
        print(f"{t['target']}: {t['value']:.2f}x (goal {t['goal']}: {'met' if t['met'] else 'NOT met'})")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
