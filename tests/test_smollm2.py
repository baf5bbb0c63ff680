"""The real demo model: greedy output over 32 tokens identical to HF transformers for several prompts."""
import pytest
import torch

from lqe import LLM, SamplingParams
from lqe.loaders.model_source import demo_model_dir

PROMPTS = ["The capital of France is", "def fibonacci(n):", "In 1969, the first humans", "Water boils at"]


@pytest.fixture(scope="module")
def smol():
    return LLM("smollm2-135m-instruct", kv_cache_memory_bytes=128 << 20, max_model_len=2048)


def test_greedy_matches_transformers(smol):
    from transformers import AutoModelForCausalLM

    # min_tokens, like HF's min_new_tokens, forbids EOS so both produce exactly 32 tokens
    outs = smol.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, min_tokens=32), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(demo_model_dir(), dtype=torch.float32)
    tok = smol.get_tokenizer()
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        ref = hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == ref, prompt


def test_chat_answers_paris(smol):
    out = smol.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop"
