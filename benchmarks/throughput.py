"""Offline throughput: N random prompts through lqe, and the same workload through HF ``generate``.

    python benchmarks/throughput.py --model smollm2-135m-instruct --num-prompts 32

Prompts are random token ids with seeded random lengths; every request generates exactly its output length
(``ignore_eos``). HF runs the workload in padded batches of ``--hf-batch-size`` (left padding, greedy); a batch
runs until its longest request is done, which is what padded batching costs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import env_info, random_lengths, random_prompts  # noqa: E402


def run_lqe(args, prompts, out_lens) -> tuple[float, int]:
    from lqe import LLM, SamplingParams

    llm = LLM(args.model, quantization=args.quantization, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_hf(args, prompts, out_lens) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    from lqe.loaders.model_source import resolve_model

    model_dir = resolve_model(args.model)
    dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    total, t = 0, time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch_size):
        batch, lens = prompts[i:i + args.hf_batch_size], out_lens[i:i + args.hf_batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                           do_sample=False, pad_token_id=pad)
        total += sum(lens)  # useful tokens only: the padding tail of shorter requests is waste
    return time.perf_counter() - t, total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quantization", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    prompts = random_prompts(args.num_prompts, *args.input_len, vocab=49152, seed=args.seed)
    out_lens = random_lengths(args.num_prompts, *args.output_len, seed=args.seed)
    res = {"env": env_info(), "model": args.model, "num_prompts": args.num_prompts, "input_len": args.input_len,
           "output_len": args.output_len, "seed": args.seed}
    t, n = run_lqe(args, prompts, out_lens)
    res["lqe"] = {"seconds": t, "requests_s": args.num_prompts / t, "output_tok_s": n / t}
    print(f"lqe : {t:7.2f} s  {args.num_prompts / t:6.2f} req/s  {n / t:8.1f} output tok/s")
    if not args.skip_hf:
        th, nh = run_hf(args, prompts, out_lens)
        res["hf"] = {"seconds": th, "requests_s": args.num_prompts / th, "output_tok_s": nh / th,
                     "batch_size": args.hf_batch_size}
        res["speedup"] = th / t
        print(f"HF  : {th:7.2f} s  {args.num_prompts / th:6.2f} req/s  {nh / th:8.1f} output tok/s")
        print(f"lqe / HF throughput: {th / t:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
