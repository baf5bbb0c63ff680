"""Load-time repack of a :class:`CanonicalWeight` for the Marlin-class kernel ``lqe-w4a16-mma``
(csrc/gemm/w4a16_mma.cu), pure torch.

Layout (the contract with w4a16_mma.cu; emulated independently by :mod:`lqe.kernels.mma_ref`):

* K is sorted by group first (act-order: ``perm = argsort(g_idx)``, the activations are gathered with the same
  ``perm`` per call), then padded with zero codes to ``k_pad`` (a multiple of :data:`TILE_K` = 64, one pipeline
  stage); N is padded with zero codes and zero scales to ``n_pad`` (a multiple of :data:`TILE_N` = 256, one
  block tile of 4 warps x 64 columns).
* Inside a 16(K) x 64(N) warp tile every lane holds its m16n8k16 B fragments for the 8 n8 tiles: lane
  ``l`` (``g8 = l // 4``, ``t4 = l % 4``) owns column ``j*8 + g8`` of n8 tile ``j`` at rows ``2t4, 2t4+1,
  2t4+8, 2t4+9``. 4-bit: 4 words = one 16-byte load; word ``w`` holds tiles ``2w, 2w+1`` with nibble order
  ``[0,2,4,6,1,3,5,7]`` (``lop3`` with 0x000f000f gives b0, 0x00f000f0 or ``>> 4`` gives b1, ``>> 8`` the next
  tile). 8-bit: 8 words = two 16-byte loads; word ``j`` holds tile ``j`` with byte order ``[0,2,1,3]``.
* Global order of the 16-byte vectors: ``[k_pad/64, n_pad/256, slab 4, warp 4, vec V, lane 32]`` (``V = bits/4``)
  -- one block's pipeline stage (64 x 256) is one contiguous 8 KB (4-bit) / 16 KB (8-bit) run, copied with
  coalesced cp.async, and a warp's ``ld.shared.v4`` of one slab hits 32 consecutive 16-byte words.
* Scales / zero points ``[G, n_pad]`` in the activation dtype; inside every 64-column block stored column
  ``g8*8 + j`` holds logical column ``j*8 + g8`` (one 16-byte load = the lane's 8 scales). Group of sorted
  row ``k`` is ``min(k // group_size, G - 1)`` (padding rows reuse the last group).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lqe.kernels.canonical import CanonicalWeight
from lqe.kernels.repack import (_to_int32, act_order_codes, fragment_words, gather_fragments, groups_contiguous,
                                permute_columns)

TILE_K = 64  # K rows per pipeline stage
TILE_N = 256  # N columns per block tile (4 warps x 64)
GROUPS_OK = "-1 or a positive multiple of 16"


@dataclass(slots=True)
class PackedMMA:
    qweight: torch.Tensor  # int32 [k_pad/16, n_pad*bits/2] in the order above (flat contents matter)
    scales: torch.Tensor  # [G, n_pad] activation dtype, column-permuted
    zeros: torch.Tensor | None  # [G, n_pad] activation dtype, column-permuted; None = symmetric 2^(bits-1)
    perm: torch.Tensor | None  # int64 [K]: x[:, perm] feeds the kernel (act-order); None = identity
    bits: int
    group_size: int  # effective, > 0 (K when per-channel)
    k: int
    n: int
    k_pad: int
    n_pad: int

    @property
    def num_groups(self) -> int:
        return int(self.scales.shape[0])


def mma_unsupported(cw: CanonicalWeight) -> str | None:
    """Why ``lqe-w4a16-mma`` cannot run this weight, or ``None``."""
    k, n = cw.shape
    if cw.bits not in (4, 8):
        return f"bits={cw.bits} (lqe-w4a16-mma supports 4 and 8)"
    if k % 8 or n % 8:
        return f"shape K={k}, N={n}: lqe-w4a16-mma needs K and N multiples of 8 (16-byte activation rows)"
    gs = k if cw.group_size == -1 else cw.group_size
    if cw.group_size != -1 and (gs <= 0 or gs % 16):
        return f"group_size={cw.group_size}: lqe-w4a16-mma needs {GROUPS_OK}"
    if not groups_contiguous(cw, gs):
        return ("g_idx groups are not all group_size rows long; lqe-w4a16-mma needs contiguous groups of "
                "group_size rows after sorting")
    return None


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def repack_mma(cw: CanonicalWeight, dtype: torch.dtype = torch.float16) -> PackedMMA:
    """Canonical -> the ``lqe-w4a16-mma`` layout (on ``cw``'s device). Raises ``ValueError`` naming what is
    unsupported."""
    reason = mma_unsupported(cw)
    if reason is not None:
        raise ValueError(f"cannot repack for lqe-w4a16-mma: {reason}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"lqe-w4a16-mma: activation dtype must be float16 or bfloat16, got {dtype}")
    k, n = cw.shape
    gs = k if cw.group_size == -1 else cw.group_size
    k_pad, n_pad = _round_up(k, TILE_K), _round_up(n, TILE_N)
    dev = cw.codes.device
    codes, perm = act_order_codes(cw)
    full = torch.zeros(k_pad, n_pad, dtype=torch.int64, device=dev)
    full[:k, :n] = codes.to(torch.int64)
    frag = gather_fragments(full, 16)  # [k_pad/16, n_pad/64, 32, 8, 4]
    kt, nt = frag.shape[:2]
    words = fragment_words(frag, cw.bits)  # [KT, NT, 32, 4 (4-bit) | 8 (8-bit)]
    v = cw.bits // 4
    # [K/16, N/64, lane, V*4] -> [K/64, slab, N/256, warp, lane, V, 4] -> [K/64, N/256, slab, warp, V, lane, 4]
    words = words.reshape(kt // 4, 4, nt // 4, 4, 32, v, 4).permute(0, 2, 1, 3, 5, 4, 6)
    qweight = _to_int32(words).reshape(kt, -1).contiguous()

    def params(t: torch.Tensor, fill: float) -> torch.Tensor:
        out = torch.full((t.shape[0], n_pad), fill, dtype=dtype, device=dev)
        out[:, :n] = t.to(dtype)
        return permute_columns(out).contiguous()

    scales = params(cw.scales, 0.0)
    zeros = None if cw.zeros is None else params(cw.zeros.float(), 0.0)
    return PackedMMA(qweight, scales, zeros, perm, cw.bits, gs, k, n, k_pad, n_pad)
