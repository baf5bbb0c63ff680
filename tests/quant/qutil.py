"""Helpers for the quant-layer tests: build a (fused) layer, load per-shard tensors, process."""
from __future__ import annotations

import math

import torch

from lqe.layers.linear import MergedLinear, QKVLinear, ReplicatedLinear

PREFIX = "model.layers.0"


def make_layer(cfg, kind: str, k: int, sizes: list[int], dtype: torch.dtype = torch.float32, bias: bool = False):
    """kind: "plain" (one shard, ``o_proj``), "qkv" (sizes = q, k, v), "gate_up" (sizes = gate, up)."""
    if kind == "plain":
        return ReplicatedLinear(k, sizes[0], bias, cfg, f"{PREFIX}.self_attn.o_proj", dtype)
    if kind == "qkv":
        head = math.gcd(*sizes)
        return QKVLinear(k, head, sizes[0] // head, sizes[1] // head, bias, cfg, f"{PREFIX}.self_attn.qkv_proj", dtype)
    return MergedLinear(k, sizes, bias, cfg, f"{PREFIX}.mlp.gate_up_proj", dtype)


def shard_ids(layer) -> list:
    return [None] if len(layer.output_sizes) == 1 else list(layer.shard_ids)


def load(layer, per_shard: list[dict[str, torch.Tensor]]) -> None:
    """Load each shard's checkpoint tensors through ``layer.load_weight`` (as the engine loader does)."""
    for sid, tensors in zip(shard_ids(layer), per_shard):
        for name, t in tensors.items():
            layer.load_weight(name, getattr(layer, name), t, sid)


def build(cfg, kind: str, k: int, sizes: list[int], per_shard: list[dict[str, torch.Tensor]], dtype=torch.float32, bias=None):
    layer = make_layer(cfg, kind, k, sizes, dtype, bias is not None)
    load(layer, per_shard)
    if bias is not None:
        layer.load_weight("bias", layer.bias, bias, None)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))
