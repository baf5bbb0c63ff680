"""RMSNorm and SiLU-mul fused with the int8 quantization of their output, so a W8A8 layer reads int8 straight from
the op that produces its input (no float activation written and read back, no separate quantization launch).

* ``rms_norm_quant_int8(x, weight, eps, residual=None) -> (q int8 [..., K], scale fp32 [..., 1], residual | None)``
* ``silu_mul_quant_int8(x [..., 2I]) -> (q int8 [..., I], scale fp32 [..., 1])``
* ``rms_norm_quant_int8_any`` / ``silu_mul_quant_int8_any``: every activation scheme of a W8A8 layer, returning
  ``(q, scale, azp | None[, residual])``: dynamic per token symmetric (the above), dynamic per token asymmetric
  (``symmetric=False``: ``scale [..., 1]``, ``azp int32 [..., 1]``) and static per tensor (``scale=`` the layer's
  fp32 ``[1]`` input scale, optional ``azp=`` int32 ``[1]``: returned as given, read in the kernel, no host sync).

Contract: EXACTLY the bits of the unfused path. The float activation is first rounded to the activation dtype as
:func:`lqe.kernels.fused_ops.rms_norm` / :func:`~lqe.kernels.fused_ops.silu_and_mul` round it (the kernels below run
the same row code, and the norm launches with the same BLOCK / num_warps, hence the same reduction order), then
quantized like :func:`lqe.kernels.act_quant_ref.per_token_quant_int8` and csrc/gemm/quant_per_token.cu:
``scale = absmax / 127`` and ``inv = 127 / absmax`` as correctly rounded fp32 quotients (``tl.div_rn``),
``q = sat(round_half_even(y * inv))``; an all-zero row gives scale 0 and q 0. Rounding: the product is clamped to
[-128, 127] (which commutes with rounding to an integer there), then ``(v + 1.5 * 2^23) - 1.5 * 2^23`` rounds it to
the nearest integer, ties to even, in plain IEEE adds that run the same under Triton's interpreter (which has no
``libdevice.rint``). The residual of the residual-add form is the one ``rms_norm`` returns.

Asymmetric, as :func:`~lqe.kernels.act_quant_ref.per_token_quant_int8` ``(symmetric=False)``: ``scale = (max - min)
/ 255``, ``azp = rne(-128 - min / scale)``, ``q = sat(rne(y / scale) + azp)`` (fp32 quotients and sums, the same
operations in the same order; ``rne`` exact for every finite fp32, :func:`_rint`); a row with ``max == min`` gives
scale 0, azp 0, q 0. Static, as :func:`~lqe.kernels.act_quant_ref.static_quant_int8`: ``q = sat(rne(y / scale) +
azp)``, computed as ``rne(clamp(y / scale, -128 - azp, 127 - azp)) + azp`` (equal for an integer ``azp``: clamping
to integer bounds commutes with rounding; the link pass offers the fusion only for ``|azp| <= 2^15``).

NaN (int8 has no NaN code; behaviour left as it is, unlike the fp8 quantizers, which keep NaN: fused_quant_fp8.py):
on a GPU the kernels' ``tl.minimum`` / ``tl.maximum`` compile to PTX ``min.f32`` / ``max.f32``, which return the
non-NaN operand, so a NaN activation drops out of its row's absmax / min / max (the scale is the other values') and
its own code saturates to -128 (the clamp's lower bound); the torch references give a NaN scale for the row and
cast NaN to an implementation-defined int8. Triton's interpreter runs min / max through numpy, which treats NaN as
its version chooses, so the CPU tests do not pin the GPU's behaviour. A NaN activation is a model fault either way,
but on the Triton path the layer's output row stays finite (and wrong) rather than NaN.

The torch twins (``*_torch``) compose :func:`~lqe.kernels.fused_ops.rms_norm_torch` /
:func:`~lqe.kernels.fused_ops.silu_and_mul_torch` with the reference quantizer: the CPU path and the ground truth.
The Triton path runs for CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``); ``use_triton=False`` forces the
twin. Rows need a contiguous last dimension. Nothing here syncs with the host: CUDA-graph capturable.
"""
from __future__ import annotations

import torch

from lqe.kernels.fused_ops import (HAS_TRITON, ROW_CHUNK, _rows, _triton_ok, rms_norm_launch, rms_norm_torch,
                                   row_warps, silu_and_mul_torch)
from lqe.kernels.triton_pdl import pdl_args, pdl_start

if HAS_TRITON:
    import triton
    import triton.language as tl

    from lqe.kernels.fused_ops import _rms_norm_row, _silu_and_mul_row

SILU_CHUNK = ROW_CHUNK  # columns of a SiLU-mul row held at once; longer rows take a max pass, then a quantize pass


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why the fused norm / activation int8 kernels cannot serve layers on ``device``, or ``None``. On CPU the torch
    twins serve (they are the unfused CPU path, op for op)."""
    if torch.device(device).type == "cuda" and not HAS_TRITON:
        return "triton is not importable"
    return None


# ------------------------------------------------------------------------------------------------ torch twins
def _quant_rows(y: torch.Tensor, symmetric: bool = True, scale: torch.Tensor | None = None,
                azp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    from lqe.kernels.act_quant_ref import per_token_quant_int8, static_quant_int8

    y2 = y.reshape(-1, y.shape[-1])
    if scale is not None:
        return static_quant_int8(y2, scale, azp).view(y.shape), scale, azp
    q, s, z = per_token_quant_int8(y2, symmetric)
    return q.view(y.shape), s.view(*y.shape[:-1], 1), None if z is None else z.view(*y.shape[:-1], 1)


def rms_norm_quant_int8_any_torch(x, weight, eps, residual=None, symmetric=True, scale=None, azp=None):
    out = rms_norm_torch(x, weight, eps, residual)
    y, new_residual = out if residual is not None else (out, None)
    return (*_quant_rows(y, symmetric, scale, azp), new_residual)


def silu_mul_quant_int8_any_torch(x, symmetric=True, scale=None, azp=None):
    return _quant_rows(silu_and_mul_torch(x), symmetric, scale, azp)


def rms_norm_quant_int8_torch(x, weight, eps, residual=None):
    q, s, _, r = rms_norm_quant_int8_any_torch(x, weight, eps, residual)
    return q, s, r


def silu_mul_quant_int8_torch(x):
    return silu_mul_quant_int8_any_torch(x)[:2]


# ------------------------------------------------------------------------------------------------ kernels
SYM, ASYM, STATIC = 0, 1, 2  # MODE of the kernels below

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
    def _rint(v):
        """Round half to even, every finite fp32: ``|v| + 2^23`` rounds ``|v| < 2^23`` to an integer (ties to even:
        2^23 is even), larger values are integers already."""
        a = tl.abs(v)
        r = (a + 8388608.0) - 8388608.0
        return tl.where(a < 8388608.0, tl.where(v < 0, -r, r), v)

    @triton.jit
    def _stats(y, mask, hi, lo, MODE: tl.constexpr):
        """Fold the columns ``y`` into the running per-lane ``hi`` (absmax, or max for ASYM) and ``lo`` (min)."""
        if MODE == 0:
            hi = tl.maximum(hi, tl.abs(y))  # masked lanes are 0
        elif MODE == 1:
            hi = tl.maximum(hi, tl.where(mask, y, float("-inf")))
            lo = tl.minimum(lo, tl.where(mask, y, float("inf")))
        return hi, lo

    @triton.jit
    def _params(hi, lo, SS, ZP, MODE: tl.constexpr, HAS_AZP: tl.constexpr):
        """``(scale, a, b)`` of a row from its folded stats: SYM ``a = 127/absmax``; ASYM ``a = scale or 1``, ``b =
        azp``; STATIC the layer's scale and zero point (``a = scale``, ``b = azp``, fp32)."""
        if MODE == 0:
            scale, a = _scale_and_inverse(tl.max(hi, 0))
            b = 0.0
        elif MODE == 1:
            xmax = tl.max(hi, 0)
            xmin = tl.min(lo, 0)
            scale = tl.div_rn(xmax - xmin, 255.0)
            a = tl.where(scale > 0, scale, 1.0)
            b = tl.where(scale > 0, _rint(-128.0 - tl.div_rn(xmin, a)), 0.0)
        else:
            scale = tl.load(SS).to(tl.float32)
            a = scale
            if HAS_AZP:
                b = tl.load(ZP).to(tl.float32)
            else:
                b = 0.0
        return scale, a, b

    @triton.jit
    def _quantize(y, scale, a, b, MODE: tl.constexpr):
        if MODE == 0:
            q = _to_int8(y, a)
        elif MODE == 1:
            v = tl.minimum(tl.maximum(_rint(tl.div_rn(y, a)) + b, -128.0), 127.0)
            q = tl.where(scale > 0, v, 0.0).to(tl.int8)
        else:  # clamp to integer bounds first (commutes with rounding), so the 1.5 * 2^23 shifter is exact
            v = tl.minimum(tl.maximum(tl.div_rn(y, a), -128.0 - b), 127.0 - b)
            q = (((v + 12582912.0) - 12582912.0) + b).to(tl.int8)
        return q

    @triton.jit
    def _store_params(S, Z, row, scale, b, MODE: tl.constexpr):
        if MODE != 2:
            tl.store(S + row, scale)
        if MODE == 1:
            tl.store(Z + row, b.to(tl.int32))

    @triton.jit
    def _rms_norm_quant_kernel(X, R, W, Q, S, Z, SS, ZP, ROut, stride_x, stride_r, stride_q, stride_ro, n, eps,
                               HAS_RESIDUAL: tl.constexpr, MODE: tl.constexpr, HAS_AZP: tl.constexpr,
                               BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)  # (lqe.kernels.triton_pdl)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        y = _rms_norm_row(X, R, W, ROut, row, stride_x, stride_r, stride_ro, n, eps, offs, mask, HAS_RESIDUAL)
        y = y.to(X.dtype.element_ty).to(tl.float32)  # the activation rms_norm would have written
        hi, lo = _stats(y, mask, tl.full([BLOCK], float("-inf"), tl.float32) if MODE == 1 else
                        tl.zeros([BLOCK], dtype=tl.float32), tl.full([BLOCK], float("inf"), tl.float32), MODE)
        scale, a, b = _params(hi, lo, SS, ZP, MODE, HAS_AZP)
        _store_params(S, Z, row, scale, b, MODE)
        tl.store(Q + row * stride_q + offs, _quantize(y, scale, a, b, MODE), mask=mask)

    @triton.jit
    def _silu_mul_quant_kernel(X, Q, S, Z, SS, ZP, stride_x, stride_q, n, MODE: tl.constexpr, HAS_AZP: tl.constexpr,
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
                y = _silu_and_mul_row(X, row, stride_x, n, cols, cols < n).to(X.dtype.element_ty).to(tl.float32)
                tl.store(Q + row * stride_q + cols, _quantize(y, scale, a, b, MODE), mask=cols < n)
        elif NUM_CHUNKS == 1:
            mask = offs < n
            y = _silu_and_mul_row(X, row, stride_x, n, offs, mask).to(X.dtype.element_ty).to(tl.float32)
            hi, lo = _stats(y, mask, hi, lo, MODE)
            scale, a, b = _params(hi, lo, SS, ZP, MODE, HAS_AZP)
            tl.store(Q + row * stride_q + offs, _quantize(y, scale, a, b, MODE), mask=mask)
        else:
            for c in range(NUM_CHUNKS):
                cols = c * CHUNK + offs
                mask = cols < n
                y = _silu_and_mul_row(X, row, stride_x, n, cols, mask).to(X.dtype.element_ty).to(tl.float32)
                hi, lo = _stats(y, mask, hi, lo, MODE)
            scale, a, b = _params(hi, lo, SS, ZP, MODE, HAS_AZP)
            for c in range(NUM_CHUNKS):  # recompute (elementwise, so the same bits) rather than keep the row
                cols = c * CHUNK + offs
                y = _silu_and_mul_row(X, row, stride_x, n, cols, cols < n).to(X.dtype.element_ty).to(tl.float32)
                tl.store(Q + row * stride_q + cols, _quantize(y, scale, a, b, MODE), mask=cols < n)
        _store_params(S, Z, row, scale, b, MODE)


# ------------------------------------------------------------------------------------------------ public ops
def _mode(symmetric: bool, scale: torch.Tensor | None, azp: torch.Tensor | None, device: torch.device) -> int:
    if scale is not None:
        if scale.numel() != 1 or (azp is not None and azp.numel() != 1):
            raise ValueError(f"static int8 quantization takes one scale (and zero point); got scale of shape "
                             f"{tuple(scale.shape)}" + ("" if azp is None else f", zero point {tuple(azp.shape)}"))
        if scale.device != device or (azp is not None and azp.device != device):
            raise ValueError(f"static scale / zero point must be on the activation's device {device}")
        return STATIC
    if azp is not None:
        raise ValueError("azp without scale: a zero point is only given for static quantization")
    return SYM if symmetric else ASYM


def _outputs(m: int, mode: int, device: torch.device):
    scale = torch.empty(m, 1, dtype=torch.float32, device=device) if mode != STATIC else None
    zp = torch.empty(m, 1, dtype=torch.int32, device=device) if mode == ASYM else None
    return scale, zp


def rms_norm_quant_int8_any(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                            symmetric: bool = True, scale: torch.Tensor | None = None, azp: torch.Tensor | None = None,
                            use_triton: bool | None = None):
    """``(q int8, scale, azp | None, new residual | None)`` of ``rms_norm(x, weight, eps, residual)`` in any int8
    activation scheme (module docstring)."""
    mode = _mode(symmetric, scale, azp, x.device)
    if not _triton_ok(x, use_triton) or x.numel() == 0:
        return rms_norm_quant_int8_any_torch(x, weight, eps, residual, symmetric, scale, azp)
    shape, n = x.shape, x.shape[-1]
    x2 = _rows(x, "x")
    m = x2.shape[0]
    q = torch.empty(x2.shape, dtype=torch.int8, device=x.device)
    s_out, z_out = _outputs(m, mode, x.device)
    r2 = _rows(residual, "residual") if residual is not None else x2
    r_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if residual is not None else x2
    block, warps = rms_norm_launch(n)
    _rms_norm_quant_kernel[(m,)](
        x2, r2, weight, q, q if s_out is None else s_out, q if z_out is None else z_out, q if scale is None else scale,
        q if azp is None else azp, r_out, x2.stride(0), r2.stride(0), q.stride(0), r_out.stride(0), n, float(eps),
        HAS_RESIDUAL=residual is not None, MODE=mode, HAS_AZP=azp is not None, BLOCK=block, num_warps=warps,
        **pdl_args(x.device),
    )
    lead = shape[:-1]
    return (q.view(shape), scale if mode == STATIC else s_out.view(*lead, 1),
            azp if mode == STATIC else (None if z_out is None else z_out.view(*lead, 1)),
            r_out.view(shape) if residual is not None else None)


def silu_mul_quant_int8_any(x: torch.Tensor, symmetric: bool = True, scale: torch.Tensor | None = None,
                            azp: torch.Tensor | None = None, use_triton: bool | None = None):
    """``(q int8 [..., I], scale, azp | None)`` of ``silu_and_mul(x)`` for ``x [..., 2I]`` in any int8 activation
    scheme (module docstring)."""
    mode = _mode(symmetric, scale, azp, x.device)
    if not _triton_ok(x, use_triton) or x.numel() == 0:
        return silu_mul_quant_int8_any_torch(x, symmetric, scale, azp)
    n = x.shape[-1] // 2
    x2 = _rows(x, "x")
    m = x2.shape[0]
    q = torch.empty(m, n, dtype=torch.int8, device=x.device)
    s_out, z_out = _outputs(m, mode, x.device)
    chunk = min(SILU_CHUNK, triton.next_power_of_2(n))
    _silu_mul_quant_kernel[(m,)](x2, q, q if s_out is None else s_out, q if z_out is None else z_out,
                                 q if scale is None else scale, q if azp is None else azp, x2.stride(0), q.stride(0), n,
                                 MODE=mode, HAS_AZP=azp is not None, CHUNK=chunk, NUM_CHUNKS=triton.cdiv(n, chunk),
                                 num_warps=row_warps(chunk), **pdl_args(x.device))
    lead = x.shape[:-1]
    return (q.view(*lead, n), scale if mode == STATIC else s_out.view(*lead, 1),
            azp if mode == STATIC else (None if z_out is None else z_out.view(*lead, 1)))


def rms_norm_quant_int8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                        use_triton: bool | None = None):
    """``(q int8, scale fp32 [..., 1], new residual or None)`` of ``rms_norm(x, weight, eps, residual)``."""
    q, s, _, r = rms_norm_quant_int8_any(x, weight, eps, residual, use_triton=use_triton)
    return q, s, r


def silu_mul_quant_int8(x: torch.Tensor, use_triton: bool | None = None):
    """``(q int8 [..., I], scale fp32 [..., 1])`` of ``silu_and_mul(x)`` for ``x [..., 2I]``."""
    return silu_mul_quant_int8_any(x, use_triton=use_triton)[:2]
