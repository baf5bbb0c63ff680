"""Load-time repack of a :class:`CanonicalWeight` into the layout the lqe CUDA GEMMs read (pure torch).

Layout (the contract with csrc/gemm/gemm_common.cuh; lane = 0..31, g8 = lane // 4, t4 = lane % 4):

* rows are first sorted by group (act-order: ``perm = argsort(g_idx)``; activations are gathered with the same
  ``perm`` at run time), so group ``g`` covers sorted rows ``[g*gs, (g+1)*gs)``;
* the ``[K, N]`` codes are cut into 16(K) x 64(N) tiles stored tile-row-major; inside a tile, lane ``l`` owns
  column ``j*8 + g8`` of n8 tile ``j`` at rows ``(2t4, 2t4+1, 2t4+8, 2t4+9)`` -- its mma.sync B fragment;
* 4-bit: 4 int32 words per lane (one 16-byte load), word ``w`` = tiles ``2w, 2w+1``, nibble order
  ``[0,2,4,6,1,3,5,7]``; 8-bit: 8 words per lane, word ``j`` = tile ``j``, byte order ``[0,2,1,3]``;
* scales / zero points ``[G, N]`` in the activation dtype, columns permuted inside each 64-block so stored
  column ``g8*8 + j`` is logical column ``j*8 + g8``.

W8A8: 32(K) x 64(N) tiles, 16 words per lane, word ``2j+h`` = rows ``4t4 + 16h + (0..3)`` of column ``j*8+g8``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lqe.kernels.canonical import CanonicalWeight

NIBBLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # position p of a word holds logical value NIBBLE_ORDER[p]
BYTE_ORDER = (0, 2, 1, 3)


@dataclass(slots=True)
class PackedWNA16:
    qweight: torch.Tensor  # int32 [K/16, N*bits/2]: K/16 tile rows of (N/64 tiles x 32 lanes x 4*bits/4 words)
    scales: torch.Tensor  # [G, N] activation dtype, column-permuted
    zeros: torch.Tensor | None  # [G, N] activation dtype, column-permuted; None = symmetric 2^(bits-1)
    perm: torch.Tensor | None  # int64 [K]: x[:, perm] feeds the kernel (act-order); None = identity
    bits: int
    group_size: int  # effective, > 0 (K when per-channel)
    k: int
    n: int


@dataclass(slots=True)
class PackedW8A8:
    qweight: torch.Tensor  # int32 [K/32, N*8]
    w_scale: torch.Tensor  # float32 [N]
    colsum: torch.Tensor  # int32 [N] = sum_k Wq[k, n] (azp correction for asymmetric activations)
    k: int
    n: int


def _lane_rows_cols(kt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[32, 8, kt]`` row-in-tile and column-in-tile of the value each lane holds for n8 tile ``j``."""
    lane = torch.arange(32)
    g8, t4 = lane // 4, lane % 4
    if kt == 16:
        rows = torch.stack([2 * t4, 2 * t4 + 1, 2 * t4 + 8, 2 * t4 + 9], dim=-1)  # [32, 4]
    else:  # 32-row tile of the int8 kernel: rows 4t4 + 16h + b, h = 0/1, b = 0..3
        rows = torch.cat([4 * t4[:, None] + torch.arange(4), 4 * t4[:, None] + 16 + torch.arange(4)], dim=-1)
    j = torch.arange(8)
    cols = j[None, :] * 8 + g8[:, None]  # [32, 8]
    return rows[:, None, :].expand(32, 8, rows.shape[-1]), cols[:, :, None].expand(32, 8, rows.shape[-1])


def act_order_codes(cw: CanonicalWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``cw.codes`` with K sorted by group (act-order) and the ``perm`` that sorts it, or (codes, ``None``)."""
    if cw.g_idx is not None and cw.has_act_order():
        perm = torch.sort(cw.g_idx.long(), stable=True).indices
        return cw.codes.index_select(0, perm), perm
    return cw.codes, None


def groups_contiguous(cw: CanonicalWeight, gs: int) -> bool:
    """Whether ``cw.g_idx`` (if any), once sorted, makes contiguous groups of ``gs`` rows."""
    if cw.g_idx is None:
        return True
    g_sorted = torch.sort(cw.g_idx.long().cpu(), stable=True).values
    return torch.equal(g_sorted, torch.arange(cw.shape[0]) // gs)


def fragment_words(frag: torch.Tensor, bits: int) -> torch.Tensor:
    """m16n8k16 B fragments ``[KT, NT, 32, 8, 4]`` of codes -> a lane's int64 words ``[KT, NT, 32, bits]``:
    4-bit: word ``w`` holds tiles ``2w, 2w+1`` in :data:`NIBBLE_ORDER`; 8-bit: word ``j`` tile ``j`` in :data:`BYTE_ORDER`."""
    kt, nt = frag.shape[:2]
    if bits == 4:
        logical = frag.reshape(kt, nt, 32, 4, 8)  # word w: tiles 2w, 2w+1 -> 8 logical values
        shifts = torch.arange(8, device=frag.device) * 4
        return (logical[..., list(NIBBLE_ORDER)] << shifts).sum(-1)  # [KT, NT, 32, 4]
    shifts = torch.arange(4, device=frag.device) * 8
    return (frag[..., list(BYTE_ORDER)] << shifts).sum(-1)  # [KT, NT, 32, 8]


def gather_fragments(mat: torch.Tensor, kt: int) -> torch.Tensor:
    """``[K, N]`` -> ``[K/kt, N/64, 32, 8, kt/4]``: value r of lane l for n8 tile j of every tile."""
    k, n = mat.shape
    tiles = mat.reshape(k // kt, kt, n // 64, 64).permute(0, 2, 1, 3)  # [KT, NT, kt, 64]
    rows, cols = _lane_rows_cols(kt)
    return tiles[:, :, rows.to(mat.device), cols.to(mat.device)]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def permute_columns(t: torch.Tensor) -> torch.Tensor:
    """Scale/zero column order: stored ``g8*8 + j`` <- logical ``j*8 + g8`` inside every 64-block."""
    g, n = t.shape
    return t.reshape(g, n // 64, 8, 8).transpose(2, 3).reshape(g, n)


def wna16_unsupported(cw: CanonicalWeight) -> str | None:
    """Why the lqe W4A16/W8A16 kernel cannot run this weight, or ``None``."""
    k, n = cw.shape
    if cw.bits not in (4, 8):
        return f"bits={cw.bits} (lqe-wna16 supports 4 and 8)"
    if k % 64 or n % 64:
        return f"shape K={k}, N={n}: lqe-wna16 needs K and N multiples of 64"
    gs = k if cw.group_size == -1 else cw.group_size
    if gs % 16:
        return f"group_size={cw.group_size}: lqe-wna16 needs a multiple of 16 or -1"
    if not groups_contiguous(cw, gs):
        return "g_idx groups are not all group_size rows long; lqe-wna16 needs contiguous groups after sorting"
    return None


def repack_wna16(cw: CanonicalWeight, dtype: torch.dtype = torch.float16) -> PackedWNA16:
    """Canonical -> kernel layout (on ``cw``'s device). Raises ``ValueError`` naming what is unsupported."""
    reason = wna16_unsupported(cw)
    if reason is not None:
        raise ValueError(f"cannot repack for lqe-wna16: {reason}")
    k, n = cw.shape
    gs = k if cw.group_size == -1 else cw.group_size
    codes, perm = act_order_codes(cw)
    frag = gather_fragments(codes.to(torch.int64), 16)  # [KT, NT, 32, 8, 4]
    qweight = _to_int32(fragment_words(frag, cw.bits)).reshape(frag.shape[0], -1).contiguous()
    zeros = None if cw.zeros is None else permute_columns(cw.zeros.to(dtype)).contiguous()
    return PackedWNA16(qweight, permute_columns(cw.scales.to(dtype)).contiguous(), zeros, perm, cw.bits, gs, k, n)


def w8a8_unsupported(k: int, n: int) -> str | None:
    if k % 64 or n % 64:
        return f"shape K={k}, N={n}: lqe-w8a8 needs K and N multiples of 64"
    return None


def repack_w8a8(wq: torch.Tensor, w_scale: torch.Tensor) -> PackedW8A8:
    """``wq`` int8 ``[K, N]`` (math orientation, i.e. ``weight.t()``), ``w_scale`` per channel ``[N]`` or scalar."""
    k, n = wq.shape
    reason = w8a8_unsupported(k, n)
    if reason is not None:
        raise ValueError(f"cannot repack for lqe-w8a8: {reason}")
    if wq.dtype != torch.int8:
        raise ValueError(f"lqe-w8a8 weight must be int8, got {wq.dtype}")
    frag = gather_fragments(wq.to(torch.int64) & 0xFF, 32)  # [KT, NT, 32, 8, 8] (r = 4h + b)
    words = (frag.reshape(*frag.shape[:4], 2, 4) << (torch.arange(4, device=wq.device) * 8)).sum(-1)
    qweight = _to_int32(words).reshape(k // 32, -1).contiguous()  # word 2j + h
    scale = w_scale.float().reshape(-1).expand(n).contiguous() if w_scale.numel() == 1 else w_scale.float().reshape(n).contiguous()
    return PackedW8A8(qweight, scale, wq.to(torch.int32).sum(0).to(torch.int32), k, n)
