"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window); Qwen2/Qwen3 subclass it.

Every linear layer is built with ``quant_config`` and its full prefix; the model never branches on the
quantization method (DESIGN.md rule 2). Tensor-parallel (Megatron): qkv and gate_up are column-parallel,
o_proj and down_proj row-parallel, the embedding and LM head vocab-parallel; attention runs on this rank's
heads (see :mod:`lqe.layers.linear`).
"""
from __future__ import annotations

import torch
from torch import nn

from lqe.layers.activation import get_act_and_mul
from lqe.layers.attention import Attention
from lqe.distributed.parallel_state import get_tp_size
from lqe.layers.embedding import VocabEmbedding, gather_logits
from lqe.layers.linear import ColumnParallelLinear, MergedLinear, QKVLinear, ReplicatedLinear, RowParallelLinear
from lqe.layers.norm import RMSNorm
from lqe.layers.rotary import get_rope
from lqe.loaders.hf_config import ModelConfig
from lqe.quant_layers.base import QuantConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, quant_config: QuantConfig | None, prefix: str,
                 dtype: torch.dtype, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                                  qkv_bias, quant_config, f"{prefix}.qkv_proj", dtype)
        self.q_size, self.kv_size = self.qkv_proj.output_sizes[0], self.qkv_proj.output_sizes[1]  # this rank's
        self.num_heads, self.num_kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        o_cls = RowParallelLinear if get_tp_size() > 1 else ReplicatedLinear
        self.o_proj = o_cls(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, o_bias, quant_config,
                            f"{prefix}.o_proj", dtype)
        self.rotary_emb = get_rope(self.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim ** -0.5, layer_idx)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.use_qk_norm = qk_norm

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.use_qk_norm:
            t = x.shape[0]
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).reshape(t, self.q_size)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.contiguous()))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, quant_config: QuantConfig | None, prefix: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, cfg.mlp_bias, quant_config,
                                         f"{prefix}.gate_up_proj", dtype)
        down_cls = RowParallelLinear if get_tp_size() > 1 else ReplicatedLinear
        self.down_proj = down_cls(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, quant_config,
                                          f"{prefix}.down_proj", dtype)
        self.act_fn = get_act_and_mul(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    # (producer, its only consumer), relative names: ops whose output is read by that one linear layer alone, which
    # may then take it pre-quantized (lqe.layers.act_quant_fusion, set after loading; forward is unchanged)
    act_quant_pairs = (("input_layernorm", "self_attn.qkv_proj"), ("post_attention_layernorm", "mlp.gate_up_proj"),
                       ("mlp.act_fn", "mlp.down_proj"))

    def __init__(self, cfg: ModelConfig, layer_idx: int, quant_config: QuantConfig | None, prefix: str,
                 dtype: torch.dtype, attn_kwargs: dict) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, quant_config, f"{prefix}.self_attn", dtype, **attn_kwargs)
        self.mlp = LlamaMLP(cfg, quant_config, f"{prefix}.mlp", dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, quant_config: QuantConfig | None, dtype: torch.dtype, attn_kwargs: dict) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, quant_config, f"model.layers.{i}", dtype, attn_kwargs)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # (fused parameter, checkpoint name, shard id)
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, cfg: ModelConfig, quant_config: QuantConfig | None, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.raw.get("use_sliding_window") or (cfg.raw.get("sliding_window") and cfg.model_type == "mistral"):
            raise ValueError("sliding-window attention is not supported; use a checkpoint without sliding_window")
        self.config = cfg
        self.model = LlamaModel(cfg, quant_config, dtype, self.attention_kwargs(cfg))
        head_cls = ColumnParallelLinear if get_tp_size() > 1 else ReplicatedLinear
        self.lm_head = head_cls(cfg.hidden_size, cfg.vocab_size, False, quant_config, "lm_head", dtype)
        self.tied = cfg.tie_word_embeddings and hasattr(self.lm_head, "weight") and self.lm_head.weight.shape == self.model.embed_tokens.weight.shape
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def attention_kwargs(cls, cfg: ModelConfig) -> dict:
        return {"qkv_bias": cfg.attention_bias, "o_bias": cfg.attention_bias, "qk_norm": False}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head.tp_size > 1:
            return gather_logits(self.lm_head(hidden))
        return self.lm_head(hidden)
