"""Online serving benchmark: Poisson arrivals at a given request rate against an OpenAI-compatible server.

Measures request throughput, output tokens/s, time to first token (TTFT), inter-token latency (ITL: gaps
between streamed chunks), time per output token (TPOT) and end-to-end latency (mean, p50/p90/p99); prints a
table and writes JSON. Prompts are random token ids (seeded) of a fixed length and every request generates
exactly ``--output-len`` tokens (``ignore_eos``), so runs are comparable across models and formats.

    python -m benchmarks.serving --url http://127.0.0.1:8000 --request-rate 4 --num-prompts 100
    python -m benchmarks.serving --model smollm2-135m-instruct --request-rate inf --num-prompts 64  # starts a server
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int,
                      headers: dict) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res = Result(prompt_len=len(prompt))
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                # every chunk with a choice carries new tokens (the server sends one only then, and a request
                # finishes on a token), but its text may be empty: a checkpoint without a tokenizer (as on the GPU
                # machines), text held back for a stop string. Only the usage chunk has no choice.
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - t0
        res.ok = res.ttft > 0
    except Exception as e:  # a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run(args: argparse.Namespace, url: str) -> tuple[list[Result], float]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(args.min_token_id, args.max_token_id) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    gaps = [0.0 if math.isinf(args.request_rate) else rng.expovariate(args.request_rate) for _ in prompts]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        model = args.model_name or (await client.get(url + "/v1/models", headers=headers)).json()["data"][0]["id"]
        await one_request(client, url, model, prompts[0][:8], 2, headers)  # warm-up
        tasks, t0 = [], time.perf_counter()
        for prompt, gap in zip(prompts, gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one_request(client, url, model, prompt, args.output_len, headers)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    pct = lambda xs: {"mean": float(np.mean(xs)) * 1e3 if xs else float("nan"),  # noqa: E731
                      **{f"p{p}": float(np.percentile(xs, p)) * 1e3 if xs else float("nan") for p in (50, 90, 99)}}
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_len for r in ok)) / duration,
        "ttft_ms": pct([r.ttft for r in ok]), "itl_ms": pct([x for r in ok for x in r.itl]),
        "tpot_ms": pct(tpot), "e2e_ms": pct([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def print_table(s: dict, args: argparse.Namespace) -> None:
    print(f"\n== serving benchmark: {args.num_prompts} requests, rate {args.request_rate}/s, "
          f"input {args.input_len}, output {args.output_len} tokens ==")
    print(f"completed {s['completed']}, failed {s['failed']}, duration {s['duration_s']:.2f} s")
    print(f"requests/s {s['request_throughput']:.2f}   output tok/s {s['output_throughput']:.1f}   "
          f"total tok/s {s['total_token_throughput']:.1f}")
    print(f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        v = s[key]
        print(f"{key[:-3].upper():<12}" + "".join(f"{v[k]:>10.1f}" for k in ("mean", "p50", "p90", "p99")))
    for e in s["errors"]:
        print("error:", e)


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "lqe.entrypoints.openai_server", args.model, "--port", str(port),
           "--log-level", "warning", *args.server_args]
    print("starting:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"the server did not become healthy within {args.startup_timeout} s")


def environment() -> dict:
    env = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        import torch

        env["torch"] = torch.__version__
        env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        env["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return env


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000")
    src.add_argument("--model", help="start `python -m lqe.entrypoints.openai_server MODEL` on a free port")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="extra server flags (last)")
    p.add_argument("--model-name", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=os.environ.get("LQE_API_KEY"))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--min-token-id", type=int, default=100)
    p.add_argument("--max-token-id", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", default="benchmarks/results/serving.json")
    args = p.parse_args(argv)
    proc = None
    url = args.url.rstrip("/") if args.url else None
    try:
        if url is None:
            proc, url = start_server(args)
        results, duration = asyncio.run(run(args, url))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    summary = summarize(results, duration)
    print_table(summary, args)
    report = {"config": {k: v for k, v in vars(args).items() if k != "api_key"}, "url": url,
              "environment": environment(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), **summary,
              "requests": [asdict(r) | {"itl": [round(x, 6) for x in r.itl]} for r in results]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
