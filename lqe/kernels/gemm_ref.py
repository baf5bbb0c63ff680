"""Pure-torch emulation of what the lqe CUDA GEMM kernels compute, written from the kernel's point of view.

Independent of :mod:`lqe.kernels.repack` (which builds the layout from its description): these functions
decode the packed words the way csrc/gemm/gemm_common.cuh does -- shift, mask, the same magic numbers, the same
fragment rows/columns, the same scale addresses -- so CPU tests of "repack then emulate" check the layout
contract the CUDA code relies on.
"""
from __future__ import annotations

import torch

from lqe.kernels.repack import PackedW8A8, PackedWNA16

_TORCH_I16 = torch.int16


def _frag_index(k: int, n: int, kt: int, regs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global (row, col) of register element ``e`` of lane ``l`` for n8 tile ``j`` of tile (kt_i, nt_i):
    ``[K/kt, N/64, 32, 8, regs]`` each, following the PTX mma fragment definition."""
    lane = torch.arange(32)
    g8, t4 = lane // 4, lane % 4
    e = torch.arange(regs)
    if kt == 16:  # m16n8k16 B: b0 = rows 2t4 + (0,1), b1 = rows 2t4 + 8 + (0,1)
        r = 2 * t4[:, None] + (e % 2) + 8 * (e // 2)
    else:  # m16n8k32 s8 B: b0 = rows 4t4 + (0..3), b1 = rows 4t4 + 16 + (0..3)
        r = 4 * t4[:, None] + (e % 4) + 16 * (e // 4)
    c = torch.arange(8)[None, :] * 8 + g8[:, None]  # [32, 8]
    ks = torch.arange(k // kt)[:, None, None, None, None]
    nt = torch.arange(n // 64)[None, :, None, None, None]
    rows = ks * kt + r[None, None, :, None, :]
    cols = nt * 64 + c[None, None, :, :, None]
    shape = (k // kt, n // 64, 32, 8, regs)
    return rows.expand(shape), cols.expand(shape)


def _words(packed_q: torch.Tensor, k: int, n: int, kt: int, per_lane: int) -> torch.Tensor:
    return packed_q.to(torch.int64).reshape(k // kt, n // 64, 32, per_lane) & 0xFFFFFFFF


def unpack_wna16_codes(p: PackedWNA16) -> torch.Tensor:
    """Codes ``[K, N]`` (sorted-K order) decoded like the kernel: element e of tile j is taken from
    word ``j//2`` shifted by ``8*(j%2)``, nibble ``(e//2)`` (lo mask 0x000f000f / hi mask 0x00f000f0), half ``e%2``
    (bit 16); for 8 bits from word ``j``, byte ``__byte_perm`` selectors 0x4240 / 0x4341."""
    w = _words(p.qweight, p.k, p.n, 16, 4 if p.bits == 4 else 8)
    out = torch.empty(p.k // 16, p.n // 64, 32, 8, 4, dtype=torch.int64)
    for j in range(8):
        for e in range(4):
            if p.bits == 4:
                q = w[..., j // 2] >> (8 * (j % 2))
                bit = 4 * (e // 2) + 16 * (e % 2)  # lo -> bits 0..3 / 16..19, hi -> bits 4..7 / 20..23
                out[..., j, e] = (q >> bit) & 0xF
            else:
                sel = (0x4240, 0x4341)[e // 2]
                byte = (sel >> (8 * (e % 2))) & 0xF  # selector nibble of the half's low byte
                out[..., j, e] = (w[..., j] >> (8 * byte)) & 0xFF
    rows, cols = _frag_index(p.k, p.n, 16, 4)
    codes = torch.empty(p.k, p.n, dtype=torch.int64)
    codes[rows.reshape(-1), cols.reshape(-1)] = out.reshape(-1)
    return codes


def _stored_params(t: torch.Tensor, k: int, n: int, gs: int) -> torch.Tensor:
    """The per-(row, col) value the kernel loads: group ``(k//16*16)//gs``, stored column ``nt*64 + g8*8 + j``."""
    rows = torch.arange(k)
    g = (rows // 16 * 16) // gs
    col = torch.arange(n)
    j, g8 = (col % 64) // 8, col % 8
    stored = (col // 64) * 64 + g8 * 8 + j
    return t[g][:, stored]


def _magic_dequant(codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int, dtype: torch.dtype,
                   rows: torch.Tensor) -> torch.Tensor:
    """Dequantize like ``Dq<T, BITS>``: magic-number halves, exact subtraction, one rounding of ``* scale``."""
    if dtype == torch.float16:
        hi_nibble = (bits == 4) & (((rows % 16) // 8) == 1)[:, None]  # b1 registers come from the hi mask
        base = torch.where(hi_nibble, 0x6400 | (codes << 4), 0x6400 | codes).to(_TORCH_I16).view(torch.float16)
        v = torch.where(hi_nibble, base * torch.tensor(0.0625, dtype=dtype) - (64 + z), base - (1024 + z))
        return v * s
    if bits == 4:
        base = (0x4300 | codes).to(_TORCH_I16).view(torch.bfloat16)
        return (base - (128 + z)) * s
    f = (0x4B000000 | codes).to(torch.int32).view(torch.float32)
    return ((f - (8388608.0 + z.float())) * s.float()).to(torch.bfloat16)


def dequantize_wna16(p: PackedWNA16, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[K, N]`` weights in sorted-K order, as the kernel's registers hold them."""
    dtype = dtype or p.scales.dtype
    codes = unpack_wna16_codes(p)
    s = _stored_params(p.scales.cpu().to(dtype), p.k, p.n, p.group_size)
    if p.zeros is None:
        z = torch.full_like(s, float(1 << (p.bits - 1)))
    else:
        z = _stored_params(p.zeros.cpu().to(dtype), p.k, p.n, p.group_size)
    return _magic_dequant(codes, s, z, p.bits, dtype, torch.arange(p.k))


def wna16_gemm_ref(x: torch.Tensor, p: PackedWNA16, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W (+ bias)`` the kernel's way: gather x columns by ``perm``, fp32 accumulation, one rounding."""
    xs = x.cpu() if p.perm is None else x.cpu().index_select(-1, p.perm.cpu())
    w = dequantize_wna16(p, x.dtype)
    y = xs.float() @ w.float()
    if bias is not None:
        y = y + bias.cpu().float()
    return y.to(x.dtype)


def unpack_w8a8(p: PackedW8A8) -> torch.Tensor:
    """int8 ``[K, N]`` decoded like the kernel: register e of tile j is byte ``e%4`` of word ``2j + e//4``."""
    w = _words(p.qweight, p.k, p.n, 32, 16)
    e = torch.arange(8)
    word_idx = (torch.arange(8)[:, None] * 2 + e[None, :] // 4)  # [8, 8]
    vals = (w[..., word_idx] >> (8 * (e % 4))) & 0xFF  # [KT, NT, 32, 8, 8]
    vals = torch.where(vals >= 128, vals - 256, vals)
    rows, cols = _frag_index(p.k, p.n, 32, 8)
    out = torch.empty(p.k, p.n, dtype=torch.int64)
    out[rows.reshape(-1), cols.reshape(-1)] = vals.reshape(-1)
    return out.to(torch.int8)


def quantize_per_token_ref(x: torch.Tensor, symmetric: bool = True):
    """Twin of csrc/gemm/quant_per_token.cu: the contract ``reference.per_token_quant_int8`` (evaluated on the
    CPU, where ``/ 127`` is a true division) with ``[M]``-shaped scales: ``(q int8, scale fp32 [M], azp int32 [M]
    or None)``."""
    from lqe.kernels.act_quant_ref import per_token_quant_int8

    q, s, azp = per_token_quant_int8(x.cpu(), symmetric)
    dev = x.device
    return q.to(dev), s.reshape(-1).to(dev), None if azp is None else azp.reshape(-1).to(dev)


def w8a8_gemm_ref(xq: torch.Tensor, a_scale: torch.Tensor, azp: torch.Tensor | None, p: PackedW8A8,
                  bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The int8 kernel's epilogue on an exact accumulator (float64: integer partial sums below 2^53)."""
    wq = unpack_w8a8(p).to(torch.float64)
    acc = xq.cpu().to(torch.float64) @ wq
    if azp is not None:
        acc = acc - azp.cpu().to(torch.float64)[:, None] * p.colsum.cpu().to(torch.float64)[None, :]
    y = acc.float() * a_scale.cpu().float().reshape(-1, 1) * p.w_scale.cpu().float()[None, :]
    if bias is not None:
        y = y + bias.cpu().float()
    return y.to(out_dtype)
