"""FP8 e4m3 (compressed-tensors ``float-quantized``; FORMATS.md §3.5): ``weight [N, K]`` float8_e4m3fn with
per-tensor (one per fused shard), per-channel ``[N, 1]`` or block ``[ceil(N/bh), ceil(K/bw)]`` scales.

Without FP8 hardware (CPU, pre-sm89 GPUs) this runs weight-only: each call dequantizes column blocks of the
fp8 weight into the activation dtype and multiplies; ``input_scale`` is read and validated but activations are
not quantized (vLLM's fallback on such GPUs is the same weight-only FP8 path)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lqe.quant_layers.base import LinearMethod, empty_param
from lqe.quant_layers.ct_scheme import CTScheme
from lqe.quant_layers.loading import FLOAT_DTYPES, add_param, drop_params, require_loaded
from lqe.quant_layers.w8a8 import per_shard_to_channel

FP8_DTYPES = (torch.float8_e4m3fn,)
CHUNK_ELEMS = 1 << 23


class FP8Method(LinearMethod):
    def __init__(self, scheme: CTScheme) -> None:
        self.s = scheme
        self.summary = ""
        bs = scheme.weights.block_structure or [128, 128]
        self.block = (int(bs[0]), int(bs[1]))

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype) -> None:
        n, k, shards, strategy = sum(output_sizes), input_size, len(output_sizes), self.s.weights.strategy
        add_param(layer, "weight", empty_param((n, k), torch.float8_e4m3fn, output_dim=0, input_dim=1), FP8_DTYPES, hint=self.s.dtype_hint)
        if strategy == "channel":
            add_param(layer, "weight_scale", empty_param((n, 1), torch.float32, output_dim=0), FLOAT_DTYPES)
        elif strategy == "block":
            bh, bw = self.block
            bad = [s for s in output_sizes[:-1] if s % bh]
            if bad:
                raise ValueError(f"{layer.prefix} (fp8 block {bh}x{bw}): fused shard sizes {bad} must be multiples of {bh}")
            rows = lambda size: -(-size // bh)  # noqa: E731
            add_param(layer, "weight_scale", empty_param((sum(rows(s) for s in output_sizes), -(-k // bw)), torch.float32,
                                                         output_dim=0, packed_dim=0), FLOAT_DTYPES, packed_size=rows)
        else:
            add_param(layer, "weight_scale", empty_param((shards,), torch.float32), FLOAT_DTYPES, mode="per_shard")
        a = self.s.input_activations
        if a is not None and not a.dynamic:
            add_param(layer, "input_scale", empty_param((shards,), torch.float32), FLOAT_DTYPES, mode="per_shard")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        require_loaded(layer, ["weight", "weight_scale"])
        strategy = self.s.weights.strategy
        scale = layer.weight_scale.data.float()
        if strategy == "tensor":
            scale = per_shard_to_channel(scale, layer.output_sizes).reshape(-1, 1)
        layer.register_buffer("fp8_weight", layer.weight.data)
        layer.register_buffer("fp8_scale", scale.to(layer.params_dtype))
        drop_params(layer, ["weight", "weight_scale", "input_scale"])
        gran = f"block {self.block[0]}x{self.block[1]}" if strategy == "block" else strategy
        self.summary = f"fp8 e4m3 {gran} weights, weight-only dequant-matmul ({layer.fp8_weight.device.type})"

    def dequant_rows(self, layer: nn.Module, n0: int, n1: int, dtype: torch.dtype) -> torch.Tensor:
        w = layer.fp8_weight[n0:n1].to(dtype)
        s = layer.fp8_scale.to(dtype)
        if self.s.weights.strategy != "block":
            return w * s[n0:n1]
        bh, bw = self.block
        s = s[n0 // bh: -(-n1 // bh)].repeat_interleave(bh, 0)[: n1 - n0].repeat_interleave(bw, 1)[:, : w.shape[1]]
        return w * s

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = layer.fp8_weight.shape
        dt = layer.params_dtype if x.dtype not in FLOAT_DTYPES else x.dtype
        step = max(self.block[0], (CHUNK_ELEMS // k) // self.block[0] * self.block[0])
        outs = [F.linear(x.to(dt), self.dequant_rows(layer, n0, min(n, n0 + step), dt)) for n0 in range(0, n, step)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return (out if bias is None else out + bias.to(dt)).to(x.dtype)

    def describe(self, layer: nn.Module) -> str:
        return self.summary or "fp8 (weights not processed yet)"
