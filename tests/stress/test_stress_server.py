"""Stress the OpenAI server (issue 19), small sizes for 2 CPU cores: concurrent streaming clients that hang up at
random, a mix of huge and tiny prompts, a KV cache small enough to force preemption, and malformed bodies
(random mutations of valid requests). Afterwards every KV block is free, every request that finished got exactly
the tokens it gets when run alone, and the token counters add up."""
from __future__ import annotations

import asyncio
import json
import random
import re
import time

import httpx
import pytest

from helpers import serve_openai
from lqe import LLM, SamplingParams
from lqe.entrypoints.async_engine import AsyncEngine
from lqe.entrypoints.serving import ServingLimits

pytestmark = pytest.mark.stress

MODEL = "tiny"
MAX_LEN = 256
NUM_BLOCKS = 24  # 384 token slots for up to 12 sequences of up to ~200 tokens: preemption is certain


@pytest.fixture(scope="module")
def stress_server(tiny_llama_dir):
    with serve_openai(tiny_llama_dir, MODEL, None, ServingLimits(max_body_bytes=2 << 20), grace_s=2.0,
                      log_level="error", max_model_len=MAX_LEN, num_kv_blocks=NUM_BLOCKS, max_num_seqs=12,
                      enable_prefix_caching=False, max_num_batched_tokens=256) as (url, engine, _):
        yield url, engine


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(lqe_\w+) (\S+)$", text, re.M)}


def _wait_idle(url: str, engine: AsyncEngine, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.num_requests == 0 and engine.engine.block_manager.num_free_blocks == NUM_BLOCKS:
            return
        time.sleep(0.05)


def _requests(rng: random.Random, n: int) -> list[dict]:
    out = []
    for i in range(n):
        huge = i % 4 == 0
        prompt = [rng.randrange(3, 2000) for _ in range(rng.randint(150, 200) if huge else rng.randint(2, 12))]
        out.append({"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(4, 24), "temperature": 0,
                    "ignore_eos": True, "stream": rng.random() < 0.6})
    return out


async def _run(client: httpx.AsyncClient, url: str, body: dict, hang_up_after: int | None):
    """(text, completion tokens) of a finished request, or None when this client hung up."""
    if not body["stream"]:
        r = await client.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        j = r.json()
        return j["choices"][0]["text"], j["usage"]["completion_tokens"]
    text, n = "", 0
    async with client.stream("POST", url + "/v1/completions",
                             json={**body, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                text += c["text"]
                if hang_up_after is not None and len(text) >= hang_up_after:
                    return None  # leaving the block closes the connection mid-stream
    return text, n


def _mutations(rng: random.Random, body: dict) -> list[bytes]:
    raw = json.dumps(body).encode()
    out = [raw[: rng.randrange(1, len(raw))], raw + b"}", b"", b"null", b"[]", b"\xff\xfe" + raw,
           json.dumps({**body, "prompt": None}).encode(), json.dumps({**body, "max_tokens": -1}).encode(),
           json.dumps({**body, "prompt": [[-5]]}).encode(), json.dumps({**body, "n": 10**9}).encode(),
           json.dumps({**body, "stop": {"a": 1}}).encode(), json.dumps({**body, "seed": 2**70}).encode(),
           json.dumps({**body, "temperature": float("nan")}).encode(), b"x" * (3 << 20),
           json.dumps({**body, "logprobs": 99}).encode(), json.dumps({**body, "prompt": "x" * 200_000}).encode(),
           json.dumps({**body, "prompt": [10**12]}).encode()]
    for _ in range(12):  # random byte flips and key deletions
        b = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        out.append(bytes(b))
        d = dict(body)
        d.pop(rng.choice(sorted(d)))
        d[rng.choice(["max_tokens", "temperature", "top_p", "n", "stream", "model"])] = rng.choice(
            ["x", [], {}, -1, 1e30, None, True])
        out.append(json.dumps(d).encode())
    return out


def test_chaos_then_every_block_free_outputs_exact_and_metrics_add_up(stress_server, tiny_llama_dir):
    url, engine = stress_server
    rng = random.Random(0)
    bodies = _requests(rng, 24)
    hang_ups = {i: rng.randint(1, 6) for i in range(len(bodies)) if bodies[i]["stream"] and rng.random() < 0.4}
    before = _metrics(url)

    async def chaos():
        async with httpx.AsyncClient(timeout=120) as client:
            jobs = [_run(client, url, b, hang_ups.get(i)) for i, b in enumerate(bodies)]
            bad_status = []

            async def malformed():
                for raw in _mutations(random.Random(1), bodies[1]):
                    r = await client.post(url + "/v1/completions", content=raw,
                                          headers={"content-type": "application/json"})
                    if r.status_code == 200:  # a mutation that is still a valid request
                        continue
                    bad_status.append((r.status_code, raw[:60]))
                    assert 400 <= r.status_code < 500, (r.status_code, raw[:80], r.text)
                    assert r.json()["error"]["message"]
            results = await asyncio.gather(*jobs, malformed())
            return results[:-1], bad_status
    results, bad = asyncio.run(asyncio.wait_for(chaos(), 120))
    assert len(bad) >= 15
    _wait_idle(url, engine)
    assert engine.num_requests == 0
    assert engine.engine.block_manager.num_free_blocks == NUM_BLOCKS
    after = _metrics(url)
    assert after["lqe_num_preemptions_total"] > before.get("lqe_num_preemptions_total", 0), "no preemption happened"
    assert after["lqe_engine_step_errors_total"] == before.get("lqe_engine_step_errors_total", 0)

    # every request that finished got exactly the tokens it gets alone
    alone = LLM(tiny_llama_dir, device="cpu", max_model_len=MAX_LEN, num_kv_blocks=32)
    finished = [(b, r) for b, r in zip(bodies, results) if r is not None]
    assert len(finished) >= len(bodies) - len(hang_ups) and len(finished) >= 12
    for b, (text, n) in finished:
        ref = alone.generate([b["prompt"]], SamplingParams(temperature=0, max_tokens=b["max_tokens"], ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
        assert text == ref.text and n == len(ref.token_ids) == b["max_tokens"]
    gen = after["lqe_generation_tokens_total"] - before.get("lqe_generation_tokens_total", 0)
    assert gen >= sum(n for _, (_, n) in finished)

    # a clean burst: the counters match the usage the clients were sent
    before = _metrics(url)
    clean = _requests(random.Random(2), 12)

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[_run(client, url, b, None) for b in clean])
    outs = asyncio.run(asyncio.wait_for(burst(), 120))
    _wait_idle(url, engine)
    after = _metrics(url)
    assert after["lqe_generation_tokens_total"] - before["lqe_generation_tokens_total"] == sum(n for _, n in outs)
    prompt = after["lqe_prompt_tokens_total"] - before["lqe_prompt_tokens_total"]
    want = sum(len(b["prompt"]) for b in clean)
    if after["lqe_num_preemptions_total"] == before["lqe_num_preemptions_total"]:
        assert prompt == want
    else:  # a preempted sequence recomputes its prompt
        assert prompt >= want
    assert engine.engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_big_prompts_do_not_stall_a_stream(stress_server):
    """Eight prompts of 1 MB arrive while one request streams: they are refused before tokenizing, so the
    stream's largest gap between chunks stays within a few times its baseline."""
    url, engine = stress_server
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 60, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def gaps(with_big: bool) -> float:
        async with httpx.AsyncClient(timeout=60) as client:
            times: list[float] = []

            async def stream():
                async with client.stream("POST", url + "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            times.append(time.perf_counter())

            async def big():
                await asyncio.sleep(0.05)
                rs = await asyncio.gather(*[client.post(url + "/v1/completions",
                                                        json={"model": MODEL, "prompt": "y" * (1 << 20)})
                                            for _ in range(8)])
                assert all(r.status_code == 400 and "characters" in r.json()["error"]["message"] for r in rs)
            await asyncio.gather(stream(), *([big()] if with_big else []))
            return max(b - a for a, b in zip(times, times[1:]))
    base = asyncio.run(gaps(False))
    loaded = asyncio.run(gaps(True))
    assert loaded < max(3 * base, 0.5), (base, loaded)
    _wait_idle(url, engine)
    assert engine.engine.block_manager.num_free_blocks == NUM_BLOCKS
