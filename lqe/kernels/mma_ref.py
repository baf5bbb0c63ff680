"""Pure-torch emulation of ``lqe-w4a16-mma`` (csrc/gemm/w4a16_mma.cu), written from the kernel's side.

Independent of :mod:`lqe.kernels.repack_mma`, which builds the layout from its description: this module walks
the packed vectors the way the threads read them (block tile, slab, warp, vector, lane), decodes every register
with the kernel's bit operations (``lop3`` masks, ``>> 8`` per tile pair, ``__byte_perm`` selectors, the 0x6400 /
0x4300 / 0x4B000000 magic numbers) and dequantizes with the kernel's half / bfloat16 arithmetic (magic-bias
subtraction or fma that also removes the zero point, exact; then one multiply by the scale, rounded once),
reproduced with integer ops and ``.view(torch.float16 / torch.bfloat16)``. It also reproduces the stripe
schedule (which block computes which piece of which tile, which workspace slot it stores its sums in, and which
piece adds them up). CPU tests of "repack then emulate"
check the layout contract the CUDA code relies on, bit for bit.
"""
from __future__ import annotations

import math

import torch

from lqe.kernels.repack_mma import TILE_K, TILE_N, PackedMMA

MAX_M_TILE = 64  # rows of one kernel launch; a larger M runs as several 64-row problems


def _bits16(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Low 16 bits of int64 ``v`` as a half / bfloat16 bit pattern."""
    v = v & 0xFFFF
    return torch.where(v >= 0x8000, v - 0x10000, v).to(torch.int16).view(dtype)


def _lane_words(p: PackedMMA) -> torch.Tensor:
    """``[K/64, N/256, slab 4, warp 4, lane 32, 4*V]``: the registers a lane holds after its ``ld.shared.v4``
    (vector ``v`` at ``((slab*4 + warp)*V + v)*32 + lane``)."""
    v = p.bits // 4
    w = p.qweight.detach().cpu().to(torch.int64).reshape(p.k_pad // TILE_K, p.n_pad // TILE_N, 4, 4, v, 32, 4)
    return (w & 0xFFFFFFFF).permute(0, 1, 2, 3, 5, 4, 6).reshape(*w.shape[:4], 32, 4 * v)


def _codes_regs(words: torch.Tensor, bits: int, j: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """The 4 register halves of n8 tile ``j`` as raw magic-biased 16/32-bit patterns (int64): elements
    (b0.lo, b0.hi, b1.lo, b1.hi) = rows (2t4, 2t4+1, 2t4+8, 2t4+9)."""
    if bits == 4:
        q = words[..., j // 2] >> (8 * (j % 2))
        if dtype == torch.float16:
            lo = (q & 0x000F000F) | 0x64006400  # lop3<0xEA>(q, 0x000f000f, 0x64006400)
            hi = (q & 0x00F000F0) | 0x64006400  # lop3<0xEA>(q, 0x00f000f0, 0x64006400): 1024 + 16*code
        else:
            lo = (q & 0x000F000F) | 0x43004300
            hi = ((q >> 4) & 0x000F000F) | 0x43004300
        return [lo & 0xFFFF, lo >> 16, hi & 0xFFFF, (hi >> 16) & 0xFFFF]
    w = words[..., j]
    byte = [(w >> (8 * b)) & 0xFF for b in range(4)]
    if dtype == torch.float16:  # __byte_perm(w, 0x64646464, 0x4240 / 0x4341)
        return [0x6400 | byte[0], 0x6400 | byte[2], 0x6400 | byte[1], 0x6400 | byte[3]]
    # bfloat16: __byte_perm(w, 0x4B000000, 0x7540 / 0x7542 / 0x7541 / 0x7543): fp32 2^23 + code
    return [0x4B000000 | byte[0], 0x4B000000 | byte[2], 0x4B000000 | byte[1], 0x4B000000 | byte[3]]


def _dequant(raw: torch.Tensor, e: int, s: torch.Tensor, z: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """``Dq<T, BITS>`` on one register half: ``raw`` magic-biased pattern, ``s`` / ``z`` in ``dtype``."""
    if bits == 8 and dtype == torch.bfloat16:
        f = raw.to(torch.int32).view(torch.float32)
        return ((f - (8388608.0 + z.float())) * s.float()).to(torch.bfloat16)  # __fsub_rn, __fmul_rn, round once
    h = _bits16(raw, dtype)
    if dtype == torch.float16 and bits == 4 and e >= 2:  # b1 came from the 0x00f000f0 mask: 1024 + 16*code
        zhi = (torch.tensor(64.0, dtype=dtype) + z)  # prep: __hadd(64, z), exact
        v = (h.float() * 0.0625 - zhi.float()).to(dtype)  # __hfma2(h, 1/16, -zhi): exact, one rounding
    else:
        magic = 1024.0 if dtype == torch.float16 else 128.0
        v = h - (torch.tensor(magic, dtype=dtype) + z)  # __hsub2(h, magic + z): exact
    return v * s  # __hmul2: rounded once


def dequantize_mma(p: PackedMMA, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[k_pad, n_pad]`` weights in sorted-K order exactly as the kernel's B registers hold them."""
    dtype = dtype or p.scales.dtype
    words = _lane_words(p)  # [KT, NT, 4, 4, 32, 4V]
    kt, nt = words.shape[:2]
    lane = torch.arange(32)
    g8, t4 = lane // 4, lane % 4
    slab = torch.arange(4)
    # the smem scale slot a warp reads for slab s: row min((kt*64 + 16 s) // gs, G - 1) of the stage
    krow0 = torch.arange(kt)[:, None] * TILE_K + slab[None, :] * 16  # [KT, 4]
    grp = torch.clamp(krow0 // p.group_size, max=p.num_groups - 1)
    # stored column a lane loads for tile j: nt*256 + warp*64 + g8*8 + j
    scol = (torch.arange(nt)[:, None, None, None] * TILE_N + torch.arange(4)[None, :, None, None] * 64
            + g8[None, None, :, None] * 8 + torch.arange(8)[None, None, None, :])  # [NT, 4, 32, 8]
    sc = p.scales.detach().cpu().to(dtype)
    zc = None if p.zeros is None else p.zeros.detach().cpu().to(dtype)

    def load(t: torch.Tensor) -> torch.Tensor:  # [KT, NT, slab, warp, lane, 8]
        return t[grp[:, None, :, None, None, None], scol[None, :, None, :, :, :]]

    s_all = load(sc)
    z_all = (torch.full_like(s_all, float(1 << (p.bits - 1))) if zc is None else load(zc))
    out = torch.empty(kt, nt, 4, 4, 32, 8, 4, dtype=dtype)
    for j in range(8):
        regs = _codes_regs(words, p.bits, j, dtype)
        for e in range(4):
            out[..., j, e] = _dequant(regs[e], e, s_all[..., j], z_all[..., j], p.bits, dtype)
    # element e of tile j in lane l: row kt*64 + slab*16 + 2t4 + e%2 + 8*(e//2), col nt*256 + warp*64 + j*8 + g8
    e = torch.arange(4)
    rows = (torch.arange(kt)[:, None, None, None, None, None, None] * TILE_K
            + slab[None, None, :, None, None, None, None] * 16
            + (2 * t4)[None, None, None, None, :, None, None] + (e % 2 + 8 * (e // 2))[None, None, None, None, None, None, :])
    cols = (torch.arange(nt)[None, :, None, None, None, None, None] * TILE_N
            + torch.arange(4)[None, None, None, :, None, None, None] * 64
            + torch.arange(8)[None, None, None, None, None, :, None] * 8 + g8[None, None, None, None, :, None, None])
    shape = out.shape
    w = torch.empty(p.k_pad, p.n_pad, dtype=dtype)
    w[rows.expand(shape).reshape(-1), cols.expand(shape).reshape(-1)] = out.reshape(-1)
    return w


def unpack_mma_codes(p: PackedMMA) -> torch.Tensor:
    """Codes ``[k_pad, n_pad]`` as the kernel sees them: the fp16 decode with scale 1 and zero point 0 (every
    code up to 255 is exact in fp16)."""
    one = torch.ones(p.scales.shape, dtype=torch.float16)
    raw = PackedMMA(p.qweight, one, torch.zeros_like(one), p.perm, p.bits, p.group_size, p.k, p.n, p.k_pad, p.n_pad)
    return dequantize_mma(raw, torch.float16).long()


def gemm_mma_ref(x: torch.Tensor, p: PackedMMA, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W (+ bias)`` the kernel's way: gather x columns by ``perm``, zero-filled K padding (cp.async with
    src-size 0), weights rounded to ``x.dtype`` as decoded, fp32 accumulation, bias in fp32, one rounding."""
    xs = x.detach().cpu()
    if p.perm is not None:
        xs = xs.index_select(-1, p.perm.cpu())
    xp = torch.zeros(*xs.shape[:-1], p.k_pad, dtype=torch.float32)
    xp[..., : p.k] = xs.float()
    w = dequantize_mma(p, x.dtype).float()
    y = (xp @ w)[..., : p.n]
    if bias is not None:
        y = y + bias.detach().cpu().float()
    return y.to(x.dtype)


def stripe_plan(n_tiles: int, k_tiles: int, sms: int) -> tuple[int, int]:
    """``(grid, iters_per_block)`` of one launch: the ``n_tiles * k_tiles`` block-iterations (k fastest) are
    cut into contiguous stripes of ``iters_per_block``, one per resident block (at most ``sms``)."""
    total = n_tiles * k_tiles
    per = math.ceil(total / max(1, min(sms, total)))
    return math.ceil(total / per), per


def tile_stripes(t: int, k_tiles: int, per: int) -> tuple[int, int]:
    """``(first, last)``: the stripes that hold column tile ``t``'s pieces; ``first`` holds its k = 0 piece."""
    return (t * k_tiles) // per, (t * k_tiles + k_tiles - 1) // per


def stripe_pieces(n_tiles: int, k_tiles: int, sms: int) -> list[list[tuple[int, int, int, int]]]:
    """Per stripe (block ``grid - 1 - s`` runs stripe ``s``: :func:`stripe_of_block`), its pieces ``(n_tile, k_lo,
    k_hi, slot)`` as the kernel walks them. A piece above k = 0 stores its partial sums in workspace slot ``slot``
    (``s - first - 1``: the tile's pieces in higher stripes, numbered up from 0) and counts itself in; the k = 0
    piece (``slot = -1``, in the tile's lowest stripe ``first``) waits until all of them are in, then adds the slots
    in order, writes the output and resets the count."""
    grid, per = stripe_plan(n_tiles, k_tiles, sms)
    blocks = []
    for b in range(grid):
        it, end = b * per, min((b + 1) * per, n_tiles * k_tiles)
        pieces = []
        while it < end:
            t, k_lo = divmod(it, k_tiles)
            k_hi = min(k_tiles, k_lo + (end - it))
            pieces.append((t, k_lo, k_hi, -1 if k_lo == 0 else b - tile_stripes(t, k_tiles, per)[0] - 1))
            it += k_hi - k_lo
        blocks.append(pieces)
    return blocks


def workspace_slots(n_tiles: int, k_tiles: int, sms: int) -> int:
    """Workspace slots (of ``64 x n_pad`` floats) a launch needs: the most pieces above k = 0 of one column tile
    (csrc/gemm/w4a16_mma.cu ``mma_workspace_slots``)."""
    _, per = stripe_plan(n_tiles, k_tiles, sms)
    return max(last - first for first, last in (tile_stripes(t, k_tiles, per) for t in range(n_tiles)))


def stripe_of_block(block: int, grid: int) -> int:
    """The stripe block ``block`` runs: ``grid - 1 - block``, so the pieces a k = 0 piece waits on (in higher
    stripes) run in blocks with lower indices, which the GPU dispatches first."""
    return grid - 1 - block


def dispatch_completes(n_tiles: int, k_tiles: int, sms: int, resident: int, reverse: bool = True) -> bool:
    """Whether a launch finishes when only ``resident`` blocks fit on the GPU at a time and blocks are dispatched
    in index order as slots free up (other kernels on the SMs, more stripes than slots): a resident block that
    waits on a stripe whose block is not dispatched yet holds its slot. ``reverse=False`` models block b running
    stripe b instead of :func:`stripe_of_block`."""
    stripes = stripe_pieces(n_tiles, k_tiles, sms)
    grid = len(stripes)
    _, per = stripe_plan(n_tiles, k_tiles, sms)
    pieces = [stripes[stripe_of_block(b, grid) if reverse else b] for b in range(grid)]
    stored = [0] * n_tiles  # pieces above k = 0 counted in, per tile
    cursor, running, next_block, finished = [0] * grid, [], 0, 0
    while finished < grid:
        while len(running) < resident and next_block < grid:
            running.append(next_block)
            next_block += 1
        progressed = False
        for b in list(running):
            while cursor[b] < len(pieces[b]):
                t, _, _, slot = pieces[b][cursor[b]]
                first, last = tile_stripes(t, k_tiles, per)
                if slot < 0 and stored[t] < last - first:
                    break  # the k = 0 piece waits for the tile's other pieces
                if slot >= 0:
                    stored[t] += 1
                cursor[b] += 1
                progressed = True
            if cursor[b] == len(pieces[b]):
                running.remove(b)
                finished += 1
                progressed = True
        if not progressed:
            return False
    return True


def stripe_critical_path(n_tiles: int, k_tiles: int, sms: int) -> int:
    """The launch's length in k-tile iterations when each block computes one k-tile per unit of time and a tile's
    k = 0 piece waits for its other pieces (:func:`stripe_pieces`; the reduction itself counted as free): ``per``
    when no block stalls on another."""
    blocks = stripe_pieces(n_tiles, k_tiles, sms)
    _, per = stripe_plan(n_tiles, k_tiles, sms)
    stored: dict[int, list[int]] = {}  # tile -> times its pieces above k = 0 were stored
    for pieces in blocks:  # a piece above k = 0 never waits: its block's clock alone says when it is stored
        clock = 0
        for t, k_lo, k_hi, slot in pieces:
            clock += k_hi - k_lo
            if slot >= 0:
                stored.setdefault(t, []).append(clock)
    end = 0
    for pieces in blocks:
        clock = 0
        for t, k_lo, k_hi, slot in pieces:
            clock += k_hi - k_lo
            if slot < 0:
                first, last = tile_stripes(t, k_tiles, per)
                assert len(stored.get(t, [])) == last - first
                clock = max([clock] + stored.get(t, []))
        end = max(end, clock)
    return end
