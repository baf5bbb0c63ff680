"""The OpenAI-compatible server over real sockets: one uvicorn server per module (tiny random Llama, CPU),
driven with the ``openai`` client and raw ``httpx``; outputs must equal ``LLM.generate`` on the same model."""
from __future__ import annotations

import asyncio
import contextlib
import re
import time

import httpx
import openai
import pytest

from helpers import serve_openai
from lqe import SamplingParams
from lqe.entrypoints.openai_server import add_serve_args

MODEL = "tiny"
MAX_LEN = 256
NUM_BLOCKS = 96


@contextlib.contextmanager
def _serve(model_dir: str, api_key: str | None = None, num_kv_blocks: int = NUM_BLOCKS):
    with serve_openai(model_dir, MODEL, api_key, max_model_len=MAX_LEN, num_kv_blocks=num_kv_blocks,
                      max_num_seqs=32) as (url, engine, _):
        yield url, engine


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with _serve(tiny_llama_dir) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def _ref(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0].outputs


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(lqe_\w+) (\S+)$", text, re.M)}


def test_models_health_metrics(server, client):
    url, _ = server
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(url + "/health").status_code == 200
    m = _metrics(url)
    for name in ("lqe_num_requests_running", "lqe_num_requests_waiting", "lqe_kv_cache_usage_perc",
                 "lqe_generation_tokens_total", "lqe_prompt_tokens_total", "lqe_num_free_kv_blocks"):
        assert name in m
    assert m["lqe_num_kv_blocks"] == NUM_BLOCKS


def test_completion_matches_llm(client, tiny_llm):
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    ref = _ref(tiny_llm, prompt, temperature=0, max_tokens=12)[0]
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    n_prompt = len(tiny_llm.get_tokenizer().encode(prompt))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(ref.token_ids))
    # seeded sampling, n=2, penalties and top-k/top-p reproduce the offline engine
    kw = dict(temperature=0.9, top_p=0.9, seed=7, presence_penalty=0.5, frequency_penalty=0.3)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, n=2, extra_body={"top_k": 50}, **kw)
    ref = _ref(tiny_llm, prompt, max_tokens=10, n=2, top_k=50, **kw)
    assert [c.text for c in r.choices] == [o.text for o in ref]
    # streaming gives the same text, and usage in a last chunk without choices
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == _ref(tiny_llm, prompt, temperature=0,
                                                                          max_tokens=12)[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completion_batch_prompts_and_token_ids(client, tiny_llm):
    ids = tiny_llm.get_tokenizer().encode("Once upon a time")
    r = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == _ref(tiny_llm, ids, temperature=0, max_tokens=5)[0].text
    assert r.choices[1].text == _ref(tiny_llm, ids[:2], temperature=0, max_tokens=5)[0].text
    r = client.completions.create(model=MODEL, prompt=["hello there", "bye"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices[2:]] == [_ref(tiny_llm, "bye", temperature=0, max_tokens=4)[0].text] * 2
    tok = tiny_llm.get_tokenizer()
    assert r.usage.prompt_tokens == len(tok.encode("hello there")) + len(tok.encode("bye"))  # n does not repeat it


def test_stop_string_streaming_and_not(client, tiny_llm):
    prompt = "Stop me if you can"
    full = _ref(tiny_llm, prompt, temperature=0, max_tokens=24, ignore_eos=True)[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    expect = full[:full.index(stop)]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert r.choices[0].text == expect and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert streamed == expect


def test_completion_logprobs(client, tiny_llm):
    r = client.completions.create(model=MODEL, prompt="Logprobs", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    ref = _ref(tiny_llm, "Logprobs", temperature=0, max_tokens=6, logprobs=3)[0]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    want = [ref.logprobs[i][t].logprob for i, t in enumerate(ref.token_ids)]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text


def test_chat_matches_llm(client, tiny_llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    ref = tiny_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=2)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == ref.text
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert len(c.logprobs.content) == len(ref.token_ids) and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_32_concurrent_streams(server, tiny_llm):
    prompts = [f"Request number {i} says" for i in range(32)]
    refs = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)

    async def one(aclient, prompt):
        text = ""
        async for chunk in await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                            stream=True, extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text
        return text

    async def main():
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    texts = asyncio.run(main())
    assert texts == [r.outputs[0].text for r in refs]


def test_disconnect_mid_stream_frees_blocks(server):
    url, engine = server
    before = _metrics(url)["lqe_generation_tokens_total"]
    body = {"model": MODEL, "prompt": "A very long story begins", "max_tokens": 200, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = 0
        while got < 3:
            got += next(lines).startswith("data: ")
        assert _metrics(url)["lqe_num_free_kv_blocks"] < NUM_BLOCKS
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = _metrics(url)
        if m["lqe_num_free_kv_blocks"] == NUM_BLOCKS and m["lqe_num_requests_in_flight"] == 0:
            break
        time.sleep(0.05)
    assert m["lqe_num_free_kv_blocks"] == NUM_BLOCKS and m["lqe_num_requests_running"] == 0
    assert m["lqe_generation_tokens_total"] - before < 200  # aborted, not run to the end
    assert not engine.engine.requests
    # a non-streaming client that gives up is aborted too
    before = m["lqe_generation_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=0.1)
    deadline = time.monotonic() + 10
    while (m := _metrics(url))["lqe_num_requests_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m["lqe_num_free_kv_blocks"] == NUM_BLOCKS and m["lqe_generation_tokens_total"] - before < 200


BAD = [
    ("completions", b'{"model": "tiny", "prompt": "x",', None),
    ("completions", {"model": "tiny", "prompt": 5}, "prompt"),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "x", "temperature": "hot"}, "temperature"),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "x", "max_tokens": MAX_LEN}, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": [7] * MAX_LEN, "max_tokens": 1}, "prompt"),
    ("completions", {"model": "tiny", "prompt": "x", "top_p": 1.5}, "top_p"),
    ("completions", {"model": "tiny", "prompt": "x", "n": 0}, "n"),
    ("completions", {"model": "tiny", "prompt": "x", "logprobs": 99}, "logprobs"),
    ("completions", {"model": "tiny", "prompt": ""}, "prompt"),
    ("completions", {"model": "tiny", "prompt": [10**9]}, "prompt"),
    ("completions", {"model": "tiny", "prompt": "x", "echo": True}, "echo"),
    ("completions", {"model": "tiny", "prompt": "x", "stop": [""]}, "stop"),
    ("completions", {"model": "tiny", "prompt": "x", "seed": 1.5}, "seed"),
    ("chat/completions", {"model": "tiny", "messages": []}, "messages"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, "messages"),
    ("chat/completions", {"model": "tiny", "messages": "hi"}, "messages"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x " * MAX_LEN}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(BAD)])
def test_bad_input_is_400(server, path, body, param):
    url, _ = server
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{url}/v1/{path}", timeout=30, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_engine_error_fails_request_and_keeps_serving(server, client):
    url, engine = server
    runner = engine.engine.runner

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    runner.execute = boom
    try:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "fail", "max_tokens": 4}, timeout=30)
    finally:
        del runner.execute
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="still alive", max_tokens=3).usage.completion_tokens >= 1
    m = _metrics(url)
    assert m["lqe_engine_step_errors_total"] >= 1 and m["lqe_num_free_kv_blocks"] == NUM_BLOCKS


def test_api_key(tiny_llama_dir):
    with _serve(tiny_llama_dir, api_key="sekret", num_kv_blocks=16) as (url, _):
        assert httpx.get(url + "/v1/models").status_code == 401
        r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(url + "/health").status_code == 200  # health and metrics stay open


def test_serve_args():
    import argparse

    args = add_serve_args(argparse.ArgumentParser()).parse_args(
        ["m", "--port", "9000", "--api-key", "k", "--max-model-len", "128", "--served-model-name", "x", "-q", "gptq"])
    assert (args.model, args.port, args.api_key, args.max_model_len, args.served_model_name, args.quantization) == (
        "m", 9000, "k", 128, "x", "gptq")
