"""``lqe`` command line: ``generate``, ``chat`` (interactive, streaming) and ``serve`` (OpenAI-compatible)."""
from __future__ import annotations

import argparse
import logging
import sys

from lqe.entrypoints.help_format import HelpFormatter
from lqe.loaders.model_source import DEMO_MODEL


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _quant_name(text: str) -> str:
    from lqe.quant_layers.resolve import ALIASES

    if text.strip().lower() not in ALIASES:
        raise argparse.ArgumentTypeError(f"unknown quantization method {text!r}; choose one of {', '.join(sorted(ALIASES))}")
    return text


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEMO_MODEL, help="local HF directory, hub id (org/name), or the demo model")
    p.add_argument("--quantization", default=None, type=_quant_name,
                   help="gptq | awq | compressed-tensors | w8a8 | fp8 | int8, or vLLM's gptq_marlin / awq_marlin / "
                        "marlin (default: auto-detect from the checkpoint). fp8 / int8 on a float checkpoint "
                        "quantize it at load time")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="activation dtype; auto = fp32 on CPU, the checkpoint's fp16/bf16 on GPU")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto = cuda when available")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=64, help="most sequences decoded together")
    p.add_argument("--kv-cache-memory-bytes", type=_positive_int, default=None,
                   help="KV-cache budget in bytes (default: 1 GiB on CPU, --gpu-memory-utilization on GPU)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="KV-cache storage; fp8 = fp8_e4m3, per-layer scales from the checkpoint or the first prefill "
                        "(default auto: the model's dtype)")
    p.add_argument("--kv-cache-key-rotation", action=argparse.BooleanOptionalAction, default=True,
                   help="fp8 cache: rotate queries and keys per head by a Hadamard matrix before the keys are quantized "
                        "(default on)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: run every step eagerly (no decode CUDA graphs)")
    p.add_argument("--cudagraph-mode", default="FULL_DECODE_ONLY", type=str.upper,
                   choices=["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "NONE"],
                   help="CUDA graphs: decode steps only (default), also mixed / prefill steps per token bucket, or none")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=False,
                   help="schedule and prepare the next step while the device runs this one (default off)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over N worker processes / GPUs (default 1)")
    p.add_argument("--max-cudagraph-batch", type=_positive_int, default=256,
                   help="largest decode batch replayed from a CUDA graph (default 256, capped by --max-num-seqs)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=_positive_int, default=128, help="most tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed (default: random)")


def _llm(args):
    from lqe import LLM

    return LLM(args.model, quantization=args.quantization, dtype=args.dtype, device=args.device,
               max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               kv_cache_memory_bytes=args.kv_cache_memory_bytes, enforce_eager=args.enforce_eager,
               max_cudagraph_batch=args.max_cudagraph_batch, tensor_parallel_size=args.tensor_parallel_size,
               kv_cache_dtype=args.kv_cache_dtype, kv_cache_key_rotation=args.kv_cache_key_rotation,
               cudagraph_mode=args.cudagraph_mode, async_scheduling=args.async_scheduling)


def _params(args):
    from lqe import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def cmd_generate(args) -> int:
    params = _params(args)  # bad sampling values fail before the model loads
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("error: give --prompt TEXT (repeatable) or prompts on stdin", file=sys.stderr)
        return 2
    llm = _llm(args)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        print(f"### {prompt}\n{c.text}\n[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]")
    return 0


def cmd_chat(args) -> int:
    params = _params(args)
    llm = _llm(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("lqe chat: type a message, /reset to clear the history, /exit (or Ctrl-D) to quit.")
    while True:
        try:
            user = input("you> ").strip()
        except EOFError:
            print()
            return 0
        if user in ("/exit", "/quit"):
            return 0
        if user == "/reset":
            history = history[:1] if args.system else []
            continue
        if not user:
            continue
        history.append({"role": "user", "content": user})
        ids = llm.apply_chat_template(history)
        print("assistant> ", end="", flush=True)
        shown = ""
        for out in llm.stream(ids, params):
            text = out.outputs[0].text
            print(text[len(shown):], end="", flush=True)
            shown = text
        print()
        history.append({"role": "assistant", "content": shown})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lqe", description="Inference engine for quantized LLMs",
                                     formatter_class=HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine start-up details")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete prompts and print the results", formatter_class=HelpFormatter)
    _engine_args(g)
    _sampling_args(g)
    g.add_argument("--prompt", action="append", help="prompt text (repeatable); default: one per stdin line")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user message")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive streaming chat", formatter_class=HelpFormatter)
    _engine_args(c)
    _sampling_args(c)
    c.add_argument("--system", default=None, help="system prompt (default: none)")
    c.set_defaults(func=cmd_chat)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=HelpFormatter)
    from lqe.entrypoints.openai_server import add_serve_args, run_server

    add_serve_args(s)
    s.set_defaults(func=run_server)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.getLogger("lqe").setLevel(logging.INFO if args.verbose else logging.WARNING)
    try:
        rc = args.func(args)
    except (ValueError, OSError, TypeError, MemoryError) as e:  # lqe's errors say what is wrong and what to do
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
