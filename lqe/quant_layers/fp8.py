"""FP8 e4m3 (compressed-tensors ``float-quantized``; FORMATS.md §3.5): ``weight [N, K]`` float8_e4m3fn with
per-tensor (one per fused shard), per-channel ``[N, 1]`` or block ``[ceil(N/bh), ceil(K/bw)]`` scales.

Without FP8 hardware (CPU, pre-sm89 GPUs) this runs weight-only: each call dequantizes column blocks of the
fp8 weight into the activation dtype and multiplies; ``input_scale`` is read and validated but activations are
not quantized (vLLM's fallback on such GPUs is the same weight-only FP8 path).

On a GPU where :func:`lqe.kernels.fp8_rowwise_reason` finds row-wise scaled ``torch._scaled_mm`` working (Hopper /
Ada), checkpoints with quantized activations and per-tensor / per-channel weight scales run FP8 W8A8 through
:func:`lqe.kernels.fp8_linear` (dynamic per-token activation scales, or the static ``input_scale``: the max over
fused shards). Block-scaled 128 x 128 checkpoints with dynamic activations run the Triton block-scaled fp8 GEMM
(lqe/kernels/triton_fp8.py, 1 x 128 activation groups) on FP8 GPUs; weight-only checkpoints, and any GPU where the
kernels decline, use the dequant path, with the reason logged once per layer kind.

A layer that quantizes its own activations (no fused producer: o_proj) does it in one Triton launch on the GPU
(lqe/kernels/triton_act_quant.py, through :func:`lqe.kernels.w8a8.fp8_quantize_per_token` / ``_static`` / ``_group``).
On the two FP8 W8A8 paths with dynamic activations, the activations may instead arrive quantized (per token, or per
1 x 128 group for block-scaled weights) from the RMSNorm / SiLU-mul that produced them, bit for bit as the layer would
quantize them (:meth:`FP8Method.input_quant`, lqe/kernels/fused_quant_fp8.py, :mod:`lqe.layers.act_quant_fusion`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lqe.quant_layers.base import LinearMethod, empty_param
from lqe.quant_layers.ct_scheme import CTScheme
from lqe.quant_layers.loading import FLOAT_DTYPES, add_param, drop_params, is_loaded, require_loaded
from lqe.quant_layers.quantized_activation import FP8_PER_GROUP, FP8_PER_TOKEN, FP8_STATIC, ActQuant, QuantizedActivation
from lqe.quant_layers.w8a8 import check_quantized_input, per_shard_to_channel
from lqe.quant_layers.wna16_kernels import cuda_kernels_declined, layer_kind, log_fallback_once

FP8_DTYPES = (torch.float8_e4m3fn,)
CHUNK_ELEMS = 1 << 23


class FP8Method(LinearMethod):
    supports_tensor_parallel = True

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
            tp = getattr(layer, "tp_mode", None)
            # a tensor-parallel shard must hold whole scale blocks: every output shard on a column-parallel layer
            bad = [s for s in (output_sizes if tp == "column" else output_sizes[:-1]) if s % bh]
            if bad:
                why = f"tensor_parallel_size={layer.tp_size} leaves" if tp == "column" else "fused"
                raise ValueError(f"{layer.prefix} (fp8 block {bh}x{bw}): {why} shard sizes {bad}, which must be multiples of {bh}")
            if tp == "row" and k % bw:
                raise ValueError(f"{layer.prefix} (fp8 block {bh}x{bw}): tensor_parallel_size={layer.tp_size} splits K into "
                                 f"shards of {k}, which must be a multiple of the block width {bw}")
            rows = lambda size: -(-size // bh)  # noqa: E731
            add_param(layer, "weight_scale", empty_param((sum(rows(s) for s in output_sizes), -(-k // bw)), torch.float32,
                                                         output_dim=0, packed_dim=0, input_dim=1), FLOAT_DTYPES, packed_size=rows)
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
        device = layer.weight.device
        declined = cuda_kernels_declined(device)
        cuda = declined is None
        why = self.scaled_mm_reason(layer) if cuda else (declined if device.type == "cuda" else "")
        gran = f"block {self.block[0]}x{self.block[1]}" if strategy == "block" else strategy
        layer.register_buffer("fp8_weight", layer.weight.data)
        if cuda and why is None:
            a = self.s.input_activations
            layer.register_buffer("fp8_w_scale", scale.reshape(1, -1).contiguous())  # [1, N] float32
            static = not a.dynamic and is_loaded(layer, "input_scale")  # else dynamic per-token (never NaN scales)
            layer.register_buffer("fp8_in_scale", layer.input_scale.data.float().max().reshape(1) if static else None)
            act = "static per-tensor" if static else "dynamic per-token"
            self.summary = f"fp8 e4m3 {gran} weights, {act} fp8 activations, torch._scaled_mm (cuda)"
            self.reserve_workspaces(layer, block=False)
        elif cuda and strategy == "block" and self.s.input_activations is not None and \
                (why := self.block_kernel_reason(layer)) is None:
            # 128 x 128 weight blocks, 1 x 128 dynamic fp8 activation groups: the Triton block-scaled GEMM, every M
            layer.register_buffer("fp8_block_scale", scale.contiguous())  # [ceil(N/128), ceil(K/128)] float32
            self.summary = f"fp8 e4m3 {gran} weights, dynamic per-token-group (1x128) fp8 activations, triton-fp8-block (cuda)"
            self.reserve_workspaces(layer, block=True)
        else:
            layer.register_buffer("fp8_scale", scale.to(layer.params_dtype))
            where = device.type
            if cuda:
                log_fallback_once(layer_kind(layer, "fp8"), why)
            if why:
                where = f"{where}; {why}"
            self.summary = f"fp8 e4m3 {gran} weights, weight-only dequant-matmul ({where})"
        drop_params(layer, ["weight", "weight_scale", "input_scale"])

    @staticmethod
    def reserve_workspaces(layer: nn.Module, block: bool) -> None:
        """Grow the split-K workspaces of every kernel the layer's table can pick (the fp8 GEMV, the Triton fp8 GEMM)
        to their final size now, before any CUDA-graph capture: they depend on N alone, so no batch size grows them."""
        from lqe.kernels import w8a8 as kw

        kw.reserve_fp8_workspaces(layer.fp8_weight.device, layer.fp8_weight.shape[0], block)

    def scaled_mm_reason(self, layer: nn.Module) -> str | None:
        """Why this layer cannot run FP8 W8A8 through ``torch._scaled_mm``, or ``None``; never raises."""
        if self.s.input_activations is None:
            return "weight-only fp8 checkpoint (no input_activations)"
        if self.s.weights.strategy == "block":
            return "block-scaled fp8 weights (row-wise _scaled_mm needs per-tensor or per-channel scales)"
        if layer.params_dtype not in (torch.float16, torch.bfloat16):
            return f"activation dtype {layer.params_dtype} (fp8 _scaled_mm path needs float16 or bfloat16)"
        n, k = layer.weight.shape
        if k % 16 or n % 16:
            return f"shape K={k}, N={n}: torch._scaled_mm needs multiples of 16"
        try:
            import lqe.kernels as kernels

            reason = getattr(kernels, "fp8_rowwise_reason", None)
            if reason is None:
                return "lqe.kernels provides no fp8_rowwise_reason"
            return reason(layer.weight.device)
        except Exception as e:  # noqa: BLE001 -- any failure here must leave the dequant path usable
            return f"fp8 probe failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def block_kernel_reason(self, layer: nn.Module) -> str | None:
        """Why a block-scaled layer cannot run the Triton block-scaled fp8 GEMM (lqe/kernels/triton_fp8.py), or
        ``None``; never raises."""
        if self.s.weights.strategy != "block":
            return "not block-scaled"
        if self.s.input_activations is None or not self.s.input_activations.dynamic:
            return "block-scaled fp8 needs dynamic activations for the W8A8 kernel"
        if self.block != (128, 128):
            return f"block {self.block[0]}x{self.block[1]} (the Triton kernel takes 128x128)"
        n, k = layer.weight.shape
        if k % 128:
            return f"K={k} is not a multiple of 128"
        try:
            from lqe.kernels import triton_fp8
            from lqe.kernels.w8a8 import fp8_supported

            return triton_fp8.available() or fp8_supported(layer.weight.device)
        except Exception as e:  # noqa: BLE001 -- any failure here must leave the dequant path usable
            return f"triton-fp8 unavailable: {type(e).__name__}: {e}"

    def input_quant(self, layer: nn.Module) -> ActQuant | None:
        """fp8 activations on the FP8 W8A8 paths, one tensor-parallel rank: per token for ``_scaled_mm`` / the GEMV,
        or with the layer's static ``input_scale`` (its own buffer, read by the producer on the device), and per
        1 x 128 group for the block-scaled Triton GEMM."""
        if getattr(layer, "tp_mode", None) is not None:
            return None
        if getattr(layer, "fp8_w_scale", None) is not None:
            return ActQuant(FP8_PER_TOKEN) if layer.fp8_in_scale is None else ActQuant(FP8_STATIC,
                                                                                       scale=layer.fp8_in_scale)
        if getattr(layer, "fp8_block_scale", None) is not None:
            from lqe.kernels.triton_fp8 import SCALE_BLOCK

            return ActQuant(FP8_PER_GROUP, group=SCALE_BLOCK)
        return None

    def dequant_rows(self, layer: nn.Module, n0: int, n1: int, dtype: torch.dtype) -> torch.Tensor:
        w = layer.fp8_weight[n0:n1].to(dtype)
        s = layer.fp8_scale.to(dtype)
        if self.s.weights.strategy != "block":
            return w * s[n0:n1]
        bh, bw = self.block
        s = s[n0 // bh: -(-n1 // bh)].repeat_interleave(bh, 0)[: n1 - n0].repeat_interleave(bw, 1)[:, : w.shape[1]]
        return w * s

    def apply(self, layer: nn.Module, x: torch.Tensor | QuantizedActivation,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):  # from the producing op, in the scheme of input_quant
            from lqe.kernels import w8a8 as kw

            check_quantized_input(self, layer, x)
            xq, xs, _ = x.rows()
            dt = layer.params_dtype  # the unfused path's output dtype, as for a float input
            b = None if bias is None else bias.to(dt)
            if getattr(layer, "fp8_block_scale", None) is not None:
                out = kw.fp8_block_apply_quantized(xq, xs, layer.fp8_weight, layer.fp8_block_scale, b, dt)
            else:  # a static scale [1] goes per row, as fp8_quantize_static gives it to the unfused path
                xs = xs.reshape(-1, 1) if xs.numel() == xq.shape[0] else xs.reshape(1, 1).expand(xq.shape[0], 1)
                out = kw.fp8_apply(xq, xs.contiguous(), layer.fp8_weight, layer.fp8_w_scale, b, dt)
            return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)
        if getattr(layer, "fp8_w_scale", None) is not None:
            from lqe.kernels import w8a8 as kw

            xa = x.to(layer.params_dtype)
            x2 = xa.reshape(-1, xa.shape[-1]).contiguous()
            xq, xs = (kw.fp8_quantize_per_token(x2) if layer.fp8_in_scale is None
                      else kw.fp8_quantize_static(x2, layer.fp8_in_scale))
            # the kernel FP8_TABLE picks for M (lqe/kernels/dispatch.py): Triton GEMV for M <= 16, else _scaled_mm
            out = kw.fp8_apply(xq, xs, layer.fp8_weight, layer.fp8_w_scale, None if bias is None else bias.to(xa.dtype),
                               xa.dtype)
            return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)
        if getattr(layer, "fp8_block_scale", None) is not None:
            from lqe.kernels import w8a8 as kw

            xa = x.to(layer.params_dtype)
            out = kw.fp8_block_apply(xa.reshape(-1, xa.shape[-1]).contiguous(), layer.fp8_weight, layer.fp8_block_scale,
                                     None if bias is None else bias.to(xa.dtype))
            return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)
        n, k = layer.fp8_weight.shape
        dt = layer.params_dtype if x.dtype not in FLOAT_DTYPES else x.dtype
        step = max(self.block[0], (CHUNK_ELEMS // k) // self.block[0] * self.block[0])
        outs = [F.linear(x.to(dt), self.dequant_rows(layer, n0, min(n, n0 + step), dt)) for n0 in range(0, n, step)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return (out if bias is None else out + bias.to(dt)).to(x.dtype)

    def describe(self, layer: nn.Module) -> str:
        return self.summary or "fp8 (weights not processed yet)"
