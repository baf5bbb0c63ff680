"""W8A8 int8 GEMM with fused scales (csrc/gemm/w8a8_gemm.cu), per-token int8 activation quantization
(csrc/gemm/quant_per_token.cu), the per-M-bucket choice between them and the Triton / cuBLASLt int8 paths
(:func:`plan_w8a8`, :func:`w8a8_apply`; lqe/kernels/triton_w8a8.py, the W8A8_TABLE of lqe/kernels/dispatch.py),
and FP8 W8A8 through ``torch._scaled_mm`` (Hopper / Ada)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from lqe.kernels import gemm
from lqe.kernels.device_info import device_key
from lqe.kernels.gemm import BLOCK_N, counters, ext, plan_slabs_per_split
from lqe.kernels.repack import PackedW8A8, repack_w8a8, w8a8_unsupported

FP8_MAX = 448.0  # float8_e4m3fn


def quantize_per_token(x: torch.Tensor, symmetric: bool = True):
    """``x [M, K]`` fp16/bf16 -> ``(q int8 [M, K], scale fp32 [M], azp int32 [M] or None)``."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    m = x2.shape[0]
    q = torch.empty_like(x2, dtype=torch.int8)
    scale = torch.empty(m, dtype=torch.float32, device=x2.device)
    azp = None if symmetric else torch.empty(m, dtype=torch.int32, device=x2.device)
    ext().quantize_per_token(x2, q, scale, azp)
    return q, scale, azp


def w8a8_gemm(xq: torch.Tensor, a_scale: torch.Tensor, packed: PackedW8A8, azp: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
              out: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """``a_scale[m] * w_scale[n] * (xq @ Wq - azp[m] * colsum[n]) + bias[n]``; ``a_scale`` per token ``[M]`` or
    a static per-tensor scalar."""
    m = xq.shape[0]
    a_scale = a_scale.float().reshape(-1)
    if a_scale.numel() == 1 and m != 1:
        a_scale = a_scale.expand(m)
    a_scale = a_scale.contiguous()
    if azp is not None:
        azp = azp.to(torch.int32).reshape(-1).expand(m).contiguous()
    if out is None:
        out = torch.empty(m, packed.n, dtype=out_dtype, device=xq.device)
    spp = plan_slabs_per_split(m, packed.n, packed.k, xq.device, 32, 2, splits)
    cnt = counters(xq.device, math.ceil(packed.n / BLOCK_N) * math.ceil(m / 16))
    ext().w8a8_gemm(xq.contiguous(), a_scale, azp, packed.qweight, packed.w_scale,
                    packed.colsum if azp is not None else None, bias, out, spp, cnt)
    return out


def w8a8_linear(x: torch.Tensor, packed: PackedW8A8, bias: torch.Tensor | None = None,
                symmetric: bool = True) -> torch.Tensor:
    """Dynamic per-token quantization then the int8 GEMM, output in ``x``'s dtype."""
    lead = x.shape[:-1]
    q, s, azp = quantize_per_token(x, symmetric)
    return w8a8_gemm(q, s, packed, azp, bias, x.dtype).view(*lead, packed.n)


def quantize_static(x: torch.Tensor, scale: torch.Tensor, azp: torch.Tensor | None = None,
                    use_triton: bool | None = None) -> torch.Tensor:
    """Static per-tensor int8 quantization ``sat(round(x / scale) (+ azp))``, the bits of
    :func:`lqe.kernels.act_quant_ref.static_quant_int8`: one Triton launch on a GPU
    (:func:`lqe.kernels.triton_act_quant.quant_int8`; exact for ``|azp| <= 2^22 - 128``: pass ``use_triton=False``
    for a zero point that may lie beyond), torch ops elsewhere."""
    from lqe.kernels import triton_act_quant as taq

    if use_triton is not False and taq.use_triton_for(x):
        return taq.quant_int8(x, scale=scale.float().reshape(1), azp=None if azp is None else
                              azp.to(torch.int32).reshape(1), use_triton=True)[0].view(x.shape)
    q = torch.round(x.float() / scale.float())
    if azp is not None:
        q = q + azp.float()
    return q.clamp(-128, 127).to(torch.int8)


def w8a8_linear_static(x: torch.Tensor, packed: PackedW8A8, scale: torch.Tensor, azp: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """Static per-tensor activation quantization (``scale``/``azp`` one element each) then the int8 GEMM with the
    same epilogue as the dynamic path (the scalar scale / zero point broadcast over tokens)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    q = quantize_static(x2, scale, azp)
    return w8a8_gemm(q, scale, packed, azp, bias, x.dtype).view(*lead, packed.n)


def select_w8a8_kernel(wq_kn: torch.Tensor, w_scale: torch.Tensor, device: torch.device | str,
                       dtype: torch.dtype) -> tuple[PackedW8A8 | None, str]:
    """Repack int8 ``wq_kn [K, N]`` (math orientation) with per-channel ``w_scale [N]`` for the lqe W8A8 kernel:
    ``(packed, description)``, else ``(None, reason)`` listing every reason."""
    device = torch.device(device)
    k, n = wq_kn.shape
    reasons = []
    if device.type != "cuda":
        reasons.append(f"device is {device.type}, lqe-w8a8 needs cuda")
    if dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"activation dtype {dtype} (lqe-w8a8 needs float16 or bfloat16)")
    shape_reason = w8a8_unsupported(k, n)
    if shape_reason:
        reasons.append(shape_reason)
    if device.type == "cuda" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 0):
            reasons.append(f"compute capability {cap[0]}.{cap[1]} < 8.0 (mma.sync s8 m16n8k32 needs Ampere+)")
    if not reasons and not gemm.available():
        reasons.append(str(gemm.unavailable_reason()))
    if reasons:
        return None, "lqe-w8a8 unavailable: " + "; ".join(reasons)
    packed = repack_w8a8(wq_kn.to(device), w_scale.to(device))
    return packed, f"lqe-w8a8 int8 GEMM (K={k}, N={n})"


KERNELS = ("triton-w8a8", "int-mm+epilogue", "triton-gemv", "lqe-w8a8")
# the rows that can run triton-w8a8 (:func:`w8a8_apply`): int-mm+epilogue reroutes M <= 16 to it (cuBLASLt refuses
# them), triton-gemv M > 16 (the GEMV serves M <= 16)
TRITON_W8A8_FALLBACKS = frozenset({"triton-w8a8", "int-mm+epilogue", "triton-gemv"})


@dataclass(slots=True)
class W8A8Weights:
    """One W8A8 layer's weights in the layouts its kernel table needs, and that table resolved for it."""
    w_nk: torch.Tensor | None  # int8 [N, K], K contiguous (triton-w8a8, int-mm+epilogue, triton-gemv)
    w_scale: torch.Tensor  # float32 [N]
    colsum: torch.Tensor | None  # int32 [N] = sum_k W[n, k]; only for asymmetric activations
    packed: PackedW8A8 | None  # the lqe-w8a8 CUDA kernel's layout, only when the table names it
    table: tuple[tuple[int | None, str], ...]  # W8A8_TABLE with every row this layer cannot run replaced
    k: int
    n: int


def kernel_unsupported(name: str, k: int, n: int, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why kernel ``name`` of W8A8_TABLE cannot run a ``K x N`` layer here, or ``None``. Host-only."""
    if name not in KERNELS:
        return f"unknown W8A8 kernel {name!r} (known: {', '.join(KERNELS)})"
    if device.type != "cuda":
        return f"device is {device.type}, {name} needs cuda"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"activation dtype {dtype} ({name} needs float16 or bfloat16)"
    if torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 0):
        return f"{name} needs compute capability 8.0+ (int8 tensor cores)"
    if name == "lqe-w8a8":
        why = w8a8_unsupported(k, n)
        if why is None and not gemm.available():
            why = str(gemm.unavailable_reason())
        return why
    from lqe.kernels import triton_w8a8 as tw

    why = tw.available()
    if why is None and name == "int-mm+epilogue":
        why = tw.int_mm_unsupported(17, n, k)
    return why


def plan_w8a8(w_nk: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype, asymmetric: bool,
              table: list[tuple[int | None, str]] | None = None) -> tuple[W8A8Weights | None, str]:
    """Lay out int8 ``w_nk [N, K]`` (the checkpoint's orientation, on its device) with per-channel ``w_scale``
    for the kernels W8A8_TABLE names: ``(weights, description)``, or ``(None, every reason)`` when no kernel of
    the table can run (the caller keeps its torch path). A row whose kernel cannot run this layer falls back to
    the first kernel of ``KERNELS`` that can. Only a table naming lqe-w8a8 (or a layer no other kernel can run)
    gets the fragment-packed second copy, through :func:`select_w8a8_kernel`."""
    from lqe.kernels.dispatch import W8A8_TABLE

    table = list(table or W8A8_TABLE)
    device = w_nk.device
    n, k = w_nk.shape
    why = {name: kernel_unsupported(name, k, n, device, dtype) for name in KERNELS if name != "lqe-w8a8"}
    named = {name for _, name in table}
    packed, lqe_desc = None, ""
    if "lqe-w8a8" in named or all(v is not None for v in why.values()):
        packed, lqe_desc = select_w8a8_kernel(w_nk.t(), w_scale, device, dtype)
        why["lqe-w8a8"] = None if packed is not None else lqe_desc.removeprefix("lqe-w8a8 unavailable: ")
    else:
        why["lqe-w8a8"] = "not named by W8A8_TABLE (it needs a second, fragment-packed copy of the weights)"
    ok = [name for name in KERNELS if why[name] is None]
    if not ok:
        return None, "no W8A8 kernel can run: " + "; ".join(f"{nm} unavailable: {why[nm]}" for nm in KERNELS)
    rows, notes = [], []
    for max_m, name in table:
        use = name if why.get(name, "unknown") is None else ok[0]
        if use != name:
            notes.append(f"{name} -> {use}: {why.get(name) or 'unknown kernel name'}")
        rows.append((max_m, use))
    used = {nm for _, nm in rows}
    if packed is not None and "lqe-w8a8" not in used:
        packed = None
    w_scale = w_scale.float().reshape(-1).expand(n).contiguous().to(device)
    w = w_nk.contiguous() if used - {"lqe-w8a8"} else None
    colsum = None
    if asymmetric:
        colsum = packed.colsum if packed is not None else w_nk.to(torch.int32).sum(1, dtype=torch.int32)
    if used & TRITON_W8A8_FALLBACKS:  # triton-w8a8 itself, or a row w8a8_apply reroutes to it for some M: its
        from lqe.kernels import triton_w8a8 as tw  # split-K workspace must not grow later (inside a graph capture)

        tw.reserve_workspace(device, tw.workspace_rows(), n)
    if "triton-gemv" in used:
        from lqe.kernels import triton_gemv_w8a8 as tg

        tg.reserve_workspace(device, n)
    descs = [lqe_desc] if "lqe-w8a8" in used else []
    descs += [f"{nm} int8 GEMM (K={k}, N={n})" for nm in KERNELS if nm in used and nm != "lqe-w8a8"]
    by_m = ", ".join(f"M<={mm}: {nm}" if mm is not None else f"else {nm}" for mm, nm in rows)
    desc = " + ".join(descs) + f" [{by_m}]" + (" (" + "; ".join(notes) + ")" if notes else "")
    return W8A8Weights(w, w_scale, colsum, packed, tuple(rows), k, n), desc


def w8a8_apply(xq: torch.Tensor, a_scale: torch.Tensor, wts: W8A8Weights, azp: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The int8 GEMM + epilogue of :func:`w8a8_gemm` through the kernel the layer's table picks for this M (a
    host function of the shape: no sync, nothing data-dependent, CUDA-graph capturable)."""
    from lqe.kernels import triton_w8a8 as tw
    from lqe.kernels.dispatch import pick

    m = xq.shape[0]
    name = pick(list(wts.table), m)
    if name == "int-mm+epilogue" and m <= 16:  # cuBLASLt refuses M <= 16
        name = "triton-w8a8" if wts.w_nk is not None else "lqe-w8a8"
    if name == "triton-gemv":
        if m <= 16:
            from lqe.kernels import triton_gemv_w8a8 as tg

            return tg.gemv_w8a8(xq, a_scale, wts.w_nk, wts.w_scale, azp, wts.colsum, bias, out_dtype)
        name = "triton-w8a8"  # the GEMV serves M <= 16 only
    if name == "lqe-w8a8" and wts.packed is not None:
        if azp is not None and wts.packed.colsum is None:
            raise ValueError("lqe-w8a8: asymmetric activations need the weight's colsum")
        return w8a8_gemm(xq, a_scale, wts.packed, azp, bias, out_dtype)
    if name == "int-mm+epilogue":
        return tw.int_mm_w8a8(xq, a_scale, wts.w_nk, wts.w_scale, azp, wts.colsum, bias, out_dtype)
    return tw.w8a8_mm(xq, a_scale, wts.w_nk, wts.w_scale, azp, wts.colsum, bias, out_dtype)


def quantize_per_token_any(x: torch.Tensor, symmetric: bool = True):
    """Dynamic per-token int8 quantization of ``x [..., K]`` -> ``(q [M, K], scale [M], azp [M] | None)``, the bits of
    :func:`lqe.kernels.act_quant_ref.per_token_quant_int8`: :func:`quantize_per_token` (CUDA kernel) when the lqe
    extension is built, else the Triton quantizer (:mod:`lqe.kernels.triton_act_quant`: one launch) on a GPU, else
    the torch reference."""
    if x.device.type == "cuda" and gemm.available():
        return quantize_per_token(x, symmetric)
    from lqe.kernels import triton_act_quant as taq

    q, s, azp = taq.quant_int8(x.reshape(-1, x.shape[-1]), symmetric)
    return q, s.reshape(-1), None if azp is None else azp.reshape(-1)


def fp8_supported(device: torch.device | str | None = None) -> str | None:
    """Why FP8 ``_scaled_mm`` cannot run here, or ``None``."""
    if not torch.cuda.is_available():
        return "CUDA not available"
    if not hasattr(torch, "float8_e4m3fn"):
        return "this torch has no float8_e4m3fn"
    cap = torch.cuda.get_device_capability(device)
    return None if cap >= (8, 9) else f"compute capability {cap[0]}.{cap[1]} < 8.9 (no FP8 tensor cores)"


def fp8_quantize_weight(w_kn: torch.Tensor):
    """``[K, N]`` float -> (fp8 ``[N, K]`` row-major, fp32 per-channel scale ``[1, N]``)."""
    s = (w_kn.float().abs().amax(0).clamp(min=1e-12) / FP8_MAX)
    q = (w_kn.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.t().contiguous(), s.reshape(1, -1).contiguous()


def fp8_quantize_per_token(x: torch.Tensor, use_triton: bool | None = None):
    """``[M, K]`` -> (fp8 ``[M, K]``, fp32 ``[M, 1]``) dynamic per-token scales, the bits of
    :func:`lqe.kernels.fused_quant_fp8.quant_fp8_ref`: one Triton launch on an FP8 GPU
    (:func:`lqe.kernels.triton_act_quant.quant_fp8`; torch on CUDA would divide by 448 through its reciprocal), the
    torch ops below elsewhere."""
    from lqe.kernels import triton_act_quant as taq

    if use_triton is not False and taq.use_triton_for(x, fp8=True):
        return taq.quant_fp8(x, use_triton=True)
    s = (x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX)
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def fp8_quantize_group(x: torch.Tensor, group: int, use_triton: bool | None = None):
    """``[M, K]`` -> (fp8 ``[M, K]``, fp32 ``[M, K / group]``) dynamic 1 x ``group`` scales (the activations of
    block-scaled weights), the bits of :func:`lqe.kernels.fused_quant_fp8.quant_fp8_ref`: one Triton launch on an FP8
    GPU, the reference elsewhere."""
    from lqe.kernels import triton_act_quant as taq

    return taq.quant_fp8(x, group, use_triton=False if use_triton is False else None)


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq_nk: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 W8A8 via ``torch._scaled_mm`` with row-wise (per-token x per-channel) scales."""
    return torch._scaled_mm(xq, wq_nk.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=out_dtype)


def fp8_quantize_static(x: torch.Tensor, scale: torch.Tensor, use_triton: bool | None = None):
    """``[M, K]`` -> (fp8 ``[M, K]``, fp32 ``[M, 1]``) with one static per-tensor scale (one Triton launch on an FP8
    GPU, torch ops elsewhere; the same bits)."""
    from lqe.kernels import triton_act_quant as taq

    s = scale.float().reshape(1, 1)
    if use_triton is not False and taq.use_triton_for(x, fp8=True):
        q = taq.quant_fp8(x, scale=s.reshape(1), use_triton=True)[0]
    else:
        q = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s.expand(x.shape[0], 1).contiguous()


def fp8_linear(x: torch.Tensor, wq_nk: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
               input_scale: torch.Tensor | None = None):
    """FP8 W8A8 linear, output in ``x``'s dtype: dynamic per-token activation scales, or the static per-tensor
    ``input_scale``. Row-wise ``_scaled_mm`` writes bfloat16, and float16 where this torch / GPU does
    (:func:`fp8_scaled_mm_dtype`: torch 2.11 does, older builds refuse; a probe per device); other activation
    dtypes are computed in bfloat16 and cast back."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    xq, xs = fp8_quantize_per_token(x2) if input_scale is None else fp8_quantize_static(x2, input_scale)
    return _scaled_mm_to(xq, xs, wq_nk, w_scale.float().reshape(1, -1), bias, x.dtype).view(*lead, wq_nk.shape[0])


def _scaled_mm_to(xq: torch.Tensor, xs: torch.Tensor, wq_nk: torch.Tensor, ws: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Row-wise ``_scaled_mm`` with its output in ``out_dtype``: written directly (bias of that dtype in the GEMM's
    epilogue) when :func:`fp8_scaled_mm_dtype` says torch writes it on this device, else in bfloat16, cast, and the
    bias added after."""
    mm_dtype = fp8_scaled_mm_dtype(xq.device, out_dtype)
    if mm_dtype == out_dtype:
        return fp8_gemm(xq, xs, wq_nk, ws, None if bias is None else bias.to(out_dtype), out_dtype)
    out = fp8_gemm(xq, xs, wq_nk, ws, None, mm_dtype).to(out_dtype)
    return out if bias is None else out + bias.to(out_dtype)


# device key -> whether row-wise torch._scaled_mm writes float16 (with a float16 bias) correctly there
_FP16_OUT_PROBED: dict[str, bool] = {}


def fp8_scaled_mm_dtype(device: torch.device | str, out_dtype: torch.dtype) -> torch.dtype:
    """The output dtype to ask row-wise ``torch._scaled_mm`` for when the caller wants ``out_dtype``: bfloat16 (every
    torch writes it), or float16 itself where a one-time probe on this device (cached per device, like
    :func:`fp8_rowwise_reason`'s) finds torch writing float16 with a float16 bias correctly (torch 2.11's row-wise
    scaling takes bf16 or fp16 output: "Only bf16 and fp16 high precision output types are supported"; older builds
    took bf16 only). Not probed inside a CUDA-graph capture (the
    probe synchronizes): there, until an eager call has probed, bfloat16 (the load-time
    :func:`fp8_rowwise_reason` probe runs it first)."""
    if out_dtype != torch.float16:
        return torch.bfloat16
    key = device_key(device)
    if key not in _FP16_OUT_PROBED:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.bfloat16
        _FP16_OUT_PROBED[key] = _probe_fp16_out(torch.device(key))
    return torch.float16 if _FP16_OUT_PROBED[key] else torch.bfloat16


def _probe_fp16_out(device: torch.device) -> bool:
    """One tiny row-wise ``_scaled_mm`` with float16 output and bias on ``device`` against the fp32 math of the same
    fp8 operands; False when torch refuses it or it is wrong. Deterministic inputs (the CUDA RNG does not move)."""
    try:
        w = torch.linspace(-1.0, 1.0, 64 * 32, device=device).reshape(64, 32)
        x = torch.linspace(-2.0, 2.0, 3 * 64, device=device).reshape(3, 64)
        wq, ws = fp8_quantize_weight(w)
        xq, xs = fp8_quantize_per_token(x, use_triton=False)
        bias = torch.linspace(-1.0, 1.0, 32, device=device)
        y = fp8_gemm(xq, xs, wq, ws, bias.half(), torch.float16)
        ref = (xq.float() * xs) @ (wq.float() * ws.reshape(-1, 1)).t() + bias
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (y.dtype == torch.float16 and y.shape == (3, 32)
                and bool(((y.float() - ref).abs() <= 1e-2 * ref.abs().max() + 1e-2).all()))
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False


FP8_KERNELS = ("triton-gemv", "scaled-mm", "triton-fp8")


def fp8_apply(xq: torch.Tensor, x_scale: torch.Tensor, wq_nk: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
              table: list[tuple[int | None, str]] | None = None) -> torch.Tensor:
    """FP8 W8A8 product of quantized activations (per token ``[M]``/``[M, 1]`` or one static scale) and a per-channel
    (or per-tensor, expanded) fp8 weight ``[N, K]``, through the kernel FP8_TABLE (lqe/kernels/dispatch.py) picks for
    M: the Triton GEMV (M <= 16), ``torch._scaled_mm`` (row-wise scales; bf16 output, or fp16 where torch writes it:
    :func:`fp8_scaled_mm_dtype`) or the Triton fp8 GEMM.
    Host-only choice: CUDA-graph capturable."""
    from lqe.kernels.dispatch import FP8_TABLE, pick

    m = xq.shape[0]
    name = pick(table or FP8_TABLE, m)
    if not (xq.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        name = "scaled-mm"  # Triton kernels need a GPU (or the interpreter); torch._scaled_mm also runs on CPU
    if name == "triton-gemv" and m <= 16:
        from lqe.kernels import triton_gemv_w8a8 as tg

        if tg.available() is None:
            return tg.gemv_w8a8(xq, x_scale, wq_nk, w_scale, bias=bias, out_dtype=out_dtype)
    if name == "triton-fp8":
        from lqe.kernels import triton_fp8 as tf

        return tf.fp8_mm(xq, x_scale, wq_nk, w_scale, bias, out_dtype)
    xs = x_scale.float().reshape(-1, 1)
    xs = xs.expand(m, 1).contiguous() if xs.shape[0] != m else xs
    return _scaled_mm_to(xq, xs, wq_nk, w_scale.float().reshape(1, -1), bias, out_dtype)


def fp8_block_apply(x: torch.Tensor, wq_nk: torch.Tensor, w_block_scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Block-scaled FP8 (128 x 128 weight blocks) of float ``x [M, K]``: 1 x 128 dynamic activation groups
    (:func:`fp8_quantize_group`: one Triton launch on the GPU; the fused producers of lqe/kernels/fused_quant_fp8.py
    emit the same bits), then the Triton kernel."""
    from lqe.kernels import triton_fp8 as tf

    xq, xs = fp8_quantize_group(x, tf.SCALE_BLOCK)
    return fp8_block_apply_quantized(xq, xs, wq_nk, w_block_scale, bias, x.dtype)


FP8_BLOCK_KERNELS = ("triton-fp8-block",)


def fp8_block_apply_quantized(xq, xs, wq_nk, w_block_scale, bias=None, out_dtype=torch.bfloat16,
                              table: list[tuple[int | None, str]] | None = None):
    """Block-scaled FP8 of quantized activations (``xs [M, ceil(K/128)]``) through the kernel FP8_BLOCK_TABLE
    (lqe/kernels/dispatch.py) picks for M: the Triton block-scaled GEMM is the only one today. Host-only choice."""
    from lqe.kernels import triton_fp8 as tf
    from lqe.kernels.dispatch import FP8_BLOCK_TABLE, pick

    name = pick(table or FP8_BLOCK_TABLE, xq.shape[0])
    if name not in FP8_BLOCK_KERNELS:
        raise ValueError(f"FP8_BLOCK_TABLE names {name!r}; block-scaled fp8 kernels: {', '.join(FP8_BLOCK_KERNELS)}")
    return tf.fp8_mm(xq, xs, wq_nk, w_block_scale, bias, out_dtype, block_scale=True)


def reserve_fp8_workspaces(device: torch.device | str, n: int, block: bool = False,
                           table: list[tuple[int | None, str]] | None = None) -> None:
    """Grow the split-K workspaces of every kernel an FP8 layer with ``n`` outputs can run to their final size (at
    load, before any CUDA-graph capture: growing allocates, and would replace buffers a captured graph holds):
    FP8_TABLE's rows (``block``: FP8_BLOCK_TABLE's) or ``table``. Both workspaces are ``WS_ROWS x n`` whatever M, so
    this covers every batch size."""
    from lqe.kernels.dispatch import FP8_BLOCK_TABLE, FP8_TABLE

    names = {nm for _, nm in (table or (FP8_BLOCK_TABLE if block else FP8_TABLE))}
    if "triton-gemv" in names:
        from lqe.kernels import triton_gemv_w8a8 as tg

        if tg.available() is None:
            tg.reserve_workspace(device, n)
    if names & {"triton-fp8", "triton-fp8-block"}:
        from lqe.kernels import triton_fp8 as tf

        if tf.available() is None:
            tf.reserve_workspace(device, n)

_FP8_PROBED: dict[str, str | None] = {}


def fp8_rowwise_reason(device: torch.device | str) -> str | None:
    """Why :func:`fp8_linear` (row-wise scaled ``torch._scaled_mm``) cannot run on ``device``, or ``None``.
    Beyond :func:`fp8_supported`, runs one tiny product per device (cached) so a torch build without row-wise
    scaling for this GPU is a reason, not a crash at the first forward."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"device is {device.type}, fp8 _scaled_mm needs cuda"
    why = fp8_supported(device)
    if why is not None:
        return why
    key = str(device if device.index is not None else torch.device("cuda", torch.cuda.current_device()))
    if key not in _FP8_PROBED:
        try:
            # deterministic inputs: the probe must not advance the CUDA RNG
            w = torch.linspace(-1.0, 1.0, 64 * 32, device=device).reshape(64, 32)
            x = torch.linspace(-2.0, 2.0, 3 * 64, device=device).reshape(3, 64)
            wq, ws = fp8_quantize_weight(w)
            ok = True
            for dt in (torch.float16, torch.bfloat16):
                y = fp8_linear(x.to(dt), wq, ws, torch.ones(32, device=device, dtype=dt))
                ref = x @ w + 1.0
                ok = ok and y.shape == (3, 32) and bool(((y.float() - ref).abs() <= 0.1 * ref.abs().max() + 0.1).all())
            torch.cuda.synchronize(device)
            _FP8_PROBED[key] = None if ok else "torch._scaled_mm row-wise probe gave a wrong result"
        except (RuntimeError, TypeError, ValueError) as e:
            _FP8_PROBED[key] = f"torch._scaled_mm row-wise probe failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return _FP8_PROBED[key]
