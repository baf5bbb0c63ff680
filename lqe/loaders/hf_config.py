"""The model's ``config.json``, read as plain JSON and normalised across transformers versions.

transformers 5 moved ``rope_theta`` / ``rope_scaling`` into ``rope_parameters``; both spellings are accepted.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ModelConfig:
    architectures: list[str]
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    torch_dtype: str | None
    eos_token_id: list[int]
    raw: dict[str, Any] = field(repr=False)

    @property
    def model_type(self) -> str:
        return str(self.raw.get("model_type", ""))


def read_config_json(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir} has no config.json: is it a Hugging Face model directory?")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); the checkpoint is corrupt or truncated") from e


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    cfg = dict(raw.get("text_config") or {}, **{k: v for k, v in raw.items() if k != "text_config"}) \
        if "hidden_size" not in raw and "text_config" in raw else raw

    def need(key: str) -> Any:
        if key not in cfg:
            raise ValueError(f"config.json lacks {key!r}, which this architecture needs")
        return cfg[key]

    heads = _num(need("num_attention_heads"), "num_attention_heads")
    hidden = _num(need("hidden_size"), "hidden_size")
    rope_params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or ({k: v for k, v in rope_params.items() if k != "rope_theta"} or None)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    eos = cfg.get("eos_token_id")
    eos_list = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    return ModelConfig(
        architectures=list(cfg.get("architectures") or []),
        hidden_size=hidden,
        intermediate_size=_num(need("intermediate_size"), "intermediate_size"),
        num_hidden_layers=_num(need("num_hidden_layers"), "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=_num(cfg.get("num_key_value_heads") or heads, "num_key_value_heads"),
        head_dim=_num(cfg.get("head_dim") or hidden // heads, "head_dim"),
        vocab_size=_num(need("vocab_size"), "vocab_size"),
        rms_norm_eps=_num(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", float),
        rope_theta=float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
        rope_scaling=scaling,
        max_position_embeddings=_num(cfg.get("max_position_embeddings", 2048), "max_position_embeddings"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        eos_token_id=eos_list,
        raw=raw,
    )


def _num(value: Any, key: str, kind: type = int):
    from lqe.quant_layers.checks import config_number  # lqe.quant_layers imports this package

    return config_number(value, key, "config.json", kind)
