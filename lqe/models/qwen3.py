"""Qwen3: Llama with per-head RMSNorm on q and k (before rotary) and an explicit head_dim."""
from lqe.loaders.hf_config import ModelConfig
from lqe.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_kwargs(cls, cfg: ModelConfig) -> dict:
        return {"qkv_bias": cfg.attention_bias, "o_bias": cfg.attention_bias, "qk_norm": True}
