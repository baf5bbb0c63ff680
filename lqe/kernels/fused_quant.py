"""RMSNorm and SiLU-mul fused with the dynamic per-token symmetric int8 quantization of their output, so a W8A8
layer reads int8 straight from the op that produces its input (no float activation written and read back, no
separate quantization launch).

* ``rms_norm_quant_int8(x, weight, eps, residual=None) -> (q int8 [..., K], scale fp32 [..., 1], residual | None)``
* ``silu_mul_quant_int8(x [..., 2I]) -> (q int8 [..., I], scale fp32 [..., 1])``

Contract: EXACTLY the bits of the unfused path. The float activation is first rounded to the activation dtype as
:func:`lqe.kernels.fused_ops.rms_norm` / :func:`~lqe.kernels.fused_ops.silu_and_mul` round it (the kernels below run
the same row code, and the norm launches with the same BLOCK / num_warps, hence the same reduction order), then
quantized like :func:`lqe.kernels.act_quant_ref.per_token_quant_int8` and csrc/gemm/quant_per_token.cu:
``scale = absmax / 127`` and ``inv = 127 / absmax`` as correctly rounded fp32 quotients (``tl.div_rn``),
``q = sat(round_half_even(y * inv))``; an all-zero row gives scale 0 and q 0. Rounding: the product is clamped to
[-128, 127] (which commutes with rounding to an integer there), then ``(v + 1.5 * 2^23) - 1.5 * 2^23`` rounds it to
the nearest integer, ties to even, in plain IEEE adds that run the same under Triton's interpreter (which has no
``libdevice.rint``). The residual of the residual-add form is the one ``rms_norm`` returns.

The torch twins (``*_torch``) compose :func:`~lqe.kernels.fused_ops.rms_norm_torch` /
:func:`~lqe.kernels.fused_ops.silu_and_mul_torch` with the reference quantizer: the CPU path and the ground truth.
The Triton path runs for CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``); ``use_triton=False`` forces the
twin. Rows need a contiguous last dimension. Nothing here syncs with the host: CUDA-graph capturable.
"""
from __future__ import annotations

import torch

from lqe.kernels.fused_ops import HAS_TRITON, _rows, _triton_ok, rms_norm_launch, rms_norm_torch, silu_and_mul_torch

if HAS_TRITON:
    import triton
    import triton.language as tl

    from lqe.kernels.fused_ops import _rms_norm_row, _silu_and_mul_row

SILU_CHUNK = 4096  # columns of a SiLU-mul row held at once; longer rows take a max pass, then a quantize pass


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why the fused norm / activation int8 kernels cannot serve layers on ``device``, or ``None``. On CPU the torch
    twins serve (they are the unfused CPU path, op for op)."""
    if torch.device(device).type == "cuda" and not HAS_TRITON:
        return "triton is not importable"
    return None


# ------------------------------------------------------------------------------------------------ torch twins
def _quant_rows(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from lqe.kernels.act_quant_ref import per_token_quant_int8

    q, s, _ = per_token_quant_int8(y.reshape(-1, y.shape[-1]), True)
    return q.view(y.shape), s.view(*y.shape[:-1], 1)


def rms_norm_quant_int8_torch(x, weight, eps, residual=None):
    out = rms_norm_torch(x, weight, eps, residual)
    y, new_residual = out if residual is not None else (out, None)
    return (*_quant_rows(y), new_residual)


def silu_mul_quant_int8_torch(x):
    return _quant_rows(silu_and_mul_torch(x))


# ------------------------------------------------------------------------------------------------ kernels
if HAS_TRITON:
    @triton.jit
    def _scale_and_inverse(absmax):
        scale = tl.div_rn(absmax, 127.0)
        inv = tl.where(absmax > 0, tl.div_rn(127.0, tl.where(absmax > 0, absmax, 1.0)), 0.0)
        return scale, inv

    @triton.jit
    def _to_int8(y, inv):
        # clamp, then round half to even with the 1.5 * 2^23 shifter: no multiply feeds an add (no fma contraction)
        v = tl.minimum(tl.maximum(y * inv, -128.0), 127.0)
        return ((v + 12582912.0) - 12582912.0).to(tl.int8)

    @triton.jit
    def _rms_norm_quant_kernel(X, R, W, Q, S, ROut, stride_x, stride_r, stride_q, stride_ro, n, eps,
                               HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        y = _rms_norm_row(X, R, W, ROut, row, stride_x, stride_r, stride_ro, n, eps, offs, mask, HAS_RESIDUAL)
        y = y.to(X.dtype.element_ty).to(tl.float32)  # the activation rms_norm would have written
        scale, inv = _scale_and_inverse(tl.max(tl.abs(y), 0))
        tl.store(S + row, scale)
        tl.store(Q + row * stride_q + offs, _to_int8(y, inv), mask=mask)

    @triton.jit
    def _silu_mul_quant_kernel(X, Q, S, stride_x, stride_q, n, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, CHUNK)
        if NUM_CHUNKS == 1:
            mask = offs < n
            y = _silu_and_mul_row(X, row, stride_x, n, offs, mask).to(X.dtype.element_ty).to(tl.float32)
            scale, inv = _scale_and_inverse(tl.max(tl.abs(y), 0))
            tl.store(Q + row * stride_q + offs, _to_int8(y, inv), mask=mask)
        else:
            absmax = tl.zeros([CHUNK], dtype=tl.float32)
            for c in range(NUM_CHUNKS):
                cols = c * CHUNK + offs
                y = _silu_and_mul_row(X, row, stride_x, n, cols, cols < n).to(X.dtype.element_ty).to(tl.float32)
                absmax = tl.maximum(absmax, tl.abs(y))
            scale, inv = _scale_and_inverse(tl.max(absmax, 0))
            for c in range(NUM_CHUNKS):  # recompute (elementwise, so the same bits) rather than keep the row
                cols = c * CHUNK + offs
                y = _silu_and_mul_row(X, row, stride_x, n, cols, cols < n).to(X.dtype.element_ty).to(tl.float32)
                tl.store(Q + row * stride_q + cols, _to_int8(y, inv), mask=cols < n)
        tl.store(S + row, scale)


# ------------------------------------------------------------------------------------------------ public ops
def rms_norm_quant_int8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                        use_triton: bool | None = None):
    """``(q int8, scale fp32 [..., 1], new residual or None)`` of ``rms_norm(x, weight, eps, residual)``."""
    if not _triton_ok(x, use_triton) or x.numel() == 0:
        return rms_norm_quant_int8_torch(x, weight, eps, residual)
    shape, n = x.shape, x.shape[-1]
    x2 = _rows(x, "x")
    m = x2.shape[0]
    q = torch.empty(x2.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    r2 = _rows(residual, "residual") if residual is not None else x2
    r_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if residual is not None else x2
    block, warps = rms_norm_launch(n)
    _rms_norm_quant_kernel[(m,)](
        x2, r2, weight, q, scale, r_out, x2.stride(0), r2.stride(0), q.stride(0), r_out.stride(0), n, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps,
    )
    return q.view(shape), scale.view(*shape[:-1], 1), (r_out.view(shape) if residual is not None else None)


def silu_mul_quant_int8(x: torch.Tensor, use_triton: bool | None = None):
    """``(q int8 [..., I], scale fp32 [..., 1])`` of ``silu_and_mul(x)`` for ``x [..., 2I]``."""
    if not _triton_ok(x, use_triton) or x.numel() == 0:
        return silu_mul_quant_int8_torch(x)
    n = x.shape[-1] // 2
    x2 = _rows(x, "x")
    m = x2.shape[0]
    q = torch.empty(m, n, dtype=torch.int8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    chunk = min(SILU_CHUNK, triton.next_power_of_2(n))
    _silu_mul_quant_kernel[(m,)](x2, q, scale, x2.stride(0), q.stride(0), n, CHUNK=chunk,
                                 NUM_CHUNKS=triton.cdiv(n, chunk), num_warps=min(8, max(1, chunk // 256)))
    return q.view(*x.shape[:-1], n), scale.view(*x.shape[:-1], 1)
