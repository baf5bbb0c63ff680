"""Standalone activation quantization in one Triton launch, for a W8A8 / FP8 layer whose input has no fused producer
(o_proj reads the attention output; any layer when the fusion is off): the quantizers of
:mod:`lqe.kernels.fused_quant` / :mod:`lqe.kernels.fused_quant_fp8` without the norm / activation in front.

* ``quant_int8(x [M, K], symmetric=True, scale=None, azp=None) -> (q int8, scale, azp | None)``: dynamic per token,
  symmetric (``scale [M, 1]``) or asymmetric (``scale [M, 1]``, ``azp int32 [M, 1]``), or static per tensor
  (``scale=`` fp32 ``[1]``, optional ``azp=`` int32 ``[1]``: read in the kernel, returned as given);
* ``quant_fp8(x [M, K], group=0, scale=None) -> (q float8_e4m3fn, scale)``: dynamic per token (``scale [M, 1]``), per
  1 x ``group`` columns (``scale [M, K / group]``: the activations of 128 x 128 block-scaled weights), or static with
  one fp32 ``[1]`` scale (returned as given).

Contract: EXACTLY the bits of the torch references, for float16 / bfloat16 / float32 inputs:
:func:`lqe.kernels.act_quant_ref.per_token_quant_int8` / :func:`~lqe.kernels.act_quant_ref.static_quant_int8` (int8)
and :func:`lqe.kernels.fused_quant_fp8.quant_fp8_ref` / :func:`~lqe.kernels.fused_quant_fp8.quant_fp8_static_ref`
(fp8), evaluated on CPU where every quotient is the IEEE one. The arithmetic is the fused producers' own (the same
``@triton.jit`` helpers: correctly rounded ``tl.div_rn`` quotients, round half to even in plain IEEE adds), so a layer
quantizing for itself gets the bits its fused producer would have handed it. (torch on CUDA divides by a Python scalar
through its reciprocal, so the torch ops of :func:`lqe.kernels.w8a8.fp8_quantize_per_token` can differ from the
reference in the last bit of a scale there; this kernel does not.) An all-zero row gives int8 scale 0 / q 0 (azp 0)
and fp8 scale ``1e-12 / 448`` / q 0, as the references do. NaN: a NaN activation stays NaN in fp8
(:func:`lqe.kernels.fused_quant_fp8._fp8_codes`: the clamp propagates it); int8 has no NaN code, see
:mod:`lqe.kernels.fused_quant` for what a NaN becomes there.

One program per row; a row longer than :data:`CHUNK` columns takes a pass for its range, then a quantizing pass over
the (L2-resident) row again. Static and per-group quantization need no pass first. The Triton path runs for CUDA
tensors (and CPU tensors under ``TRITON_INTERPRET=1``), else the references run; ``use_triton=False`` forces them.
Nothing syncs with the host: CUDA-graph capturable.
"""
from __future__ import annotations

import torch

from lqe.kernels.fused_ops import HAS_TRITON, ROW_CHUNK, _triton_ok, row_warps
from lqe.kernels.triton_pdl import pdl_args, pdl_start

if HAS_TRITON:
    import triton
    import triton.language as tl

    from lqe.kernels.fused_quant import _params, _quantize, _stats, _store_params
    from lqe.kernels.fused_quant_fp8 import _fp8_codes, _fp8_store

CHUNK = ROW_CHUNK  # columns of a row held at once
SYM, ASYM, STATIC = 0, 1, 2  # int8 MODE, as lqe.kernels.fused_quant


def unavailable_reason(device: torch.device | str, fp8: bool = False) -> str | None:
    """Why the Triton quantizer cannot serve activations on ``device`` (``fp8``: e4m3 codes), or ``None``. Host-only."""
    device = torch.device(device)
    if not HAS_TRITON:
        return "triton is not importable"
    if device.type != "cuda":
        return None  # the interpreter (TRITON_INTERPRET=1) or the references
    if fp8 and torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 9):
        return "fp8 e4m3 conversion needs compute capability 8.9+"
    return None


def use_triton_for(x: torch.Tensor, fp8: bool = False) -> bool:
    """Whether :func:`quant_int8` / :func:`quant_fp8` run the kernel for ``x`` by default (CUDA tensors where
    :func:`unavailable_reason` finds nothing; CPU tensors only under the interpreter)."""
    return _triton_ok(x, None) and unavailable_reason(x.device, fp8) is None


# ------------------------------------------------------------------------------------------------ kernels
if HAS_TRITON:
    @triton.jit
    def _load_row(X, row, stride_x, cols, mask):
        return tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _int8_quant_kernel(X, Q, S, Z, SS, ZP, stride_x, stride_q, n, MODE: tl.constexpr, HAS_AZP: tl.constexpr,
                           CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)  # (lqe.kernels.triton_pdl)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, CHUNK)
        hi = tl.full([CHUNK], float("-inf"), tl.float32) if MODE == 1 else tl.zeros([CHUNK], dtype=tl.float32)
        lo = tl.full([CHUNK], float("inf"), tl.float32)
        if MODE == 2:  # the static scale needs no pass over the row first
            scale, a, b = _params(hi, lo, SS, ZP, MODE, HAS_AZP)
            for c in range(NUM_CHUNKS):
                cols = c * CHUNK + offs
                y = _load_row(X, row, stride_x, cols, cols < n)
                tl.store(Q + row * stride_q + cols, _quantize(y, scale, a, b, MODE), mask=cols < n)
        elif NUM_CHUNKS == 1:  # one read: the row stays in registers
            mask = offs < n
            y = _load_row(X, row, stride_x, offs, mask)
            hi, lo = _stats(y, mask, hi, lo, MODE)
            scale, a, b = _params(hi, lo, SS, ZP, MODE, HAS_AZP)
            tl.store(Q + row * stride_q + offs, _quantize(y, scale, a, b, MODE), mask=mask)
        else:
            for c in range(NUM_CHUNKS):
                cols = c * CHUNK + offs
                mask = cols < n
                hi, lo = _stats(_load_row(X, row, stride_x, cols, mask), mask, hi, lo, MODE)
            scale, a, b = _params(hi, lo, SS, ZP, MODE, HAS_AZP)
            for c in range(NUM_CHUNKS):
                cols = c * CHUNK + offs
                y = _load_row(X, row, stride_x, cols, cols < n)
                tl.store(Q + row * stride_q + cols, _quantize(y, scale, a, b, MODE), mask=cols < n)
        _store_params(S, Z, row, scale, b, MODE)

    @triton.jit
    def _fp8_quant_kernel(X, Q, S, SS, stride_x, stride_q, stride_s, n, GROUP: tl.constexpr, CHUNK: tl.constexpr,
                          NUM_CHUNKS: tl.constexpr, STATIC: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)  # (lqe.kernels.triton_pdl)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, CHUNK)
        if GROUP != 0:  # groups never straddle chunks (CHUNK % GROUP == 0): one pass
            for c in range(NUM_CHUNKS):
                cols = c * CHUNK + offs
                mask = cols < n
                _fp8_store(_load_row(X, row, stride_x, cols, mask), Q, S, row, stride_q, stride_s, cols, mask, n,
                           GROUP, CHUNK, c * (CHUNK // GROUP), SS, STATIC)
        elif STATIC:  # the scale is known before the row: one pass, no reduction
            for c in range(NUM_CHUNKS):
                cols = c * CHUNK + offs
                mask = cols < n
                _fp8_store(_load_row(X, row, stride_x, cols, mask), Q, S, row, stride_q, stride_s, cols, mask, n,
                           GROUP, CHUNK, 0, SS, STATIC)
        elif NUM_CHUNKS == 1:
            mask = offs < n
            scale = _fp8_store(_load_row(X, row, stride_x, offs, mask), Q, S, row, stride_q, stride_s, offs, mask, n,
                               GROUP, CHUNK, 0, SS, STATIC)
            tl.store(S + row * stride_s, scale)
        else:
            absmax = tl.zeros([CHUNK], dtype=tl.float32)
            for c in range(NUM_CHUNKS):
                cols = c * CHUNK + offs
                absmax = tl.maximum(absmax, tl.abs(_load_row(X, row, stride_x, cols, cols < n)))
            scale = tl.div_rn(tl.maximum(tl.max(absmax, 0), 1e-12), 448.0)
            for c in range(NUM_CHUNKS):
                cols = c * CHUNK + offs
                y = _load_row(X, row, stride_x, cols, cols < n)
                tl.store(Q + row * stride_q + cols, _fp8_codes(tl.div_rn(y, scale)), mask=cols < n)
            tl.store(S + row * stride_s, scale)


# ------------------------------------------------------------------------------------------------ host side
def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(n: int, chunk: int | None, group: int = 0) -> tuple[int, int, int]:
    """``(CHUNK, NUM_CHUNKS, num_warps)`` for rows of ``n``."""
    c = max(chunk or min(CHUNK, triton.next_power_of_2(max(n, 1))), group)
    return c, triton.cdiv(n, c), row_warps(c)


def quant_int8(x: torch.Tensor, symmetric: bool = True, scale: torch.Tensor | None = None,
               azp: torch.Tensor | None = None, use_triton: bool | None = None, chunk: int | None = None):
    """``(q int8 [M, K], scale, azp | None)`` of ``x [M, K]`` (float16 / bfloat16 / float32): per token (scale and azp
    ``[M, 1]``) or static with the given fp32 ``[1]`` scale and int32 ``[1]`` zero point (returned as given); the
    bits of :func:`~lqe.kernels.act_quant_ref.per_token_quant_int8` /
    :func:`~lqe.kernels.act_quant_ref.static_quant_int8`. A static zero point must satisfy ``|azp| <= 2^22 - 128``
    (the shifter's exact range; calibrated ones lie in [-128, 127]). ``chunk`` (a power of two) overrides the columns
    held at once (tests)."""
    from lqe.kernels.fused_quant import _mode, _outputs

    mode = _mode(symmetric, scale, azp, x.device)
    x2 = x.reshape(-1, x.shape[-1])
    if not (use_triton if use_triton is not None else use_triton_for(x)) or not HAS_TRITON or x2.numel() == 0:
        from lqe.kernels.act_quant_ref import per_token_quant_int8, static_quant_int8

        if mode == STATIC:
            return static_quant_int8(x2, scale, azp), scale, azp
        return per_token_quant_int8(x2, symmetric)
    x2 = _rows(x2)
    m, n = x2.shape
    q = torch.empty(m, n, dtype=torch.int8, device=x.device)
    s_out, z_out = _outputs(m, mode, x.device)
    c, nc, warps = _launch(n, chunk)
    _int8_quant_kernel[(m,)](x2, q, q if s_out is None else s_out, q if z_out is None else z_out,
                             q if scale is None else scale, q if azp is None else azp, x2.stride(0), q.stride(0), n,
                             MODE=mode, HAS_AZP=azp is not None, CHUNK=c, NUM_CHUNKS=nc, num_warps=warps,
                             **pdl_args(x.device))
    if mode == STATIC:
        return q, scale, azp
    return q, s_out, z_out


def quant_fp8(x: torch.Tensor, group: int = 0, scale: torch.Tensor | None = None, use_triton: bool | None = None,
              chunk: int | None = None):
    """``(q float8_e4m3fn [M, K], scale)`` of ``x [M, K]`` (float16 / bfloat16 / float32): per token (``scale [M, 1]``),
    per 1 x ``group`` columns (``[M, K / group]``) or static with the given fp32 ``[1]`` scale (returned as given);
    the bits of :func:`~lqe.kernels.fused_quant_fp8.quant_fp8_ref` /
    :func:`~lqe.kernels.fused_quant_fp8.quant_fp8_static_ref`."""
    from lqe.kernels.fused_quant_fp8 import _check_group, quant_fp8_ref, quant_fp8_static_ref

    x2 = x.reshape(-1, x.shape[-1])
    n = x2.shape[1]
    if scale is not None or group:
        _check_group(n, group, scale)
    if scale is not None and scale.device != x.device:
        raise ValueError(f"static fp8 scale must be on the activation's device {x.device}")
    if not (use_triton if use_triton is not None else use_triton_for(x, fp8=True)) or not HAS_TRITON or x2.numel() == 0:
        if scale is not None:
            return quant_fp8_static_ref(x2, scale), scale
        return quant_fp8_ref(x2, group)
    x2 = _rows(x2)
    m = x2.shape[0]
    ns = 1 if group == 0 else n // group
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn, device=x.device)
    out_scale = torch.empty(m, ns, dtype=torch.float32, device=x.device) if scale is None else scale
    c, nc, warps = _launch(n, chunk, group)
    _fp8_quant_kernel[(m,)](x2, q, out_scale, out_scale, x2.stride(0), q.stride(0),
                            out_scale.stride(0) if scale is None else 0, n, GROUP=group, CHUNK=c, NUM_CHUNKS=nc,
                            STATIC=scale is not None, num_warps=warps, **pdl_args(x.device))
    return q, out_scale
