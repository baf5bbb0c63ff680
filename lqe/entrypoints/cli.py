"""``lqe`` command line: ``generate``, ``chat`` (interactive, streaming) and ``serve`` (OpenAI-compatible)."""
from __future__ import annotations

import argparse
import logging
import sys

from lqe.loaders.model_source import DEMO_MODEL


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEMO_MODEL, help=f"local HF directory, hub id, or {DEMO_MODEL!r} (default)")
    p.add_argument("--quantization", default=None, help="gptq | awq | compressed-tensors (default: auto-detect)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV-cache budget (CPU default 1 GiB)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: run every step eagerly (no decode CUDA graphs)")
    p.add_argument("--max-cudagraph-batch", type=int, default=256,
                   help="largest decode batch replayed from a CUDA graph (default 256, capped by --max-num-seqs)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _llm(args):
    from lqe import LLM

    return LLM(args.model, quantization=args.quantization, dtype=args.dtype, device=args.device,
               max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               kv_cache_memory_bytes=args.kv_cache_memory_bytes, enforce_eager=args.enforce_eager,
               max_cudagraph_batch=args.max_cudagraph_batch)


def _params(args):
    from lqe import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def cmd_generate(args) -> int:
    llm = _llm(args)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("error: give --prompt TEXT (repeatable) or prompts on stdin", file=sys.stderr)
        return 2
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], _params(args), use_tqdm=False)
    else:
        outs = llm.generate(prompts, _params(args), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        print(f"### {prompt}\n{c.text}\n[{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]")
    return 0


def cmd_chat(args) -> int:
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
        for out in llm.stream(ids, _params(args)):
            text = out.outputs[0].text
            print(text[len(shown):], end="", flush=True)
            shown = text
        print()
        history.append({"role": "assistant", "content": shown})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lqe", description="Inference engine for quantized LLMs")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine start-up details")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete prompts and print the results")
    _engine_args(g)
    _sampling_args(g)
    g.add_argument("--prompt", action="append", help="prompt text (repeatable); default: one per stdin line")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template as a user message")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive streaming chat")
    _engine_args(c)
    _sampling_args(c)
    c.add_argument("--system", default=None, help="system prompt")
    c.set_defaults(func=cmd_chat)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    from lqe.entrypoints.openai_server import add_serve_args, run_server

    add_serve_args(s)
    s.set_defaults(func=run_server)
    args = parser.parse_args(argv)
    logging.getLogger("lqe").setLevel(logging.INFO if args.verbose else logging.WARNING)
    try:
        rc = args.func(args)
    except (ValueError, FileNotFoundError, TypeError, MemoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
