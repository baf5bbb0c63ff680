"""``lqe`` command line: ``generate``, ``chat`` (interactive, streaming) and ``serve`` (OpenAI-compatible)."""
from __future__ import annotations

import argparse
import logging
import sys

from lqe.entrypoints.engine_args import add_engine_args, engine_kwargs, positive_int
from lqe.entrypoints.help_format import HelpFormatter
from lqe.loaders.model_source import DEMO_MODEL


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEMO_MODEL, help="local HF directory, hub id (org/name), or the demo model")
    add_engine_args(p)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=128, help="most tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed (default: random)")


def _llm(args):
    from lqe import LLM

    return LLM(args.model, **engine_kwargs(args))


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
