"""A client script in vLLM's idioms (offline ``LLM`` API + the ``openai`` client against ``serve``), the kind a vLLM
user already has. Only the import line names lqe; everything else is vLLM's API as documented. Run by
``tests/test_vllm_dropin.py`` as ``python vllm_style_client.py GPTQ_MODEL_DIR BASE_URL SERVED_NAME`` and prints one
JSON line of results for the test to check.
"""
import json
import sys

import httpx
from openai import OpenAI

from lqe import LLM, SamplingParams, StructuredOutputsParams, TextPrompt, TokensPrompt  # vLLM: from vllm import ...

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rank"],
          "properties": {"city": {"type": "string", "maxLength": 8}, "rank": {"type": "integer", "minimum": 1, "maximum": 9}}}


def offline(model_dir: str) -> dict:
    llm = LLM(model=model_dir, quantization="gptq_marlin", tensor_parallel_size=1, dtype="float32",
              max_model_len=256, seed=0, gpu_memory_utilization=0.5, enforce_eager=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    outs = llm.generate(["The capital of France is", {"prompt": "Hello"}, TextPrompt(prompt="Hi"),
                         TokensPrompt(prompt_token_ids=[1, 2, 3]), {"prompt_token_ids": [1, 2, 3]}], greedy)
    texts = [o.outputs[0].text for o in outs]
    json_out = llm.generate("Answer in JSON:", SamplingParams(
        temperature=0.0, max_tokens=64,
        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)))[0].outputs[0].text
    choice = llm.generate("Yes or no?", SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))[0].outputs[0].text
    chat = llm.chat([{"role": "user", "content": "Say hi"}], SamplingParams(temperature=0.0, max_tokens=4))
    biased = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3, logit_bias={7: 100.0}))
    return {"texts": texts, "json": json_out, "choice": choice, "chat_tokens": len(chat[0].outputs[0].token_ids),
            "biased": list(biased[0].outputs[0].token_ids), "n_outputs": len(outs)}


def online(base_url: str, model: str) -> dict:
    client = OpenAI(base_url=base_url + "/v1", api_key="EMPTY")
    models = [m.id for m in client.models.list().data]
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give me a city as JSON"}], temperature=0, max_tokens=64,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    fmt = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give me a city as JSON"}], temperature=0, max_tokens=16,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    guided = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Pick one"}], temperature=0, max_tokens=8,
        extra_body={"guided_choice": ["red", "green", "blue"]})
    regex = client.completions.create(model=model, prompt="Code:", max_tokens=12, temperature=0,
                                      extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{3}"})
    biased = client.completions.create(model=model, prompt="x", max_tokens=3, temperature=0, logit_bias={"7": 100})
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count"}],
                                            max_tokens=6, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        unknown = None
    except Exception as e:  # openai.NotFoundError
        unknown = getattr(e, "status_code", None)
    try:
        client.completions.create(model=model, prompt="x", max_tokens=1, extra_body={"use_beam_search": True})
        unsupported = None
    except Exception as e:  # openai.BadRequestError naming the field
        unsupported = [getattr(e, "status_code", None), "use_beam_search" in str(e)]
    root = base_url
    tok = httpx.post(root + "/tokenize", json={"model": model, "prompt": "Hello world"}).json()
    detok = httpx.post(root + "/detokenize", json={"model": model, "tokens": tok["tokens"]}).json()
    version = httpx.get(root + "/version").json()
    return {"models": models, "completion": completion.choices[0].text, "chat_json": chat.choices[0].message.content,
            "response_format": fmt.choices[0].message.content,
            "guided": guided.choices[0].message.content, "regex": regex.choices[0].text,
            "biased_text": biased.choices[0].text, "streamed": streamed, "unknown_model_status": unknown,
            "unsupported": unsupported, "tokenize_count": tok["count"], "detokenized": detok["prompt"],
            "version": version.get("version")}


if __name__ == "__main__":
    model_dir, base_url, served = sys.argv[1:4]
    print(json.dumps({"offline": offline(model_dir), "online": online(base_url, served)}))
