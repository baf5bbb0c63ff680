"""Fused small ops in Triton, each with a torch twin that is the ground truth and the fallback.

* ``rms_norm(x, weight, eps, residual=None)``: ``x + residual`` (rounded to x's dtype, returned as the new
  residual) normalised in fp32, cast back, times ``weight`` -- the rounding order of ``lqe.layers.norm``.
* ``silu_and_mul(x)``: ``silu(gate) * up`` on a fused ``[gate | up]`` tensor (``lqe.layers.activation``).
  (Both also exist fused with the per-token int8 quantization of their output: :mod:`lqe.kernels.fused_quant`.)
* ``rotary_embedding(positions, q, k, cos_sin, head_dim)``: neox rotation (rotate halves) of ``q [T, H*D]`` and
  ``k [T, KVH*D]`` with ``cos_sin [max_pos, rot_dim]`` = ``[cos | sin]`` in fp32 (``lqe.layers.rotary``); the first
  ``rot_dim`` dims of each head rotate, the rest pass through. Returns new tensors.

The Triton path runs for CUDA tensors (and for CPU tensors under ``TRITON_INTERPRET=1``); ``use_triton=False``
forces the torch twin. Every op accepts inputs whose last dimension is contiguous (views of a fused qkv/gate-up).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    from lqe.kernels.triton_pdl import pdl_args, pdl_start
    HAS_TRITON = True
except Exception:  # noqa: BLE001 -- any failure to import means "no triton"
    HAS_TRITON = False

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_ok(x: torch.Tensor, use_triton: bool | None) -> bool:
    if use_triton is False or not HAS_TRITON:
        return False
    return x.is_cuda or _INTERPRET


# ------------------------------------------------------------------------------------------------ torch twins
def rms_norm_torch(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, residual)


def silu_and_mul_torch(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding_torch(positions, q, k, cos_sin, head_dim):
    rot = cos_sin.shape[-1]
    cos, sin = cos_sin[positions].float().chunk(2, dim=-1)  # [T, rot/2]

    def rotate(x):
        t, dtype = x.shape[0], x.dtype
        x = x.reshape(t, -1, head_dim).float()
        x1, x2, rest = x[..., :rot // 2], x[..., rot // 2:rot], x[..., rot:]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1).flatten(1).to(dtype)

    return rotate(q), rotate(k)


# ------------------------------------------------------------------------------------------------ kernels
if HAS_TRITON:
    # The row bodies below are shared with the int8-quantizing variants of lqe/kernels/fused_quant.py: one source
    # for both, so the fused norm / activation rounds exactly like the op it replaces.
    @triton.jit
    def _rms_norm_row(X, R, W, ROut, row, stride_x, stride_r, stride_ro, n, eps, offs, mask,
                      HAS_RESIDUAL: tl.constexpr):
        """fp32 ``weight * normed`` of one row (the caller rounds it to its output dtype); stores the new
        residual when ``HAS_RESIDUAL``. Masked lanes come out 0."""
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = (x.to(tl.float32) + tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
            x = x.to(ROut.dtype.element_ty)
            tl.store(ROut + row * stride_ro + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
        normed = (xf * rstd).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        return normed * w

    @triton.jit
    def _silu_and_mul_row(X, row, stride_x, n, offs, mask):
        """fp32 ``silu(gate) * up`` of columns ``offs`` of one row (the caller rounds it); masked lanes 0."""
        gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(X + row * stride_x + n + offs, mask=mask, other=0.0)
        act = (gate * tl.sigmoid(gate)).to(up.dtype).to(tl.float32)
        return act * up.to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(X, R, W, Out, ROut, stride_x, stride_r, stride_o, stride_ro, n, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        y = _rms_norm_row(X, R, W, ROut, row, stride_x, stride_r, stride_ro, n, eps, offs, mask, HAS_RESIDUAL)
        tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(X, Out, stride_x, stride_o, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        y = _silu_and_mul_row(X, row, stride_x, n, offs, mask)
        tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(Pos, X, Out, CosSin, stride_x, stride_o, stride_cs, num_heads,
                       HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        t = tl.program_id(0).to(tl.int64)
        pos = tl.load(Pos + t).to(tl.int64)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_r = tl.arange(0, BLOCK_HALF)
        h_mask = offs_h < num_heads
        r_mask = offs_r < HALF
        cos = tl.load(CosSin + pos * stride_cs + offs_r, mask=r_mask, other=0.0).to(tl.float32)
        sin = tl.load(CosSin + pos * stride_cs + HALF + offs_r, mask=r_mask, other=0.0).to(tl.float32)
        mask = h_mask[:, None] & r_mask[None, :]
        src = X + t * stride_x + offs_h[:, None] * HEAD_DIM + offs_r[None, :]
        dst = Out + t * stride_o + offs_h[:, None] * HEAD_DIM + offs_r[None, :]
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(Out.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(Out.dtype.element_ty), mask=mask)
        if BLOCK_REST > 0:  # partial rotary: copy the unrotated tail of each head
            offs_p = 2 * HALF + tl.arange(0, BLOCK_REST)
            p_mask = h_mask[:, None] & (offs_p[None, :] < HEAD_DIM)
            rest = tl.load(X + t * stride_x + offs_h[:, None] * HEAD_DIM + offs_p[None, :], mask=p_mask)
            tl.store(Out + t * stride_o + offs_h[:, None] * HEAD_DIM + offs_p[None, :], rest, mask=p_mask)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if x2.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension; got strides {tuple(x.stride())}")
    return x2


def rms_norm_launch(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the RMSNorm kernels for rows of ``n``: the reduction order follows from both, so the
    plain and the int8-quantizing kernel must launch alike to round alike."""
    block = triton.next_power_of_2(n)
    return block, row_warps(block)


# The most columns of one row the quantizing row kernels (SiLU-mul producers, the standalone quantizers) hold at once
# (16 warps: 32 per thread of a row); a longer row takes a pass for its range, then a quantizing pass. A row in one
# chunk has all its loads in flight at once: the H200 at af342f8 timed 4096-column chunks of a 14336-column row
# (Llama-3-8B's down_proj input, M = 1 and 16) at ~10 us, four chunks a pass, each chunk's loads one DRAM round trip
# after the last (lqe-w8a8-layer 26.8 us beside its GEMV's 16.9 us).
ROW_CHUNK = 16384


def row_warps(block: int) -> int:
    """num_warps of a kernel holding ``block`` columns of one row at once: 256 columns a warp (8 per thread), 1 to 16
    warps."""
    return min(16, max(1, block // 256))


# ------------------------------------------------------------------------------------------------ public ops
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             use_triton: bool | None = None):
    if not _triton_ok(x, use_triton) or x.numel() == 0:
        return rms_norm_torch(x, weight, eps, residual)
    shape, n = x.shape, x.shape[-1]
    x2 = _rows(x, "x")
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r2 = _rows(residual, "residual") if residual is not None else x2
    r_out = torch.empty_like(out) if residual is not None else out
    block, warps = rms_norm_launch(n)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, r_out, x2.stride(0), r2.stride(0), out.stride(0), r_out.stride(0), n, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps, **pdl_args(x.device),
    )
    out = out.view(shape)
    return out if residual is None else (out, r_out.view(shape))


def silu_and_mul(x: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    if not _triton_ok(x, use_triton) or x.numel() == 0:
        return silu_and_mul_torch(x)
    n = x.shape[-1] // 2
    x2 = _rows(x, "x")
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, out, x2.stride(0), out.stride(0), n, BLOCK=block,
                                                                **pdl_args(x.device))
    return out.view(*x.shape[:-1], n)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
                     head_dim: int, use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if not _triton_ok(q, use_triton) or q.numel() == 0:
        return rotary_embedding_torch(positions, q, k, cos_sin, head_dim)
    rot = cos_sin.shape[-1]
    if rot % 2 or rot > head_dim or cos_sin.stride(-1) != 1:
        raise ValueError(f"cos_sin cache [max_pos, rot_dim] needs an even rot_dim <= head_dim={head_dim}; got {tuple(cos_sin.shape)}")
    half, rest = rot // 2, head_dim - rot
    outs = []
    for x in (q, k):
        x2 = _rows(x.reshape(x.shape[0], -1) if x.dim() == 3 else x, "q/k")
        heads = x2.shape[1] // head_dim
        out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        block_h = min(16, triton.next_power_of_2(heads))
        _rotary_kernel[(x2.shape[0], triton.cdiv(heads, block_h))](
            positions, x2, out, cos_sin, x2.stride(0), out.stride(0), cos_sin.stride(0), heads,
            HEAD_DIM=head_dim, HALF=half, BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_REST=triton.next_power_of_2(rest) if rest else 0, **pdl_args(x.device),
        )
        outs.append(out)
    return outs[0], outs[1]
