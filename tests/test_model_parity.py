"""The engine's logprobs equal HF transformers' in fp32 for tiny random Llama / Qwen2 / Qwen3 models."""
import pytest

from helpers import build_tiny_model, hf_logprobs
from lqe import LLM, SamplingParams


def _engine_vs_hf(model_dir: str, prompt: list[int], **llm_kwargs) -> None:
    llm = LLM(model_dir, kv_cache_memory_bytes=32 << 20, max_model_len=512, **llm_kwargs)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    gen = out.outputs[0].token_ids
    assert len(gen) == 16
    ref = hf_logprobs(model_dir, prompt + gen[:-1])
    # prefill: logprob of every prompt token given its prefix
    assert out.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        got = out.prompt_logprobs[j][prompt[j]].logprob
        assert got == pytest.approx(ref[j - 1, prompt[j]].item(), abs=1e-4), f"prompt position {j}"
    # 16 decode steps: the sampled token is HF's argmax and the top-5 logprobs agree
    for t, step in enumerate(out.outputs[0].logprobs):
        row = ref[len(prompt) - 1 + t]
        assert gen[t] == int(row.argmax()), f"decode step {t}"
        for tok, lp in step.items():
            assert lp.logprob == pytest.approx(row[tok].item(), abs=1e-4), f"decode step {t}, token {tok}"


PROMPT = [1, 520, 3100, 28, 9874, 41, 1023, 77, 4500, 12, 650, 8, 30000, 17, 905, 2048, 33, 70, 11000]


def test_llama_parity_gqa_tied(tiny_llama_dir):
    _engine_vs_hf(tiny_llama_dir, PROMPT)


def test_llama_parity_small_blocks_and_chunked_prefill(tiny_llama_dir):
    _engine_vs_hf(tiny_llama_dir, PROMPT, block_size=4, max_num_batched_tokens=5)


def test_qwen2_parity_qkv_bias_untied(tiny_qwen2_dir):
    _engine_vs_hf(tiny_qwen2_dir, PROMPT)


def test_qwen3_parity_qk_norm(tiny_qwen3_dir):
    _engine_vs_hf(tiny_qwen3_dir, PROMPT)


def test_llama3_rope_scaling(tmp_path):
    d = build_tiny_model(str(tmp_path), "llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    _engine_vs_hf(d, PROMPT * 5)


def test_linear_rope_scaling_mha(tmp_path):
    d = build_tiny_model(str(tmp_path), "llama", num_key_value_heads=4,
                         rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    _engine_vs_hf(d, PROMPT)


def test_unsupported_rope_scaling_is_named(tmp_path):
    d = build_tiny_model(str(tmp_path), "llama",
                         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 256})
    with pytest.raises(ValueError, match="yarn.*not supported"):
        LLM(d, kv_cache_memory_bytes=8 << 20, max_model_len=256)
