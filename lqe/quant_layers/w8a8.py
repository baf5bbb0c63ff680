"""W8A8 int8 (compressed-tensors ``int-quantized``, SmoothQuant-style; FORMATS.md §3.4).

Weights: symmetric int8 ``[N, K]`` with per-channel ``[N, 1]`` or per-tensor scales (one scalar per fused
shard, expanded per channel). Activations: dynamic per token, or static per tensor (``input_scale``, max over
fused shards), symmetric or asymmetric (``input_zero_point``; ``azp * colsum(W)`` correction). int8 x int8
with int32 accumulation (``torch._int_mm`` where it works, else an exact float64 product), then the epilogue.
Weight-only int8 (no ``input_activations``) runs through :func:`select_w4a16_kernel` (the lqe W8A16 CUDA kernel on
a GPU, else :class:`Int8WeightOnly`).

On a CUDA device the layer keeps the checkpoint's int8 ``[N, K]`` weight (plus, only when the table names the lqe
CUDA kernel, its fragment-packed copy) and the kernel for each call's token count M comes from the W8A8_TABLE of
:mod:`lqe.kernels.dispatch` (:func:`lqe.kernels.w8a8.plan_w8a8` / :func:`lqe.kernels.w8a8.w8a8_apply`: Triton int8
GEMM, cuBLASLt ``torch._int_mm`` + Triton epilogue, or the lqe CUDA kernel; all with the scales, zero-point
correction and bias in the epilogue). Dynamic per-token activations are quantized by the CUDA kernel of
csrc/gemm/quant_per_token.cu (bit-exact with :func:`reference.per_token_quant_int8`; without the lqe extension by the
Triton quantizer of lqe/kernels/triton_act_quant.py, the same bits), static per-tensor ones by that Triton quantizer.
Any of them may instead arrive quantized from the RMSNorm / SiLU-mul that produced them, bit for bit as the layer
would quantize them (:meth:`W8A8Int8Method.input_quant`, :class:`QuantizedActivation`, :mod:`lqe.layers.act_quant_fusion`).
When no kernel can run, the torch path above runs and the reason is logged once per layer kind.
"""
from __future__ import annotations

import torch
from torch import nn

from lqe.quant_layers import reference as ref
from lqe.quant_layers.base import LinearMethod, empty_param
from lqe.kernels.canonical import CanonicalWeight
from lqe.quant_layers.ct_scheme import CTScheme
from lqe.quant_layers.loading import FLOAT_DTYPES, INT_DTYPES, add_param, drop_params, require_loaded
from lqe.quant_layers.quantized_activation import (INT8_PER_TOKEN_ASYM, INT8_PER_TOKEN_SYM, INT8_STATIC,
                                                   ActQuant, QuantizedActivation)
from lqe.quant_layers.wna16_kernels import cuda_kernels_declined, layer_kind, log_fallback_once, select_w4a16_kernel

_INT_MM_BROKEN: set[str] = set()


def int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact ``a [M,K] int8 @ b [K,N] int8 -> int32``."""
    dev = a.device.type
    if dev not in _INT_MM_BROKEN:
        try:
            return torch._int_mm(a, b)
        except RuntimeError:
            if dev == "cpu":
                _INT_MM_BROKEN.add(dev)
    return (a.double() @ b.double()).to(torch.int32)  # |acc| <= K * 2^14 < 2^53: exact


def plan_w8a8_cuda(w_nk: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype, asymmetric: bool):
    """``(W8A8Weights, description)`` for the W8A8 kernels of the dispatch table, or ``(None, reason)``; never
    raises."""
    why = cuda_kernels_declined(w_nk.device)
    if why is not None:
        return None, why
    try:
        from lqe.kernels import w8a8 as kw

        return kw.plan_w8a8(w_nk, w_scale, dtype, asymmetric)
    except Exception as e:  # noqa: BLE001 -- any failure here must leave the torch path usable
        return None, f"lqe W8A8 kernels failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def per_shard_to_channel(values: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """One scalar per fused shard -> one value per output channel."""
    return torch.cat([values[i].reshape(1).expand(s) for i, s in enumerate(sizes)])


def merge_static_input(scales: torch.Tensor, zps: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused shards share one activation quantizer: symmetric -> the max scale; asymmetric -> the range that
    covers every shard's range, re-derived as one (scale, zero point)."""
    if zps is None:
        return scales.max().reshape(1), None
    lo = (scales * (-128 - zps.float())).min()
    hi = (scales * (127 - zps.float())).max()
    if bool((scales == scales[0]).all()) and bool((zps == zps[0]).all()):
        return scales[:1].clone(), zps[:1].to(torch.int32).clone()
    scale = (hi - lo) / 255.0
    return scale.reshape(1), torch.round(-128 - lo / scale).to(torch.int32).reshape(1)


def _per_token_quant_tp(x: torch.Tensor, symmetric: bool):
    """Per-token int8 quantization of a row-parallel shard of the activations with the scale of the *whole* row,
    as with one rank: each token's min and max are all-reduced and appended as two extra columns, so the
    reference quantizer sees the global range and computes the same bits; the extra columns are dropped."""
    from lqe.distributed.comm import tp_all_reduce_op

    xf = x.float()
    lo = tp_all_reduce_op(xf.amin(dim=-1, keepdim=True).contiguous(), "min")
    hi = tp_all_reduce_op(xf.amax(dim=-1, keepdim=True).contiguous(), "max")
    q, scale, azp = ref.per_token_quant_int8(torch.cat([xf, lo, hi], dim=-1), symmetric)
    return q[:, :-2].contiguous(), scale, azp


def check_quantized_input(method: LinearMethod, layer: nn.Module, x: QuantizedActivation) -> None:
    """A pre-quantized input must be in the scheme the layer offered (a static one with the layer's own scale)."""
    spec = method.input_quant(layer)
    if spec is None or spec.scheme != x.scheme or (spec.scale is not None and x.scale is not spec.scale):
        raise ValueError(f"{getattr(layer, 'prefix', 'layer')}: got a {x.scheme} activation but this layer takes "
                         f"{spec or 'only float'} input ({method.describe(layer)})")


class W8A8Int8Method(LinearMethod):
    supports_tensor_parallel = True

    def __init__(self, scheme: CTScheme) -> None:
        self.s = scheme
        self.summary = ""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype) -> None:
        n, k, shards = sum(output_sizes), input_size, len(output_sizes)
        hint = self.s.dtype_hint
        add_param(layer, "weight", empty_param((n, k), torch.int8, output_dim=0, input_dim=1), (torch.int8,), hint=hint)
        if self.s.weights.strategy == "channel":
            add_param(layer, "weight_scale", empty_param((n, 1), torch.float32, output_dim=0), FLOAT_DTYPES)
        else:
            add_param(layer, "weight_scale", empty_param((shards,), torch.float32), FLOAT_DTYPES, mode="per_shard")
        a = self.s.input_activations
        if a is not None and not a.dynamic:
            add_param(layer, "input_scale", empty_param((shards,), torch.float32), FLOAT_DTYPES, mode="per_shard")
            if not a.symmetric:
                add_param(layer, "input_zero_point", empty_param((shards,), torch.int32), INT_DTYPES, mode="per_shard")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        a = self.s.input_activations
        static = a is not None and not a.dynamic
        names = ["weight", "weight_scale"] + (["input_scale"] if static else []) + (["input_zero_point"] if static and not a.symmetric else [])
        require_loaded(layer, names)
        ws = layer.weight_scale.data.float()
        s_w = ws.reshape(-1) if self.s.weights.strategy == "channel" else per_shard_to_channel(ws, layer.output_sizes)
        w = layer.weight.data
        declined = cuda_kernels_declined(w.device)
        cuda = declined is None
        if a is None:
            cw = CanonicalWeight((w.to(torch.int16) + 128).to(torch.uint8).t().contiguous(), s_w.reshape(1, -1), None, None, 8, -1)
            kernel, _ = select_w4a16_kernel(cw, w.device, layer.params_dtype)
            layer.qkernel = kernel
            if cuda and getattr(kernel, "why", ""):
                log_fallback_once(layer_kind(layer, "w8a16 int8"), kernel.why)
            self.summary = f"w8a16 int8 {self.s.weights.strategy}, {kernel.describe()}"
        else:
            plan, why = plan_w8a8_cuda(w, s_w, layer.params_dtype, not a.symmetric) if cuda else (None, "")
            if plan is not None:
                layer.register_buffer("w8a8_w", plan.w_nk)  # int8 [N, K] (None when only lqe-w8a8 is used)
                layer.register_buffer("w8a8_qweight", None if plan.packed is None else plan.packed.qweight)
                layer.register_buffer("w8a8_w_scale", plan.w_scale)
                layer.register_buffer("w8a8_colsum", plan.colsum)
                layer.w8a8_plan = (plan.table, plan.k, plan.n)
            else:
                layer.register_buffer("w_int8_t", w.t().contiguous())
                layer.register_buffer("w_scale", s_w.contiguous())
                layer.register_buffer("azp_adj", None if a.symmetric else w.to(torch.int64).sum(dim=1))
            if static:
                zps = None if a.symmetric else layer.input_zero_point.data
                s_in, z_in = merge_static_input(layer.input_scale.data.float(), zps)
                layer.register_buffer("in_scale", s_in)
                layer.register_buffer("in_zp", z_in)
                layer.in_zp_fusable = z_in is None or int(z_in.abs().max()) <= 1 << 15  # read here, not per call
            act = f"{'static per-tensor' if static else 'dynamic per-token'} {'sym' if a.symmetric else 'asym'}"
            if plan is not None:
                mm = f"cuda {why}"
            else:
                mm = "torch._int_mm" if "cpu" not in _INT_MM_BROKEN else "exact fallback"
                if cuda:
                    log_fallback_once(layer_kind(layer, "w8a8 int8"), why)
                    mm = f"{mm} ({w.device.type}; {why})"
                else:
                    mm = f"{mm} ({w.device.type}; {declined})" if w.device.type == "cuda" else f"{mm} ({w.device.type})"
            self.summary = f"w8a8 int8 {self.s.weights.strategy} weights, {act} activations, {mm}"
        drop_params(layer, ["weight", "weight_scale", "input_scale", "input_zero_point"])

    def input_quant(self, layer: nn.Module) -> ActQuant | None:
        """On the CUDA kernels' path, one tensor-parallel rank (a row-parallel shard needs the all-reduced range): the
        producing op may quantize the activations (RMSNorm / SiLU-mul fused with the quantization,
        :mod:`lqe.kernels.fused_quant`), bit for bit as ``_w8a8_cuda`` would: dynamic per token, symmetric or
        asymmetric, or static with this layer's scale and zero point (when ``|zero point| <= 2^15``, the fused
        kernel's exact range; calibrated zero points lie in [-128, 127])."""
        a = self.s.input_activations
        if a is None or getattr(layer, "tp_mode", None) is not None or getattr(layer, "w8a8_plan", None) is None:
            return None
        if a.dynamic:
            return ActQuant(INT8_PER_TOKEN_SYM if a.symmetric else INT8_PER_TOKEN_ASYM)
        if not layer.in_zp_fusable:
            return None
        return ActQuant(INT8_STATIC, scale=layer.in_scale, zero_point=layer.in_zp)

    def apply(self, layer: nn.Module, x: torch.Tensor | QuantizedActivation,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(x, QuantizedActivation):
            return self._apply_quantized(layer, x, bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.s.input_activations is None:
            out = layer.qkernel(x2, bias)
        else:
            out = self._w8a8(layer, x2, bias)
        return out.reshape(*shape[:-1], out.shape[-1]).to(x.dtype)

    def _w8a8(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        a = self.s.input_activations
        if getattr(layer, "w8a8_plan", None) is not None:
            return self._w8a8_cuda(layer, x, bias)
        if a.dynamic and getattr(layer, "tp_mode", None) == "row":
            x_q, s_a, azp = _per_token_quant_tp(x, a.symmetric)
        elif a.dynamic:
            x_q, s_a, azp = ref.per_token_quant_int8(x, a.symmetric)
        else:
            s_a, azp = layer.in_scale, layer.in_zp
            x_q = ref.static_quant_int8(x, s_a, azp)
        acc = int8_mm(x_q, layer.w_int8_t)
        if azp is not None:
            acc = acc.to(torch.int64) - azp.to(torch.int64).reshape(-1, 1) * layer.azp_adj
        out = (s_a.reshape(-1, 1) * layer.w_scale) * acc.to(torch.float32)
        return out if bias is None else out + bias.float()

    def _apply_quantized(self, layer: nn.Module, x: QuantizedActivation, bias: torch.Tensor | None) -> torch.Tensor:
        """The input came quantized (in this layer's scheme, :meth:`input_quant`) from the op that produced it: the
        int8 GEMM + epilogue of the CUDA path, without the quantization; output dtypes as for a float input."""
        check_quantized_input(self, layer, x)
        xq, s_a, azp = x.rows()
        out = self._w8a8_cuda(layer, None, bias, (xq, s_a, azp, layer.params_dtype))
        return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)

    def _w8a8_cuda(self, layer: nn.Module, x: torch.Tensor | None, bias: torch.Tensor | None,
                   quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.dtype] | None = None
                   ) -> torch.Tensor:
        from lqe.kernels import w8a8 as kw
        from lqe.kernels.repack import PackedW8A8

        a = self.s.input_activations
        table, k, n = layer.w8a8_plan
        packed = None
        if layer.w8a8_qweight is not None:
            packed = PackedW8A8(layer.w8a8_qweight, layer.w8a8_w_scale, layer.w8a8_colsum, k, n)
        wts = kw.W8A8Weights(layer.w8a8_w, layer.w8a8_w_scale, layer.w8a8_colsum, packed, table, k, n)
        if quantized is not None:  # from the producing op (input_quant)
            xq, s_a, azp, dtype = quantized
        else:
            x = x.to(layer.params_dtype)
            dtype = x.dtype
            if a.dynamic:
                xq, s_a, azp = kw.quantize_per_token_any(x, a.symmetric)
            else:
                s_a, azp = layer.in_scale, layer.in_zp
                xq = kw.quantize_static(x, s_a, azp, use_triton=None if layer.in_zp_fusable else False)
        if bias is not None:
            bias = bias.to(dtype).contiguous()
        return kw.w8a8_apply(xq, s_a, wts, azp, bias, dtype)

    def describe(self, layer: nn.Module) -> str:
        return self.summary or "w8a8 int8 (weights not processed yet)"
