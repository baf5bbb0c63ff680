"""Issue 16's acceptance check: a script written against vLLM's offline API and the ``openai`` client
(``tests/dropin/vllm_style_client.py``: prompt dicts, TokensPrompt / TextPrompt, the ``gptq_marlin`` alias, vLLM
engine kwargs, structured JSON / choice / regex output, logit_bias, streaming, /tokenize, /detokenize, /version, 404
for an unknown model, 400 naming an unimplemented field) runs unchanged against lqe on CPU, on a GPTQ checkpoint."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from helpers import build_tiny_model, serve_openai, write_quantized_checkpoint
from lqe.quant_layers import reference as ref

pytest.importorskip("openai")
pytest.importorskip("xgrammar")
SCRIPT = os.path.join(os.path.dirname(__file__), "dropin", "vllm_style_client.py")


def _valid_city(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"city", "rank"}, text
    assert isinstance(obj["city"], str) and len(obj["city"]) <= 8
    assert isinstance(obj["rank"], int) and 1 <= obj["rank"] <= 9


def test_vllm_style_script_runs_unchanged(tmp_path):
    base = build_tiny_model(str(tmp_path / "float"), "llama")
    model = write_quantized_checkpoint(
        base, str(tmp_path / "gptq"), lambda _n, w: ref.encode_gptq(ref.rtn_quantize(w, 4, 32, True), "gptq"),
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False})
    with serve_openai(model, "my-gptq", max_model_len=256) as (url, _engine, _server):
        proc = subprocess.run([sys.executable, SCRIPT, model, url, "my-gptq"], capture_output=True, text=True,
                              timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    off, on = res["offline"], res["online"]
    # the five prompt forms: one output each; "Hello" as a string and as a TextPrompt dict agree, as do the tokens
    assert off["n_outputs"] == 5 and off["texts"][3] == off["texts"][4]
    _valid_city(off["json"])
    assert off["choice"] in ("yes", "no")
    assert off["chat_tokens"] == 4
    assert off["biased"] == [7, 7, 7]
    assert on["models"] == ["my-gptq"]
    _valid_city(on["chat_json"])
    assert on["response_format"].lstrip().startswith("{")  # a schema-constrained prefix (16 tokens may not close it)
    assert on["guided"] in ("red", "green", "blue")
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{3}", on["regex"]), on["regex"]
    assert on["streamed"] and on["completion"]
    assert on["unknown_model_status"] == 404
    assert on["unsupported"] == [400, True]
    assert on["tokenize_count"] >= 2 and on["detokenized"] == "Hello world"
    assert on["version"]
