"""fp8 vs bf16 KV cache on one GPU, same run (issue 29): steady decode at long contexts, and capacity.

    python benchmarks/kv_cache_gpu.py --out benchmarks/results/kvcache-<gpu>.json

On e2e_gpu.py's random-weight checkpoint of a real model's shape (default llama3-8b, bf16 weights: the same
``$LQE_BENCH_DIR/<shape>/bf16`` copy, built by ``e2e_gpu.build_random_model`` when missing, so the two scripts share
one 16 GB build), for ``kv_cache_dtype`` = auto (bf16), fp8 (e4m3, scales from the first prefill, keys rotated: the
default) and fp8-plain (the same without key rotation: what the rotation's two small matmuls per layer cost);
``fp8-e5m2`` on request:

* decode: ``--batch`` requests of ``--context`` random tokens are added at once and the engine is stepped until
  every one has its first token (the scheduler serves decodes first and fills the rest of the token budget with
  prefill chunks, so the early requests already decode while the late ones prefill: none of that is timed). Then
  ``--warmup-steps`` untimed steps, a ``torch.cuda.synchronize``, and ``--decode-steps`` (K) engine steps are timed,
  each of them exactly ``--batch`` sequences decoding one token (checked: every step returns ``--batch`` outputs,
  every request gains exactly K tokens, no prompt token and no preemption in the window; ``max_tokens`` leaves room
  so none finishes inside it, ``ignore_eos``). ``decode_tok_s`` = batch x K / seconds, ``step_ms`` = seconds / K.
  Beside it the bytes one step reads (the decode weights, embedding table excluded when untied, plus every
  sequence's K/V at its context in the window, averaged over the K steps) and ``floor_ms`` = those bytes over the
  GPU's HBM bandwidth (``benchmarks/workload.peaks_for`` of the device; ``--hbm-gbs`` overrides it).
* capacity at a fixed ``--gpu-memory-utilization``: the allocator's KV blocks, and ``concurrent_seqs`` = how many
  sequences of ``--capacity-len`` tokens (default context + K) fit in them at once (each holds
  ceil(len / block_size) blocks), beside the KV bytes the budget gave and the GPU memory in use before the engine
  loaded (a variant that starts with less free memory gets fewer blocks).

The JSON (``--out``) is written after every variant, with ``complete: false`` until the last one is done, so a run
cut by a timeout keeps what it measured; a variant that raises is recorded under ``errors`` and the others still
run (exit 1). Prints the fp8 / bf16 ratios (targets: >= 1.4x decode tok/s, >= 1.9x concurrent sequences).

On the CPU (``--device cpu --model DIR``, small sizes) the same code runs end to end: the tests drive it so.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import env_info
from e2e_gpu import SHAPES, build_random_model, checkpoint_dir, environment
from e2e_measure import decode_weight_bytes
from workload import peaks_for

# name -> (kv_cache_dtype, kv_cache_key_rotation)
VARIANTS = {"auto": ("auto", True), "fp8": ("fp8", True), "fp8-plain": ("fp8", False), "fp8-e5m2": ("fp8_e5m2", True)}


def hbm_bytes_per_s(override_gbs: float | None, device: str) -> tuple[float | None, str]:
    """The bandwidth of the floor, in bytes/s, and where it came from: ``--hbm-gbs`` when given, else the spec
    figure of the GPU this runs on (``workload.peaks_for``); ``None`` when neither is known."""
    if override_gbs is not None:
        return override_gbs * 1e9, "--hbm-gbs"
    if device != "cuda":
        return None, "no GPU: give --hbm-gbs for a floor"
    name = torch.cuda.get_device_name(0)
    peaks = peaks_for(name)
    if peaks is None:
        return None, f"no bandwidth known for {name} (benchmarks/workload.PEAKS): give --hbm-gbs"
    return peaks[1], f"workload.peaks_for({name!r})"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free_gpu(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def ramp_steps_bound(batch: int, context: int, max_num_batched_tokens: int) -> int:
    """At most how many steps it takes until every request has its first token: each step serves the decodes first
    (at most ``batch`` tokens) and gives the rest of the budget to prefill chunks."""
    per_step = max(1, max_num_batched_tokens - batch)
    return -(-batch * context // per_step) + 2


def measure_decode(llm, batch: int, context: int, steps: int, warmup_steps: int, max_tokens: int, vocab: int,
                   seed: int, device: str) -> dict:
    """Steady decode of exactly ``batch`` sequences at ~``context`` tokens: add every request, step until all have
    their first token, ``warmup_steps`` more, then time ``steps`` engine steps (see the module docstring). Returns the
    window's seconds, tokens and the sequences' total context at its first step; raises when the window held anything
    but ``batch`` decodes."""
    from lqe import SamplingParams

    eng = llm.llm_engine
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    rids = [f"kv-decode-{i}" for i in range(batch)]
    for rid in rids:
        eng.add_request(rid, [rng.randrange(2, vocab) for _ in range(context)], params)
    lengths: dict[str, int] = {}  # request -> generated tokens so far
    ramp = 0
    try:
        def step() -> list:
            outs = eng.step()
            for o in outs:
                if o.finished:
                    raise RuntimeError(f"request {o.request_id} finished after {len(o.outputs[0].token_ids)} tokens, "
                                       f"before the timed window ended (max_tokens={max_tokens})")
                lengths[o.request_id] = len(o.outputs[0].token_ids)
            return outs

        limit = ramp_steps_bound(batch, context, eng.config.max_num_batched_tokens) + 8
        while sum(1 for r in rids if lengths.get(r, 0) >= 1) < batch:
            if ramp >= limit:
                raise RuntimeError(f"{batch - len(lengths)} of {batch} requests still had no first token after {ramp} "
                                   f"steps (KV cache too small for {batch} x {context} tokens?)")
            step()
            ramp += 1
        for _ in range(warmup_steps):
            step()
        left = min(max_tokens - n for n in lengths.values())
        if left <= steps:
            raise RuntimeError(f"a request has only {left} tokens left before max_tokens={max_tokens}: the {steps} timed "
                               "steps would see it finish")
        before = dict(lengths)
        prompt0, preempt0 = eng.prompt_tokens_total, eng.scheduler.num_preemptions
        ctx0 = sum(context + n for n in before.values())  # tokens each sequence's first timed step attends over
        sizes = []
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            sizes.append(len(step()))
        _sync(device)
        seconds = time.perf_counter() - t0
        gained = {r: lengths[r] - before[r] for r in rids}
        bad = []
        if min(sizes) != batch or max(sizes) != batch:
            bad.append(f"steps returned {min(sizes)}..{max(sizes)} outputs, not {batch}")
        if set(gained.values()) != {steps}:
            bad.append(f"requests gained {min(gained.values())}..{max(gained.values())} tokens, not {steps}")
        if eng.prompt_tokens_total != prompt0:
            bad.append(f"{eng.prompt_tokens_total - prompt0} prompt tokens were computed")
        if eng.scheduler.num_preemptions != preempt0:
            bad.append(f"{eng.scheduler.num_preemptions - preempt0} preemptions")
        if bad:
            raise RuntimeError(f"the timed window was not steady batch-{batch} decode: {'; '.join(bad)}")
    finally:
        eng.abort_request(rids)
    # step j (0-based) of the window: every sequence attends over its context then, ctx0 + j * batch tokens in all
    mean_ctx_tokens = ctx0 + batch * (steps - 1) / 2
    return {"decode_s": seconds, "decode_steps": steps, "decode_tokens": batch * steps, "ramp_steps": ramp,
            "warmup_steps": warmup_steps, "window_batch": batch, "window_mean_context": mean_ctx_tokens / batch,
            "mean_kv_tokens_per_step": mean_ctx_tokens}


def run(model_dir: Path, variant: str, args) -> dict:
    from lqe import LLM, SamplingParams

    device = args.device
    kv, rotation = VARIANTS[variant]
    ramp = ramp_steps_bound(args.batch, args.context, args.max_num_batched_tokens)
    max_tokens = ramp + 8 + args.warmup_steps + args.decode_steps + 2  # room: none finishes inside the window
    max_len = args.context + max_tokens
    capacity_len = args.capacity_len or args.context + args.decode_steps
    if device == "cuda":
        _free_gpu(device)
        free, total = torch.cuda.mem_get_info()
        used_before = total - free
    t0 = time.perf_counter()
    extra = {} if args.kv_cache_memory_bytes is None else {"kv_cache_memory_bytes": args.kv_cache_memory_bytes}
    llm = LLM(str(model_dir), dtype=args.dtype, device=device, kv_cache_dtype=kv, kv_cache_key_rotation=rotation,
              max_model_len=max_len, max_num_seqs=args.batch, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False, async_scheduling=False,
              gpu_memory_utilization=args.gpu_memory_utilization, max_cudagraph_batch=args.batch, seed=0, **extra)
    try:  # a variant that fails still gives its memory back before the next one loads
        eng = llm.llm_engine
        r = eng.runner
        spec = r.kv_spec
        per_token = spec.bytes_per_block() // r.block_size
        blocks_per_seq = -(-capacity_len // r.block_size)
        row = {"variant": variant, "kv_cache_dtype": kv, "kv_cache_key_rotation": rotation and kv != "auto",
               "kv_torch_dtype": str(r.kv_cache.dtype).removeprefix("torch."),
               "attention_backend": r.attention_backend, "load_s": round(time.perf_counter() - t0, 1),
               "num_blocks": r.num_blocks, "block_size": r.block_size, "kv_bytes_per_token": per_token,
               "kv_cache_gib": r.kv_cache.numel() * r.kv_cache.element_size() / 2**30,
               "kv_budget_bytes": r.num_blocks * spec.bytes_per_block() + spec.fixed_bytes(),
               "kv_fixed_bytes": spec.fixed_bytes(), "kv_bytes_per_block": spec.bytes_per_block(),
               "capacity_len": capacity_len, "blocks_per_seq": blocks_per_seq,
               "concurrent_seqs": r.num_blocks // blocks_per_seq, "cuda_graphs": r.graph_runner is not None,
               "max_model_len": max_len, "max_tokens": max_tokens}
        if device == "cuda":
            row["gpu_used_before_load_gib"] = used_before / 2**30
            row["gpu_total_gib"] = total / 2**30
        vocab = eng.model_config.vocab_size
        rng = random.Random(args.seed)
        llm.generate([[rng.randrange(2, vocab) for _ in range(min(64, args.context))]] * 2,
                     SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False)  # warm-up
        t = time.perf_counter()
        row.update(measure_decode(llm, args.batch, args.context, args.decode_steps, args.warmup_steps, max_tokens, vocab,
                                  args.seed + 1, device))
        row["measure_s"] = time.perf_counter() - t
        row["decode_tok_s"] = row["decode_tokens"] / row["decode_s"]
        step_s = row["decode_s"] / row["decode_steps"]
        weights = decode_weight_bytes(llm)
        kv_read = row["mean_kv_tokens_per_step"] * per_token
        bw, bw_from = hbm_bytes_per_s(args.hbm_gbs, device)
        row.update(weight_bytes=weights, kv_bytes_per_step=kv_read, step_ms=1e3 * step_s,
                   achieved_gbs=(weights + kv_read) / step_s / 1e9, hbm_gbs=None if bw is None else bw / 1e9,
                   hbm_from=bw_from, floor_ms=None if bw is None else 1e3 * (weights + kv_read) / bw)
        floor = "no floor" if bw is None else f"floor {row['floor_ms']:.2f} ms at {row['hbm_gbs']:.0f} GB/s"
        print(f"{variant:9s} [{row['kv_torch_dtype']}, {row['attention_backend']}] decode {row['decode_tok_s']:8.1f} tok/s "
              f"(batch {args.batch} x {row['decode_steps']} steps at ~{row['window_mean_context']:.0f} tokens: step "
              f"{row['step_ms']:.2f} ms, {floor}, {row['achieved_gbs']:.0f} GB/s); {row['num_blocks']} blocks = "
              f"{row['concurrent_seqs']} sequences of {capacity_len} tokens ({row['kv_cache_gib']:.2f} GiB)", flush=True)
    finally:
        llm.shutdown()
        llm = eng = r = spec = None  # nothing of the engine outlives the variant
        _free_gpu(device)
    return row


def summarize(res: dict) -> None:
    """Ratios and targets from the variants measured so far (none until both auto and fp8 are in)."""
    v = res["variants"]
    if "auto" not in v or "fp8" not in v:
        return
    b, f = v["auto"], v["fp8"]
    res["ratios"] = {"decode_tok_s": f["decode_tok_s"] / b["decode_tok_s"],
                     "blocks": f["num_blocks"] / b["num_blocks"],
                     "concurrent_seqs": f["concurrent_seqs"] / max(1, b["concurrent_seqs"])}
    # the same from the bytes alone: fp8's blocks in bf16's KV budget (what the allocator would give fp8 if it had
    # started with bf16's free memory; a lower measured ratio means memory the earlier variant left in use)
    same = (b["kv_budget_bytes"] - f["kv_fixed_bytes"]) // f["kv_bytes_per_block"] // f["blocks_per_seq"]
    res["ratios"]["concurrent_seqs_same_bytes"] = same / max(1, b["concurrent_seqs"])
    if "fp8-plain" in v:  # the key rotation's cost: >= 0.97 expected (two [T*H, D] x [D, D] matmuls)
        res["ratios"]["decode_tok_s_rotated_vs_plain"] = f["decode_tok_s"] / v["fp8-plain"]["decode_tok_s"]
    if "fp8-e5m2" in v:
        res["ratios"]["decode_tok_s_e5m2"] = v["fp8-e5m2"]["decode_tok_s"] / b["decode_tok_s"]
    res["targets"] = [
        {"target": "decode tok/s, fp8 / bf16 KV", "value": res["ratios"]["decode_tok_s"], "goal": ">= 1.4",
         "met": res["ratios"]["decode_tok_s"] >= 1.4},
        {"target": "concurrent sequences at fixed gpu_memory_utilization, fp8 / bf16", "goal": ">= 1.9",
         "value": res["ratios"]["concurrent_seqs"], "met": res["ratios"]["concurrent_seqs"] >= 1.9},
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--model", default=None, help="an existing checkpoint instead of e2e_gpu.py's random one of --shape")
    p.add_argument("--work-dir", "--cache", dest="work_dir", default=None,
                   help="where the random checkpoint is built and reused: <work-dir>/<shape>/bf16 (default: e2e_gpu.py's, "
                        "$LQE_BENCH_DIR or <tmp>/lqe-e2e-models)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens per request")
    p.add_argument("--batch", type=int, default=64, help="sequences decoding in every timed step")
    p.add_argument("--decode-steps", "--new-tokens", dest="decode_steps", type=int, default=64,
                   help="timed engine steps (each: --batch decodes)")
    p.add_argument("--warmup-steps", type=int, default=2, help="untimed full-batch decode steps before the window")
    p.add_argument("--capacity-len", type=int, default=None,
                   help="sequence length of concurrent_seqs (default: context + decode steps)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="a fixed KV budget instead of --gpu-memory-utilization (the CPU's is 1 GiB without it)")
    p.add_argument("--hbm-gbs", type=float, default=None,
                   help="memory bandwidth of the floor in GB/s (default: benchmarks/workload.peaks_for of the GPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="auto,fp8,fp8-plain", help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--out", default=None, help="JSON results file (rewritten after every variant)")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    if not {"auto", "fp8"} <= set(variants) or not set(variants) <= set(VARIANTS):
        p.error(f"--variants {args.variants!r}: give auto and fp8 (the ratios' two sides), optionally "
                f"{', '.join(v for v in VARIANTS if v not in ('auto', 'fp8'))}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("kv_cache_gpu: no CUDA GPU visible (--device cpu runs it on the CPU)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.model:
        model_dir = Path(args.model)
    else:
        target = (Path(args.work_dir) / args.shape / "bf16") if args.work_dir else checkpoint_dir(args.shape)
        model_dir = build_random_model(args.shape, target, args.seed)
        print(f"[{args.shape}] random bf16 checkpoint at {model_dir} ({time.perf_counter() - t0:.0f}s)", flush=True)
    res = {"shape": None if args.model else args.shape, "model": str(model_dir),
           "settings": {k: v for k, v in vars(args).items() if k not in ("out", "work_dir", "model")},
           "env": environment() if args.device == "cuda" else env_info(), "complete": False, "variants": {}}

    def write() -> None:
        res["seconds"] = time.perf_counter() - t0
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(args.out + ".tmp")
            tmp.write_text(json.dumps(res, indent=2))
            tmp.replace(args.out)

    for v in variants:
        try:
            res["variants"][v] = run(model_dir, v, args)
        except Exception as e:  # noqa: BLE001 -- one broken variant must not lose the others
            print(f"{v}: failed: {type(e).__name__}: {e}", flush=True)
            res.setdefault("errors", {})[v] = f"{type(e).__name__}: {e}"
            try:
                _free_gpu(args.device)
            except Exception as e2:  # noqa: BLE001 -- a lost CUDA context: the next variants fail and say so
                print(f"{v}: freeing the GPU failed too: {type(e2).__name__}: {e2}", flush=True)
        summarize(res)
        write()
    res["complete"] = True
    write()
    for t in res.get("targets", []):
        print(f"{t['target']}: {t['value']:.2f}x (goal {t['goal']}: {'met' if t['met'] else 'NOT met'})")
    if args.out:
        print(f"wrote {args.out}")
    return 1 if res.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
