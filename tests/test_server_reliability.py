"""Server items of issues 16 and 19: request fields (work or 400 naming them), 404 for an unknown model,
/tokenize /detokenize /version, what the API key protects, prompt-size check before tokenizing, body limit,
per-request timeout, graceful shutdown, non-finite logits, and the `lqe serve` flags."""
from __future__ import annotations

import argparse
import json
import threading
import time

import httpx
import pytest
import torch

from helpers import serve_openai
from lqe import SamplingParams
from lqe.entrypoints.openai_server import add_serve_args, model_arg
from lqe.entrypoints.serving import ServingLimits

MODEL = "tiny"
MAX_LEN = 256


def serve(model_dir: str, api_key: str | None = None, limits: ServingLimits | None = None, grace_s: float = 5.0,
          num_kv_blocks: int = 64, **engine_kw):
    return serve_openai(model_dir, MODEL, api_key, limits, grace_s, max_model_len=MAX_LEN, num_kv_blocks=num_kv_blocks,
                        max_num_seqs=16, **engine_kw)


@pytest.fixture(scope="module")
def srv(tiny_llama_dir):
    with serve(tiny_llama_dir, limits=ServingLimits(max_body_bytes=64 << 10)) as s:
        yield s


def _post(url, path, body, **kw):
    return httpx.post(f"{url}{path}", json=body, timeout=60, **kw)


def _err(r, status, param):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    return err["message"]


def test_include_stop_str_and_sampling_fields_match_llm(srv, tiny_llm):
    url = srv[0]
    ref = tiny_llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    text = ref.outputs[0].text
    stop = text[5:8] if len(text) >= 8 else None
    if not stop or not stop.strip():
        pytest.skip("the tiny model's text has no usable stop string")
    for keep in (False, True):
        for stream in (False, True):
            body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 24, "temperature": 0, "stop": stop,
                    "include_stop_str_in_output": keep, "stream": stream}
            if stream:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                    chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
                got = "".join(c["choices"][0]["text"] for c in chunks)
            else:
                got = _post(url, "/v1/completions", body).json()["choices"][0]["text"]
            want = tiny_llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=24, stop=stop,
                                                                     include_stop_str_in_output=keep),
                                     use_tqdm=False)[0].outputs[0].text
            assert got == want and got.endswith(stop) == keep, (keep, stream, got)
    # vLLM's sampling extensions reach the engine: same tokens as LLM.generate with the same params
    kw = dict(top_k=5, min_p=0.05, repetition_penalty=1.3, min_tokens=6, seed=7, temperature=0.8, max_tokens=12)
    got = _post(url, "/v1/completions", {"model": MODEL, "prompt": "abc", **kw}).json()["choices"][0]["text"]
    assert got == tiny_llm.generate(["abc"], SamplingParams(**kw), use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("field,value", [("tools", [{"type": "function", "function": {"name": "f"}}]),
                                         ("best_of", 3), ("suffix", "x"), ("use_beam_search", True),
                                         ("prompt_logprobs", 1), ("guided_grammar", "root ::= 'a'"),
                                         ("spaces_between_special_tokens", False), ("seed", 2**64),
                                         ("seed", "1"), ("response_format", {"type": "yaml"})])
def test_unsupported_or_bad_field_is_400_naming_it(srv, field, value):
    msg = _err(_post(srv[0], "/v1/completions", {"model": MODEL, "prompt": "hi", field: value}), 400, field)
    assert "Overflow" not in msg


def test_harmless_off_values_and_unknown_fields_pass(srv):
    r = _post(srv[0], "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                               "tools": [], "tool_choice": "none", "best_of": 1, "max_tokens": 2,
                                               "some_future_field": 1, "skip_special_tokens": False})
    assert r.status_code == 200, r.text


def test_logit_bias_and_structured_output(srv, tiny_llm):
    url = srv[0]
    r = _post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0,
                                       "logit_bias": {"7": 100}})
    assert r.status_code == 200, r.text
    want = tiny_llm.generate(["hi"], SamplingParams(max_tokens=4, temperature=0, logit_bias={7: 100.0}),
                             use_tqdm=False)[0].outputs[0]
    assert want.token_ids == [7, 7, 7, 7] and r.json()["choices"][0]["text"] == want.text
    assert _err(_post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}), 400,
                "logit_bias")
    import re

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}

    def run(path, **fields):
        body = {"model": MODEL, "max_tokens": 120, "temperature": 0, **fields}
        body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
        r = _post(url, path, body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        text = c["message"]["content"] if "chat" in path else c["text"]
        return text, c["finish_reason"]
    assert run("/v1/completions", guided_choice=["yes", "no"])[0] in ("yes", "no")
    assert re.fullmatch("[ab]{3}", run("/v1/completions", guided_regex="[ab]{3}")[0])
    for path in ("/v1/completions", "/v1/chat/completions"):
        for fields in ({"guided_json": schema},
                       {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
                       {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}):
            text, reason = run(path, **fields)
            if reason == "length" and "structured_outputs" not in fields:
                # a random model may pad JSON with whitespace until max_tokens: only its start can be checked
                assert text.lstrip().startswith("{"), text
                continue
            out = json.loads(text)
            assert set(out) == {"a", "b"} and isinstance(out["a"], int) and out["b"] in ("x", "y")
    _err(_post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "guided_regex": "a",
                                        "guided_choice": ["a"]}), 400, "guided_choice")
    _err(_post(url, "/v1/completions", {"model": MODEL, "prompt": "hi",
                                        "response_format": {"type": "json_schema", "json_schema": {}}}),
         400, "response_format")


def test_unknown_model_is_404(srv):
    r = _post(srv[0], "/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})
    assert _err(r, 404, "model") and r.json()["error"]["code"] == "model_not_found"
    assert _post(srv[0], "/tokenize", {"model": "gpt-4", "prompt": "x"}).status_code == 404


def test_tokenize_detokenize_version(srv):
    url, engine, _ = srv
    tok = engine.engine.tokenizer
    r = _post(url, "/tokenize", {"model": MODEL, "prompt": "Hello there", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello there") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_LEN and r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    r2 = _post(url, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    want = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True)
    assert r2["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want)
    assert _post(url, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == tok.decode(r["tokens"])
    _err(_post(url, "/detokenize", {"tokens": [10**9]}), 400, "tokens")
    _err(_post(url, "/tokenize", {"prompt": "a", "messages": []}), 400, "messages")
    _err(_post(url, "/tokenize", {}), 400, "prompt")
    import lqe

    assert httpx.get(url + "/version").json() == {"version": lqe.__version__}


def test_huge_prompt_refused_before_tokenizing_without_stalling_a_stream(srv):
    url, engine, _ = srv
    limit = (MAX_LEN - 1) * engine.max_token_chars
    huge = "word " * (limit // 5 + 10)
    t0 = time.perf_counter()
    msg = _err(_post(url, "/v1/completions", {"model": MODEL, "prompt": huge}), 400, "prompt")
    assert "characters" in msg and time.perf_counter() - t0 < 5
    _err(_post(url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": huge}]}),
         400, "messages")
    # text just under the bound is tokenized and refused by its token count instead
    msg = _err(_post(url, "/v1/completions", {"model": MODEL, "prompt": "x " * (MAX_LEN + 10)}), 400, "prompt")
    assert "tokens" in msg


def test_body_limit_is_413(srv):
    url = srv[0]
    r = _post(url, "/v1/completions", {"model": MODEL, "prompt": "a" * (70 << 10)})
    assert r.status_code == 413 and "max-request-body-bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit is counted while reading
        for _ in range(80):
            yield b" " * 1024
    r = httpx.post(url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413


def test_api_key_covers_model_and_tokenizer_but_not_docs(tiny_llama_dir):
    with serve(tiny_llama_dir, api_key="k", num_kv_blocks=32) as (url, _, _):
        for path in ("/v1/models",):
            assert httpx.get(url + path).status_code == 401
        assert _post(url, "/tokenize", {"prompt": "a"}).status_code == 401
        assert _post(url, "/detokenize", {"tokens": [1]}).status_code == 401
        assert _post(url, "/tokenize", {"prompt": "a"}, headers={"Authorization": "Bearer k"}).status_code == 200
        for path in ("/health", "/version", "/docs", "/openapi.json", "/metrics"):
            assert httpx.get(url + path).status_code == 200, path
        assert "/v1/completions" in httpx.get(url + "/openapi.json").json()["paths"]


def test_request_timeout_and_graceful_shutdown(tiny_llama_dir):
    body = {"model": MODEL, "prompt": "go", "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    with serve(tiny_llama_dir, limits=ServingLimits(request_timeout_s=0.3), num_kv_blocks=32) as (url, engine, _):
        real = engine.engine.step

        def slow_step():
            time.sleep(0.02)
            return real()
        engine.engine.step = slow_step
        r = _post(url, "/v1/completions", body)
        assert r.status_code == 504 and "--request-timeout" in r.json()["error"]["message"]
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert "request_timeout" in lines[-2] and lines[-1] == "data: [DONE]"
        time.sleep(0.2)
        assert engine.stats().num_free_blocks == 32
    with serve(tiny_llama_dir, grace_s=0.5, num_kv_blocks=32) as (url, engine, server):
        real = engine.engine.step

        def slow_step2():
            time.sleep(0.02)
            return real()
        engine.engine.step = slow_step2
        lines: list[str] = []

        def client():
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as s:
                lines.extend(ln for ln in s.iter_lines() if ln.startswith("data: "))
        t = threading.Thread(target=client)
        t.start()
        while engine.num_requests == 0:
            time.sleep(0.01)
        t0 = time.monotonic()
        server.should_exit = True  # what SIGTERM does
        t.join(timeout=20)
        assert time.monotonic() - t0 < 5
        assert any("grace period" in ln for ln in lines), lines[-3:]
        deadline = time.monotonic() + 5  # the abort runs in the engine thread right after the error is sent
        while engine.engine.block_manager.num_free_blocks != 32 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.engine.block_manager.num_free_blocks == 32


def test_server_freezes_the_startup_heap_while_it_serves(tiny_llama_dir):
    """What is alive when the server starts (the model, torch, pytest's own objects here) is out of the collector's
    reach while it serves, so a full collection does not stall streams (test_big_prompts_do_not_stall_a_stream);
    shutdown hands it back, so a process that goes on collects it again."""
    import gc

    marker = [object()]  # tracked by the collector, alive across the server's startup
    with serve(tiny_llama_dir, num_kv_blocks=32) as (url, _, _):
        assert gc.get_freeze_count() > 0
        assert not any(o is marker for o in gc.get_objects(generation=2))  # moved to the permanent generation
        assert _post(url, "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 2}).status_code == 200
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert any(o is marker for o in gc.get_objects(generation=2))


def test_non_finite_logits_fail_the_request_with_500(srv):
    url, engine, _ = srv
    model = engine.engine.runner.model
    real = model.compute_logits

    def nan_logits(h):
        out = real(h)
        return torch.full_like(out, float("nan"))
    model.compute_logits = nan_logits
    try:
        r = _post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4})
    finally:
        del model.compute_logits
    assert r.status_code == 500 and "non-finite logits" in r.json()["error"]["message"]
    assert _post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200


def test_non_finite_logits_fail_only_the_named_request(srv):
    """Two requests in one step, the logits of one of them non-finite: that one gets a 500, the other finishes
    with exactly the tokens it gets alone."""
    import concurrent.futures

    from lqe.engine.model_runner import NonFiniteLogitsError

    url, engine, _ = srv
    runner = engine.engine.runner
    body = {"model": MODEL, "prompt": "the tower is", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    alone = _post(url, "/v1/completions", body).json()["choices"][0]["text"]
    real, state = runner.execute, {"fired": False}

    def execute(sched, sampling):
        # hold the first request's steps until the second is queued (its add runs right after this step), so the
        # two share decode steps however slowly the client threads start on a loaded machine
        deadline = time.monotonic() + 30
        while not state["fired"] and engine.num_requests < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        rids = sorted({s.seq.request_id for s in sched.scheduled if s.samples})
        if not state["fired"] and len(rids) == 2 and all(s.num_new_tokens == 1 for s in sched.scheduled):
            state["fired"] = True
            raise NonFiniteLogitsError(f"non-finite logits for {rids[0]}", [rids[0]])
        return real(sched, sampling)

    runner.execute = execute
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            rs = list(pool.map(lambda _: _post(url, "/v1/completions", body), range(2)))
    finally:
        del runner.execute
    assert state["fired"]
    assert sorted(r.status_code for r in rs) == [200, 500], [r.text for r in rs]
    ok = next(r for r in rs if r.status_code == 200)
    assert ok.json()["choices"][0]["text"] == alone


def test_serve_flags():
    p = add_serve_args(argparse.ArgumentParser())
    a = p.parse_args(["--model", "m", "--block-size", "32", "--no-enable-prefix-caching", "--kv-cache-dtype", "auto",
                      "--revision", "r1", "--chat-template", "{{ x }}", "--enforce-eager", "--request-timeout", "5",
                      "--max-request-body-bytes", "100", "--shutdown-grace-period", "2"])
    assert (model_arg(a), a.block_size, a.enable_prefix_caching, a.revision, a.chat_template) == (
        "m", 32, False, "r1", "{{ x }}")
    assert model_arg(p.parse_args(["m"])) == "m" and p.parse_args(["m", "--enable-prefix-caching"]).enable_prefix_caching
    with pytest.raises(ValueError, match="two models"):
        model_arg(p.parse_args(["a", "--model", "b"]))
    with pytest.raises(ValueError, match="no model"):
        model_arg(p.parse_args([]))
    assert p.parse_args(["m", "--kv-cache-dtype", "fp8_e5m2"]).kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(SystemExit):
        p.parse_args(["m", "--kv-cache-dtype", "int8"])


def test_serve_graph_async_and_rotation_flags_reach_the_engine_config():
    from lqe.config import EngineConfig
    from lqe.entrypoints.engine_args import engine_kwargs

    p = add_serve_args(argparse.ArgumentParser())
    a = p.parse_args(["m", "--cudagraph-mode", "full_and_piecewise", "--max-piecewise-tokens", "256",
                      "--async-scheduling", "--no-kv-cache-key-rotation"])
    cfg = EngineConfig.from_kwargs("m", **engine_kwargs(a))
    assert (cfg.cudagraph_mode, cfg.max_piecewise_tokens, cfg.async_scheduling, cfg.kv_cache_key_rotation) == (
        "FULL_AND_PIECEWISE", 256, True, False)
    d = p.parse_args(["m"])
    assert (d.cudagraph_mode, d.max_piecewise_tokens, d.async_scheduling, d.kv_cache_key_rotation) == (None,) * 4
    with pytest.raises(SystemExit):
        p.parse_args(["m", "--cudagraph-mode", "piecewise"])


def test_serve_cli_builds_engine_with_flags(tiny_llama_dir, tmp_path):
    from lqe.entrypoints.openai_server import build_engine

    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}")
    a = add_serve_args(argparse.ArgumentParser()).parse_args(
        ["--model", tiny_llama_dir, "--block-size", "8", "--no-enable-prefix-caching", "--num-kv-blocks", "64",
         "--device", "cpu", "--max-model-len", "128", "--chat-template", str(tpl)])
    eng = build_engine(a)
    try:
        cfg = eng.engine.config
        assert (cfg.block_size, cfg.enable_prefix_caching) == (8, False)
        assert eng.engine.tokenizer.chat_template.startswith("{% for m")
    finally:
        eng.close()
