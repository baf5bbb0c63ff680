"""RMSNorm and SiLU-mul fused with the dynamic fp8 e4m3 quantization of their output, per token or per 1 x G group
of columns (G = 128: the activation side of 128 x 128 block-scaled fp8 checkpoints, DeepSeek-V3 / llm-compressor).

* ``rms_norm_quant_fp8(x, weight, eps, residual=None, group=0) -> (q fp8 [..., K], scale fp32 [..., 1 | K/G], residual)``
* ``silu_mul_quant_fp8(x [..., 2I], group=0) -> (q fp8 [..., I], scale fp32 [..., 1 | I/G])``

With ``scale=`` (the consumer's static per-tensor fp32 ``[1]`` scale, read on the device) both quantize with it
instead, as :func:`lqe.kernels.w8a8.fp8_quantize_static` does: ``q = rne_e4m3(clamp(y / scale, -448, 448))``, no
reduction; the returned scale is that same tensor.

Contract: EXACTLY the bits of the unfused path: the float activation rounded to the activation dtype as
:func:`lqe.kernels.fused_ops.rms_norm` / :func:`~lqe.kernels.fused_ops.silu_and_mul` produce it (same row code, same
launch), then :func:`quant_fp8_ref` (what :func:`lqe.kernels.w8a8.fp8_quantize_per_token` computes):
``scale = max(absmax, 1e-12) / 448`` and ``q = rne_e4m3(clamp(y / scale, -448, 448))``, both quotients correctly
rounded fp32 (``tl.div_rn``; torch divides exactly on CPU and CUDA), the cast round-to-nearest-even as the GPU's
``cvt.rn.satfinite.e4m3x2.f32`` and torch's ``.to(float8_e4m3fn)`` do. An all-zero row (group) gets scale
``1e-12 / 448`` and q 0, as the torch path does.

NaN: a NaN activation gives a NaN code (the clamp propagates it: :func:`_fp8_codes`), as torch's clamp and cast do.
Its row's (group's) scale on the GPU is that of the other values (the max reduction drops NaN) where torch's amax
makes the whole row's scale and codes NaN; either way the GEMM's outputs of that row are NaN.
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

FP8_MAX = 448.0
MIN_ABSMAX = 1e-12
SILU_CHUNK = ROW_CHUNK  # (as lqe.kernels.fused_quant.SILU_CHUNK)


def quant_fp8_ref(y: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference dynamic fp8 quantization of ``y [M, K]``: per row (``group=0``, scale ``[M, 1]``) or per 1 x ``group``
    columns (scale ``[M, K / group]``)."""
    yf = y.float()
    m, k = yf.shape
    g = k if group == 0 else group
    if k % g:
        raise ValueError(f"fp8 group quantization: K={k} is not a multiple of the group size {g}")
    yg = yf.reshape(m, k // g, g)
    scale = yg.abs().amax(-1, keepdim=True).clamp(min=MIN_ABSMAX) / FP8_MAX
    q = (yg / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(m, k), scale.reshape(m, k // g)


def quant_fp8_static_ref(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference static fp8 quantization with one fp32 scale (:func:`lqe.kernels.w8a8.fp8_quantize_static`'s codes)."""
    return (y.float() / scale.float().reshape(1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _quant_rows(y: torch.Tensor, group: int, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if scale is not None:
        return quant_fp8_static_ref(y, scale), scale
    q, s = quant_fp8_ref(y.reshape(-1, y.shape[-1]), group)
    return q.view(y.shape), s.view(*y.shape[:-1], s.shape[-1])


def rms_norm_quant_fp8_torch(x, weight, eps, residual=None, group=0, scale=None):
    out = rms_norm_torch(x, weight, eps, residual)
    y, new_residual = out if residual is not None else (out, None)
    return (*_quant_rows(y, group, scale), new_residual)


def silu_mul_quant_fp8_torch(x, group=0, scale=None):
    return _quant_rows(silu_and_mul_torch(x), group, scale)


# ------------------------------------------------------------------------------------------------ kernels
if HAS_TRITON:
    @triton.jit
    def _fp8_codes(v):
        """e4m3 codes of the fp32 quotients ``v``: ``clamp(v, -448, 448)`` then the round-to-nearest-even cast. The
        clamp propagates NaN (PTX ``min.NaN``; ``tl.minimum`` / ``tl.maximum`` compile to ``min.f32`` / ``max.f32``,
        which return the other operand, so a NaN activation became -448), and the cast keeps it NaN, as torch's
        ``clamp`` + ``.to(float8_e4m3fn)`` does. (Triton's interpreter casts NaN to the code 0x7C: check NaN on a
        GPU.)"""
        return tl.clamp(v, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)

    @triton.jit
    def _fp8_store(y, Q, S, row, stride_q, stride_s, cols, mask, n, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                   group_base, SS, STATIC: tl.constexpr):
        """Quantize fp32 ``y [BLOCK]`` (masked lanes 0) per row (GROUP == 0), per GROUP columns, or with the static
        scale at ``SS`` (STATIC), and store the codes (and the group scales)."""
        if STATIC:
            scale = tl.load(SS)
            v = tl.div_rn(y, scale)
        elif GROUP == 0:
            absmax = tl.maximum(tl.max(tl.abs(y), 0), 1e-12)
            scale = tl.div_rn(absmax, 448.0)
            v = tl.div_rn(y, scale)
        else:
            yg = tl.reshape(y, (BLOCK // GROUP, GROUP))
            absmax = tl.maximum(tl.max(tl.abs(yg), 1), 1e-12)
            scale = tl.div_rn(absmax, 448.0)
            v = tl.reshape(tl.div_rn(yg, scale[:, None]), (BLOCK,))
            gidx = group_base + tl.arange(0, BLOCK // GROUP)
            tl.store(S + row * stride_s + gidx, scale, mask=gidx * GROUP < n)
        tl.store(Q + row * stride_q + cols, _fp8_codes(v), mask=mask)
        return scale

    @triton.jit
    def _rms_norm_quant_fp8_kernel(X, R, W, Q, S, ROut, stride_x, stride_r, stride_q, stride_s, stride_ro, n, eps, SS,
                                   HAS_RESIDUAL: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                                   STATIC: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)  # (lqe.kernels.triton_pdl)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        y = _rms_norm_row(X, R, W, ROut, row, stride_x, stride_r, stride_ro, n, eps, offs, mask, HAS_RESIDUAL)
        y = y.to(X.dtype.element_ty).to(tl.float32)  # the activation rms_norm would have written
        scale = _fp8_store(y, Q, S, row, stride_q, stride_s, offs, mask, n, GROUP, BLOCK, 0, SS, STATIC)
        if GROUP == 0 and not STATIC:
            tl.store(S + row * stride_s, scale)

    @triton.jit
    def _silu_mul_quant_fp8_kernel(X, Q, S, stride_x, stride_q, stride_s, n, SS, GROUP: tl.constexpr,
                                   CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, STATIC: tl.constexpr,
                                   PDL: tl.constexpr):
        pdl_start(PDL)  # (lqe.kernels.triton_pdl)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, CHUNK)
        if GROUP != 0:  # groups never straddle chunks (CHUNK % GROUP == 0): one pass
            for c in range(NUM_CHUNKS):
                cols = c * CHUNK + offs
                mask = cols < n
                y = _silu_and_mul_row(X, row, stride_x, n, cols, mask).to(X.dtype.element_ty).to(tl.float32)
                _fp8_store(y, Q, S, row, stride_q, stride_s, cols, mask, n, GROUP, CHUNK, c * (CHUNK // GROUP), SS,
                           STATIC)
        elif STATIC:  # the scale is known before the row: one pass, no reduction
            for c in range(NUM_CHUNKS):
                cols = c * CHUNK + offs
                mask = cols < n
                y = _silu_and_mul_row(X, row, stride_x, n, cols, mask).to(X.dtype.element_ty).to(tl.float32)
                _fp8_store(y, Q, S, row, stride_q, stride_s, cols, mask, n, GROUP, CHUNK, 0, SS, STATIC)
        elif NUM_CHUNKS == 1:
            mask = offs < n
            y = _silu_and_mul_row(X, row, stride_x, n, offs, mask).to(X.dtype.element_ty).to(tl.float32)
            scale = _fp8_store(y, Q, S, row, stride_q, stride_s, offs, mask, n, GROUP, CHUNK, 0, SS, STATIC)
            tl.store(S + row * stride_s, scale)
        else:
            absmax = tl.zeros([CHUNK], dtype=tl.float32)
            for c in range(NUM_CHUNKS):
                cols = c * CHUNK + offs
                y = _silu_and_mul_row(X, row, stride_x, n, cols, cols < n).to(X.dtype.element_ty).to(tl.float32)
                absmax = tl.maximum(absmax, tl.abs(y))
            scale = tl.div_rn(tl.maximum(tl.max(absmax, 0), 1e-12), 448.0)
            for c in range(NUM_CHUNKS):  # recompute (elementwise, so the same bits) rather than keep the row
                cols = c * CHUNK + offs
                y = _silu_and_mul_row(X, row, stride_x, n, cols, cols < n).to(X.dtype.element_ty).to(tl.float32)
                tl.store(Q + row * stride_q + cols, _fp8_codes(tl.div_rn(y, scale)), mask=cols < n)
            tl.store(S + row * stride_s, scale)


# ------------------------------------------------------------------------------------------------ public ops
def _check_group(n: int, group: int, scale: torch.Tensor | None = None) -> None:
    if group not in (0,) and (group & (group - 1) or n % group):
        raise ValueError(f"fp8 group quantization needs a power-of-two group dividing K; got group={group}, K={n}")
    if scale is not None and (group or scale.numel() != 1):
        raise ValueError(f"static fp8 quantization takes one per-tensor scale and no group; got a scale of "
                         f"{scale.numel()} values and group={group}")


def rms_norm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                       group: int = 0, use_triton: bool | None = None, scale: torch.Tensor | None = None):
    """``(q fp8, scale fp32 [..., 1 or K/group], new residual or None)`` of ``rms_norm(x, weight, eps, residual)``;
    with a static ``scale`` (fp32 ``[1]``) the codes use it and it is the scale returned."""
    n = x.shape[-1]
    _check_group(n, group, scale)
    if not _triton_ok(x, use_triton) or x.numel() == 0:
        return rms_norm_quant_fp8_torch(x, weight, eps, residual, group, scale)
    shape = x.shape
    x2 = _rows(x, "x")
    m = x2.shape[0]
    ns = 1 if group == 0 else n // group
    q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device)
    out_scale = torch.empty(m, ns, dtype=torch.float32, device=x.device) if scale is None else scale
    r2 = _rows(residual, "residual") if residual is not None else x2
    r_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if residual is not None else x2
    block, warps = rms_norm_launch(n)
    _rms_norm_quant_fp8_kernel[(m,)](
        x2, r2, weight, q, out_scale, r_out, x2.stride(0), r2.stride(0), q.stride(0), out_scale.stride(0) if scale is
        None else 0, r_out.stride(0), n, float(eps), out_scale, HAS_RESIDUAL=residual is not None, GROUP=group,
        BLOCK=block, STATIC=scale is not None, num_warps=warps, **pdl_args(x.device))
    r = r_out.view(shape) if residual is not None else None
    return (q.view(shape), scale, r) if scale is not None else (q.view(shape), out_scale.view(*shape[:-1], ns), r)


def silu_mul_quant_fp8(x: torch.Tensor, group: int = 0, use_triton: bool | None = None, chunk: int | None = None,
                       scale: torch.Tensor | None = None):
    """``(q fp8 [..., I], scale fp32 [..., 1 or I/group])`` of ``silu_and_mul(x)`` for ``x [..., 2I]``; with a static
    ``scale`` (fp32 ``[1]``) the codes use it and it is the scale returned."""
    n = x.shape[-1] // 2
    _check_group(n, group, scale)
    if not _triton_ok(x, use_triton) or x.numel() == 0:
        return silu_mul_quant_fp8_torch(x, group, scale)
    x2 = _rows(x, "x")
    m = x2.shape[0]
    ns = 1 if group == 0 else n // group
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn, device=x.device)
    out_scale = torch.empty(m, ns, dtype=torch.float32, device=x.device) if scale is None else scale
    chunk = max(chunk or min(SILU_CHUNK, triton.next_power_of_2(n)), group)
    _silu_mul_quant_fp8_kernel[(m,)](x2, q, out_scale, x2.stride(0), q.stride(0), out_scale.stride(0) if scale is None
                                     else 0, n, out_scale, GROUP=group, CHUNK=chunk, NUM_CHUNKS=triton.cdiv(n, chunk),
                                     STATIC=scale is not None, num_warps=row_warps(chunk),
                                     **pdl_args(x.device))
    if scale is not None:
        return q.view(*x.shape[:-1], n), scale
    return q.view(*x.shape[:-1], n), out_scale.view(*x.shape[:-1], ns)
