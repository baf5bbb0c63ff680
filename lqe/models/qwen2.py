"""Qwen2 / Qwen2.5: Llama with a bias on q, k, v (not on o_proj)."""
from lqe.loaders.hf_config import ModelConfig
from lqe.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_kwargs(cls, cfg: ModelConfig) -> dict:
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False}
