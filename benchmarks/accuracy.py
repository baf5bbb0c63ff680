"""Perplexity through the engine (its quantized kernels, its paged attention), optionally KL divergence and top-1
agreement against a float reference model, and a cross-check against HF transformers for float models.

    python benchmarks/accuracy.py --model smollm2-135m-instruct --seq-len 1024 --max-windows 8 --hf-check
    python benchmarks/accuracy.py --model GPTQ_DIR --reference smollm2-135m-instruct --json out.json
    python benchmarks/accuracy.py --dtype bfloat16 --kv-cache-dtype fp8_e4m3 --seq-len 1024 --max-windows 8
    python benchmarks/accuracy.py --dtype bfloat16 --kv-cache-dtype fp8_e4m3 --no-kv-cache-key-rotation

The text (default ``../shared/data/wikitext2-test.raw``) has its lines joined with "\\n\\n", is tokenized once
with the tokenizer's defaults and cut into consecutive non-overlapping windows of ``--seq-len`` tokens (nothing
prepended); window position p predicts token p + 1. Perplexity = exp(mean NLL over every scored token), from the
engine's ``prompt_logprobs`` (``SamplingParams(max_tokens=1, prompt_logprobs=0)``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import env_info  # noqa: E402


def hf_perplexity(model_dir: str, windows: list[list[int]]) -> float:
    """The same windows through HF transformers in fp32 (float checkpoints only)."""
    from transformers import AutoModelForCausalLM

    with open(os.path.join(model_dir, "config.json")) as f:
        if json.load(f).get("quantization_config"):
            raise ValueError("--hf-check compares float models only; this checkpoint is quantized")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for w in windows:
            lp = model(torch.tensor([w])).logits[0, :-1].float().log_softmax(-1)
            nll -= float(lp.gather(1, torch.tensor(w[1:])[:, None]).sum(dtype=torch.float64))
            tokens += len(w) - 1
    return math.exp(nll / tokens)


def set_calibrated_kv_scales(llm, window: list[int]) -> None:
    """Give every attention layer of ``llm`` (fp8 cache, no step run yet) the scales a calibrated checkpoint
    would hold: ``max|k| / 448`` and ``max|v| / 448`` of the unrotated keys and values of ``window``, measured by
    a prefill on a 16-bit-cache twin of ``llm``."""
    from lqe import LLM, SamplingParams
    from lqe.layers.attention import Attention

    cfg = llm.llm_engine.config
    twin = LLM(cfg.model, quantization=cfg.quantization, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
               kv_cache_memory_bytes=cfg.kv_cache_memory_bytes)
    amax: dict[int, tuple[float, float]] = {}

    def hook(m, a, i):
        if i not in amax:  # the first forward: the whole window
            amax[i] = (float(a[1].float().abs().max()), float(a[2].float().abs().max()))
    layers = [m for m in twin.llm_engine.runner.model.modules() if isinstance(m, Attention)]
    hooks = [m.register_forward_pre_hook(lambda m, a, i=i: hook(m, a, i)) for i, m in enumerate(layers)]
    twin.generate([{"prompt_token_ids": window}], SamplingParams(max_tokens=1), use_tqdm=False)
    for h in hooks:
        h.remove()
    twin.shutdown()
    runner = llm.llm_engine.runner
    for i, m in enumerate(m for m in runner.model.modules() if isinstance(m, Attention)):
        m.k_scale.fill_(amax[i][0] / 448), m.v_scale.fill_(amax[i][1] / 448)
    runner.kv_calibrate = []  # as if the checkpoint had given them


def same_4_significant(a: float, b: float) -> bool:
    return f"{a:.4g}" == f"{b:.4g}" or abs(a - b) <= 1e-6 * abs(b)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quantization", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="KV-cache storage (default auto: the model's dtype); fp8 scales come from the checkpoint or "
                        "the first prefill (the first window)")
    p.add_argument("--kv-cache-key-rotation", action=argparse.BooleanOptionalAction, default=True,
                   help="fp8 cache: rotate queries and keys per head by a Hadamard matrix before the keys are quantized "
                        "(default on; --no-kv-cache-key-rotation stores vLLM's plain fp8 keys)")
    p.add_argument("--kv-scales", default="prefill", choices=["prefill", "calibrated"],
                   help="fp8 cache scales when the checkpoint has none: prefill = vLLM's rule on the first window "
                        "(max|k'| / 200, max|v| / 100), calibrated = what a calibrated checkpoint holds "
                        "(llm-compressor's max / 448 of the unrotated keys and values, here over the first window)")
    p.add_argument("--dataset", default=None, help="any text file (default ../shared/data/wikitext2-test.raw)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="window length (default min(2048, max_position_embeddings - 1): the engine generates one token)")
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--reference", default=None, help="float model: also report KL(reference || model) and top-1 agreement")
    p.add_argument("--reference-dtype", default="auto")
    p.add_argument("--hf-check", action="store_true", help="recompute the perplexity with HF transformers (float models)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    from lqe import LLM
    from lqe.eval import DEFAULT_DATASET, compare, load_windows, perplexity
    from lqe.loaders.hf_config import read_config_json
    from lqe.loaders.model_source import resolve_model

    model_dir = resolve_model(args.model)
    limit = int(read_config_json(model_dir).get("max_position_embeddings", 2049)) - 1
    seq_len = args.seq_len or min(2048, limit)
    if seq_len > limit:
        p.error(f"--seq-len {seq_len} exceeds the model's limit {limit} (max_position_embeddings - 1)")
    dataset = args.dataset or DEFAULT_DATASET
    llm = LLM(model_dir, quantization=args.quantization, dtype=args.dtype, max_model_len=seq_len + 1,
              kv_cache_memory_bytes=None if torch.cuda.is_available() else 512 << 20, kv_cache_dtype=args.kv_cache_dtype,
              kv_cache_key_rotation=args.kv_cache_key_rotation)
    eng = llm.llm_engine
    windows = load_windows(llm.get_tokenizer(), dataset, seq_len, args.max_windows)
    if args.kv_scales == "calibrated" and eng.runner.kv_cache.element_size() == 1:
        set_calibrated_kv_scales(llm, windows[0])
    t = time.perf_counter()
    r = perplexity(llm, windows)
    res = {**r.as_dict(), "seconds": time.perf_counter() - t, "model": args.model, "model_dir": model_dir,
           "quantization": eng.quant_description() or "none", "dtype": str(eng.dtype).removeprefix("torch."),
           "device": str(eng.device), "kv_cache_dtype": args.kv_cache_dtype,
           "kv_cache_key_rotation": args.kv_cache_key_rotation and eng.runner.kv_cache.element_size() == 1,
           "kv_scales": args.kv_scales if eng.runner.kv_cache.element_size() == 1 else None,
           "kv_cache_torch_dtype": str(eng.runner.kv_cache.dtype).removeprefix("torch."), "dataset": dataset, "seq_len": seq_len, "weight_bytes": eng.runner.weight_bytes(),
           "env": env_info()}
    print(f"{args.model}: ppl {r.ppl:.4f} over {r.tokens} tokens ({r.windows} windows x {seq_len}) "
          f"[{res['quantization']}, {res['dtype']}, KV {res['kv_cache_torch_dtype']}, {res['device']}] "
          f"in {res['seconds']:.1f} s")
    if args.reference:
        ref = LLM(args.reference, dtype=args.reference_dtype, max_model_len=seq_len + 1,
                  kv_cache_memory_bytes=None if torch.cuda.is_available() else 512 << 20)
        c = compare(eng, ref.llm_engine, windows)
        res.update(reference=args.reference, reference_ppl=c.ref_ppl, kl=c.kl, top1_agree=c.top1_agree,
                   ppl_full_distribution=c.ppl)
        print(f"vs {args.reference}: reference ppl {c.ref_ppl:.4f}, KL {c.kl:.5f} nats/token, top-1 agreement "
              f"{c.top1_agree * 100:.2f}%")
        del ref
    if args.hf_check:
        hf = hf_perplexity(model_dir, windows)
        ok = same_4_significant(r.ppl, hf)
        res.update(hf_ppl=hf, hf_rel_diff=abs(r.ppl - hf) / hf, hf_match_4_significant=ok)
        print(f"HF transformers (fp32): ppl {hf:.4f}; relative difference {res['hf_rel_diff']:.2e}; "
              f"same to 4 significant digits: {'yes' if ok else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
