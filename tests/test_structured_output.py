"""Structured output in the Python API (xgrammar token masks in the sampler): JSON schema, regex, choice,
json_object, vLLM's GuidedDecodingParams spelling, and errors. The tiny random model would never produce these
strings on its own, so any valid output is the mask's doing."""
import json
import re

import pytest
import torch

from lqe import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from lqe.layers.sampler import Sampler, SamplingBatch

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}


def _validate(obj):
    assert set(obj) == {"name", "age", "ok"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 99
    assert isinstance(obj["ok"], bool)


def _gen(llm, so, n=1, temperature=0.0, max_tokens=96, prompt="Give me JSON:"):
    p = SamplingParams(temperature=temperature, seed=3, n=n, max_tokens=max_tokens, structured_outputs=so)
    return llm.generate(prompt, p, use_tqdm=False)[0].outputs


def test_json_schema_output_parses_and_validates(tiny_llm):
    plain = _gen(tiny_llm, None, max_tokens=12)[0].text
    with pytest.raises(ValueError):
        json.loads(plain)  # without the mask the tiny model writes no JSON
    outs = _gen(tiny_llm, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), n=3, temperature=1.0)
    # the schema as a JSON string is the same constraint (one compiled grammar, cached)
    outs += _gen(tiny_llm, StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True))
    for out in outs:
        assert out.finish_reason == "stop", out.text
        _validate(json.loads(out.text))


def test_regex_choice_and_old_spelling(tiny_llm):
    out = _gen(tiny_llm, StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2}"))[0]
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", out.text) and out.finish_reason == "stop"
    choices = ["Paris", "Berlin", "New York"]
    outs = _gen(tiny_llm, StructuredOutputsParams(choice=choices), n=4, temperature=1.0)
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs)
    p = SamplingParams(temperature=0, max_tokens=20, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert p.structured_outputs is not None and p.guided_decoding is None
    assert tiny_llm.generate("Answer:", p, use_tqdm=False)[0].outputs[0].text in ("yes", "no")


def test_json_object_output_is_an_object_prefix(tiny_llm):
    out = _gen(tiny_llm, StructuredOutputsParams(json_object=True), max_tokens=12)[0]
    assert out.text.lstrip().startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)


def test_mixed_batch_keeps_unconstrained_rows_free(tiny_llm):
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = tiny_llm.generate([[5, 6, 7]], free, use_tqdm=False)[0].outputs[0].token_ids
    con = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=["abc"]))
    outs = tiny_llm.generate([[5, 6, 7], [5, 6, 7]], [free, con], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == ref and outs[1].outputs[0].text == "abc"


def test_params_and_compile_errors(tiny_llm):
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="not both"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"), guided_decoding=GuidedDecodingParams(regex="b"))
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match="regex constraint could not be compiled"):
        tiny_llm.generate("x", bad, use_tqdm=False)
    assert not tiny_llm.llm_engine.requests and not tiny_llm.llm_engine.structured.matchers


def test_sampler_applies_the_bitmask_on_the_logits_device():
    v = 70
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 1] = 1 << 3  # row 0: only token 35
    bitmask[1] = -1  # row 1: everything
    logits = torch.randn(2, v)
    logits[0, 0] = 100.0
    z = lambda dt: torch.zeros(2, dtype=dt)  # noqa: E731
    batch = SamplingBatch(temperature=z(torch.float32), top_k=z(torch.long), top_p=torch.ones(2), min_p=z(torch.float32),
                          repetition_penalty=torch.ones(2), presence_penalty=z(torch.float32),
                          frequency_penalty=z(torch.float32), generators=[torch.Generator(), torch.Generator()],
                          output_token_ids=[[], []], prompt_token_ids=[[], []], banned_token_ids=[[], []],
                          num_logprobs=[None, None], token_bitmask=bitmask)
    out = Sampler()(logits, batch)
    assert out.token_ids == [35, int(logits[1].argmax())]
