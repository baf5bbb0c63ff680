"""Decode latency: time to first token, decode tokens/s at batch 1 and batch N, and achieved weight GB/s.

    python benchmarks/latency.py --model smollm2-135m-instruct --batch-sizes 1,8 --prompt-len 64 --gen-len 64

Each batch of ``B`` random prompts of ``--prompt-len`` tokens is prefilled in one step (the first token of every
request), then decoded greedily for ``--gen-len - 1`` steps (``ignore_eos``). TTFT is the time from adding the
requests to the step that gave every request its first token; decode tokens/s is ``B * (gen_len - 1)`` over the
decode steps' time. Achieved GB/s = weight bytes (``runner.weight_bytes()``: every weight is read once per decode
step) / mean decode step time: the memory-bound floor of a decode step is weight bytes / memory bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import env_info, random_prompts  # noqa: E402


def measure(llm, batch_size: int, prompt_len: int, gen_len: int, reps: int = 3, seed: int = 0) -> dict:
    """Median over ``reps`` of TTFT, decode tokens/s, decode step time and weight GB/s for one batch size."""
    from lqe import SamplingParams

    engine = llm.llm_engine
    if engine.has_unfinished():
        raise RuntimeError("the engine has unfinished requests; measure latency on an idle engine")
    if gen_len < 2:
        raise ValueError(f"gen_len={gen_len} must be >= 2 (one prefill token, then decode steps)")
    vocab = engine.model_config.vocab_size
    prompts = random_prompts(batch_size, prompt_len, prompt_len, vocab=vocab, seed=seed)
    params = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    wbytes = engine.runner.weight_bytes()
    ttfts, steps_s = [], []
    for rep in range(reps):
        ids = [f"latency-{rep}-{i}" for i in range(batch_size)]
        # prompts differ per rep so that the prefix cache cannot serve a repeated prefill
        for rid, p in zip(ids, random_prompts(batch_size, prompt_len, prompt_len, vocab=vocab, seed=seed + rep)):
            engine.add_request(rid, p, params)
        t0 = time.perf_counter()
        t_first, n_steps, have_first = None, 0, set()
        while engine.has_unfinished():
            outs = engine.step()
            if t_first is None:
                have_first.update(o.request_id for o in outs if o.outputs[0].token_ids)
                if len(have_first) == batch_size:
                    t_first = time.perf_counter()
            else:
                n_steps += 1
        t_end = time.perf_counter()
        ttfts.append(t_first - t0)
        steps_s.append((t_end - t_first) / max(1, n_steps))
    step = statistics.median(steps_s)
    return {"batch_size": batch_size, "prompt_len": prompt_len, "gen_len": gen_len, "reps": reps,
            "ttft_s": statistics.median(ttfts), "decode_step_s": step, "decode_tok_s": batch_size / step,
            "weight_bytes": wbytes, "weight_gb_s": wbytes / step / 1e9}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quantization", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    from lqe import LLM

    torch.manual_seed(args.seed)
    sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    llm = LLM(args.model, quantization=args.quantization, dtype=args.dtype, max_num_seqs=max(sizes),
              max_model_len=args.prompt_len + args.gen_len + 1,
              max_num_batched_tokens=max(2048, max(sizes) * args.prompt_len))
    eng = llm.llm_engine
    res = {"env": env_info(), "model": args.model, "quantization": eng.quant_description() or "none",
           "dtype": str(eng.dtype).removeprefix("torch."), "device": str(eng.device), "seed": args.seed, "results": []}
    print(f"{args.model} ({res['quantization']}, {res['dtype']}, {res['device']}), weights "
          f"{eng.runner.weight_bytes() / 2**20:.1f} MiB")
    print(f"{'batch':>5} {'TTFT ms':>9} {'step ms':>9} {'decode tok/s':>13} {'weight GB/s':>12}")
    for b in sizes:
        r = measure(llm, b, args.prompt_len, args.gen_len, args.reps, args.seed)
        res["results"].append(r)
        print(f"{b:>5} {r['ttft_s'] * 1e3:9.1f} {r['decode_step_s'] * 1e3:9.2f} {r['decode_tok_s']:13.1f} "
              f"{r['weight_gb_s']:12.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
