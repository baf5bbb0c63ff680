"""Triton W4A16 / W8A16 GEMM (tensor cores) and dequantize kernels over the lqe CUDA kernel's packed layout.

The kernels read ``PackedWNA16.qweight`` exactly as :mod:`lqe.kernels.repack` lays it out for the CUDA GEMM
(16x64 fragment tiles, see that module), so a layer keeps ONE copy of its 4/8-bit weights whichever kernel
runs: a ``[BLOCK_K/16, BLOCK_N*bits/2]`` int32 tile is contiguous along N (wide loads), each word is split
into its nibbles/bytes by broadcast shifts into an 8-D (4-bit) / 7-D (8-bit) tensor whose axes are the bits
of (row, column) inside the fragment tile, and one ``tl.permute`` + ``tl.reshape`` turns that into the
``[BLOCK_K, BLOCK_N]`` operand of ``tl.dot``. The permutation adds no pass of its own (Triton 3.6 folds it into
a linear layout; the dequantized operand goes through shared memory on its way to the tensor cores anyway), but
those shared-memory stores are partly 16-bit wide: part of the instruction count below.

GEMM (``FACTORED``): codes become floats with one OR (``0x4300 | q`` is ``128 + q`` in bf16, ``0x6400 | q`` is
``1024 + q`` in fp16; 8-bit bf16 converts), the zero point (``z + C``) is subtracted in the activation dtype
(exact small integers, packed HADD2 on sm_90), ``d = x_blk @ (q - z)`` runs on the tensor cores in fp32 and
``acc += d * s``: the group scale is applied on ``[BLOCK_M, BLOCK_N]`` per K block instead of on every weight.
Every K block lies inside one group (``group_size % BLOCK_K == 0``, or one group over K), which also covers a
short last group. ``FACTORED=False`` dequantizes each weight (``(q - z) * s`` rounded to the activation dtype,
as the CUDA kernel does) and accumulates with ``tl.dot(x, w, acc)`` (fewer live registers: large tiles).
(sm_90 SASS, bf16 4-bit, BM=16 BN=128 BK=128: ~5.3 instructions per weight per K block, no spills; measured
alternatives: a rowsum correction instead of the subtraction cost 12.6, with the rowsum on the tensor cores
it spilled.) Split-K writes fp32 partials ``[S, M, N]`` that a second kernel sums in a fixed order
(deterministic, no atomics, no host sync): every launch parameter is a host function of shapes, so the calls
can be captured in a CUDA graph.

Swapped operands (``swap_ab``, Hopper): the kernel computes ``out^T = W^T @ x^T``, so the dequantized weight
tile is the first ``tl.dot`` operand and the activation tile the second. On sm_90 Triton then issues ``wgmma`` with
the weights in registers (``A`` from registers is what wgmma allows; ``B`` must come from shared memory): the
dequantized weights never go through shared memory, the activations arrive there by ``cp.async``, and the token
count is wgmma's N (8..256), so M = 16 needs no padding to a 64-row tile. Without the swap the dequantized weights are
wgmma's ``B`` and are stored to shared memory first (the instruction count above); at M <= 64 the tile's 64 wgmma
rows are mostly padding. (sm_90 PTX from Triton 3.9: ``wgmma.mma_async ... m64n16k16 ... {a registers}, b-desc``;
``tests/test_triton_wna16.py`` checks it.) Same layout, same arithmetic per weight, same split-K. Counted first
(sm_90 SASS of the K loop, Triton 3.9, bf16 4-bit, BK=BN=128): 5.1 thread-instructions per weight swapped against 6.7
plain (the STS of the dequantized tile and its PRMTs are gone). An H100 issues about 33e12 thread-instructions/s
and streams 6.7e12 4-bit weights/s, so about 5 instructions per weight is the budget at which a decode-sized M is
still bandwidth-bound: by this count alone the plain kernel can stream weights at ~75 % of copy speed, the
swapped one at ~98 % (an upper bound: the GPU measures the rest).

Configs come from :func:`pick_config` (a small table per M bucket, then split-K from the SM count), never
from ``triton.autotune`` at call time; :func:`sweep_configs` lists the candidates ``benchmarks/kernels.py
--wna16-sweep`` times so the table can be chosen from one GPU run.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

from lqe.kernels.device_info import sm_count as device_sm_count
from lqe.kernels.repack import PackedWNA16
from lqe.kernels.triton_pdl import pdl_args, pdl_start

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True, slots=True)
class WNA16Config:
    """One launch configuration. ``split_k=0``: chosen from the grid size and SM count."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 0
    factored: bool = True
    swap_ab: bool = False  # out^T = W^T x^T: the weights are the dot's register operand (wgmma A on Hopper)

    def label(self) -> str:
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"
                f"{'' if self.split_k == 0 else f'x{self.split_k}'}{'' if self.factored else '-dq'}"
                f"{'-t' if self.swap_ab else ''}")


# Per M bucket (first row with max_m >= M). NEEDS MEASUREMENT: `benchmarks/kernels.py --wna16-sweep` prints
# the best candidate per (shape, M); copy the winners here. Register use of these (sm_90, Triton 3.6, bf16 4-bit,
# checked with cuobjdump): 196 / ~200 / 251 / 254 registers, no spills. The factored form keeps a second
# [BM, BN] fp32 tile (the block's dot) live, so large tiles use FACTORED=False (BM=128 x BN=256 spills either way).
CONFIG_TABLE: list[tuple[int | None, WNA16Config]] = [
    (16, WNA16Config(16, 128, 128, 4, 4)),
    (32, WNA16Config(32, 128, 128, 4, 4)),
    (64, WNA16Config(64, 128, 64, 4, 4)),
    (None, WNA16Config(128, 128, 64, 8, 3, factored=False)),
]
# The swapped-operand kernel per M bucket (``triton-wna16-swap``, dispatch.WNA16_TABLE's M = 3..128): BLOCK_N is
# wgmma's M (64 per warp group), BLOCK_M its N (the tokens). Registers on sm_90 (Triton 3.9 PTX, ptxas, bf16 4-bit /
# fp16 8-bit), rows in order: 167 / 218 / 182, no spills (the 128-token tile below: 254). Measured there and left out:
# m64n128k64 with 4 warps (96 B of spills), m128n128k64 factored (48), every 256-token tile and every 16-warp tile
# (hundreds). The 64-token tile serves every M above 32 since the H200 sweep at 50fb9ce
# (benchmarks/results/kernels-wna16-sweep-nvidia-h200.json, 4096x6144 and 14336x4096): at M = 128 / 256 / 1024 it ran
# 0.69 / 0.62 / 0.62x cuBLAS bf16, the best Triton config at each M, where the 128-token tile (SWAP_TILE_128, the
# last row before) ran 0.40 / 0.34 / 0.36x.
SWAP_TILE_128 = WNA16Config(128, 128, 64, 8, 4, factored=False, swap_ab=True)
SWAP_CONFIG_TABLE: list[tuple[int | None, WNA16Config]] = [
    (16, WNA16Config(16, 128, 128, 4, 4, swap_ab=True)),
    (32, WNA16Config(32, 128, 128, 4, 4, swap_ab=True)),
    (None, WNA16Config(64, 128, 64, 8, 4, swap_ab=True)),
]
CTAS_PER_SM = 2  # split-K aims for this many CTAs per SM. NEEDS MEASUREMENT
MIN_K_BLOCKS_PER_SPLIT = 4  # never split K finer than this many BLOCK_K blocks
MAX_SPLIT_K = 16
DEQUANT_BLOCK = (64, 256)  # (K rows, N columns) per dequantize program


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why the Triton W4A16 kernels cannot run on ``device`` (``None``: they can)."""
    device = torch.device(device)
    if triton is None:
        return "triton is not installed"
    if device.type != "cuda" and not (_INTERPRET and device.type == "cpu"):
        return f"device is {device.type}, triton-wna16 needs cuda"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return "compute capability < 8.0 (bf16 tensor cores need Ampere+)"
    return None


def sm_count(device: torch.device) -> int:
    return device_sm_count(device, cpu_default=4)  # interpreter: small, fixed, so CPU tests exercise split-K


def fit_block_k(block_k: int, group_size: int, k: int) -> int:
    """The largest power-of-two ``<= block_k`` (>= 16) whose K blocks never straddle a group boundary."""
    bk = block_k
    while bk > 16 and not (group_size % bk == 0 or group_size >= k):
        bk //= 2
    return bk


def resolve(cfg: WNA16Config, m: int, n: int, k: int, group_size: int,
            device: torch.device) -> tuple[WNA16Config, int, int]:
    """``(config with fitted block_k, split count S, K blocks per split)``; a pure function of shapes. S divides
    the number of K blocks (the largest divisor not above the wanted count)."""
    bk = fit_block_k(cfg.block_k, group_size, k)
    kblocks = -(-k // bk)
    split = cfg.split_k
    if split == 0:
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        split = max(1, min(MAX_SPLIT_K, (sm_count(device) * CTAS_PER_SM) // tiles, kblocks // MIN_K_BLOCKS_PER_SPLIT))
    split = max(1, min(split, kblocks))
    while kblocks % split:
        split -= 1
    return replace(cfg, block_k=bk, split_k=split), split, kblocks // split


def pick_config(m: int, n: int, k: int, swap_ab: bool = False) -> WNA16Config:
    """The table's config for ``m`` tokens (:data:`SWAP_CONFIG_TABLE` with ``swap_ab``; block_k and split-K are
    fitted later by :func:`resolve`)."""
    table = SWAP_CONFIG_TABLE if swap_ab else CONFIG_TABLE
    for max_m, cfg in table:
        if max_m is None or m <= max_m:
            return cfg
    return table[-1][1]


def sweep_configs(m: int) -> list[WNA16Config]:
    """Candidates worth timing for ``m`` tokens (small on purpose: the whole sweep must run in minutes). The
    table's own config comes first."""
    C = WNA16Config
    if m <= 32:
        bm = 16 if m <= 16 else 32
        out = [C(bm, bn, 128, 4, st) for bn in (64, 128, 256) for st in (3, 5)] + [C(bm, 128, 64, 4, 4)]
        out += [C(bm, 128, 128, 4, 4, split_k=1), C(bm, 128, 128, 8, 4)]
    elif m <= 64:
        out = [C(64, bn, bk, 4, st) for bn in (64, 128) for bk in (64, 128) for st in (3, 4)]
        out += [C(64, 128, 64, 8, 4), C(64, 128, 64, 4, 4, factored=False)]
    else:
        out = [C(128, 128, 64, 8, st, factored=False) for st in (3, 4)]
        out += [C(128, 256, 64, 8, 3, factored=False), C(64, 128, 64, 4, 4), C(64, 256, 64, 8, 3, factored=False),
                C(128, 128, 32, 4, 4, factored=False), C(128, 128, 64, 8, 3)]
    swapped = pick_config(m, 0, 0, swap_ab=True)  # the swapped-operand kernel's table config and neighbours
    out += [swapped, replace(swapped, block_n=64)] if m <= 64 else \
        [swapped, replace(swapped, num_stages=3), SWAP_TILE_128, replace(SWAP_TILE_128, num_stages=3)]
    first = pick_config(m, 0, 0)
    return [first] + list(dict.fromkeys(c for c in out if c != first))


# --------------------------------------------------------------------------------------------------- kernels

def _dq4_asm(magic: int, one: int, minus: int, ty: str) -> str:
    """PTX of ``_dq4_magic``: the 4 pairs of one 4-bit word, each ``lop3``-ed into the mantissas of a ``magic``
    pair ((w & 0x000f000f) | magic), then one packed ``fma`` (``* one + minus``: minus = -(MAGIC_C + 8)); outputs
    $0..$7 are nibble positions 0, 16, 4, 20, 8, 24, 12, 28 (low half of each pair first)."""
    m, lines = f"0x{magic:04x}{magic:04x}", []
    for r in range(4):
        src = "$8" if r == 0 else f"q{r - 1}"
        if r:
            lines.append(f"shr.u32 q{r - 1}, $8, {4 * r};")
        lines.append(f"lop3.b32 t{r}, {src}, 0x000f000f, {m}, 0xea;")
    lines += [f"fma.rn.{ty} t{r}, t{r}, one, c;" for r in range(4)]
    lines += [f"mov.b32 {{${2 * r}, ${2 * r + 1}}}, t{r};" for r in range(4)]
    return ("{ .reg .b32 t<4>, q<3>, one, c; "
            f"mov.b32 one, 0x{one:04x}{one:04x}; mov.b32 c, 0x{minus:04x}{minus:04x}; " + " ".join(lines) + " }")


_DQ4_ASM_BF16 = tl.constexpr(_dq4_asm(0x4300, 0x3F80, 0xC308, "bf16x2")) if triton is not None else None  # -136
_DQ4_ASM_F16 = tl.constexpr(_dq4_asm(0x6400, 0x3C00, 0xE408, "f16x2")) if triton is not None else None  # -1032

if triton is not None:

    @triton.jit
    def _unpack_codes(words, KT: tl.constexpr, NT: tl.constexpr, BITS: tl.constexpr):
        """int32 words ``[KT, NT*32*BITS]`` (fragment layout) -> int32 codes ``[KT*16, NT*64]`` (K x N)."""
        if BITS == 4:
            # word (g8, t4, w), nibble p = 4*p2 + 2*p1 + p0 holds row 8*p0 + 2*t4 + p2, column 16*w + 8*p1 + g8
            w = tl.reshape(words, (KT, NT, 8, 4, 4, 1, 1, 1))
            p2 = tl.arange(0, 2)[:, None, None]
            p1 = tl.arange(0, 2)[None, :, None]
            p0 = tl.arange(0, 2)[None, None, :]
            shift = tl.reshape(16 * p2 + 8 * p1 + 4 * p0, (1, 1, 1, 1, 1, 2, 2, 2))
            v = (w >> shift) & 0xF  # [KT, NT, g8, t4, w, p2, p1, p0]
            v = tl.permute(v, (0, 7, 3, 5, 1, 4, 6, 2))  # [KT, p0, t4, p2, NT, w, p1, g8]
        else:
            # word (g8, t4, j), byte b = 2*b1 + b0 holds row 8*b0 + 2*t4 + b1, column 8*j + g8
            w = tl.reshape(words, (KT, NT, 8, 4, 8, 1, 1))
            b1 = tl.arange(0, 2)[:, None]
            b0 = tl.arange(0, 2)[None, :]
            shift = tl.reshape(16 * b1 + 8 * b0, (1, 1, 1, 1, 1, 2, 2))
            v = (w >> shift) & 0xFF  # [KT, NT, g8, t4, j, b1, b0]
            v = tl.permute(v, (0, 6, 3, 5, 1, 4, 2))  # [KT, b0, t4, b1, NT, j, g8]
        return tl.reshape(v, (KT * 16, NT * 64))

    @triton.jit
    def _dq4_magic(words, KT: tl.constexpr, NT: tl.constexpr, MAGIC: tl.constexpr, MAGIC_C: tl.constexpr,
                   ZC: tl.constexpr, USE_ASM: tl.constexpr, DT_BF16: tl.constexpr, F32: tl.constexpr):
        """4-bit int32 words ``[KT, NT*128]`` (fragment layout) -> ``q - zc`` ``[KT*16, NT*64]`` (activation dtype, or
        fp32 when ``F32``; exact small integers). One word gives 4 packed pairs: pair r = nibble positions (r, r+4),
        i.e. rows (2t4 + 8*p0, +1) of column 16w + 8*p1 + g8 (r = 2*p1 + p0): ``lop3`` puts each pair into the
        mantissas of a ``MAGIC`` pair, one packed ``fma`` subtracts ``MAGIC_C + ZC``. ``USE_ASM=False`` (interpreter)
        computes the same 8 values per word with Triton ops and builds the same tensor (same join tree)."""
        if USE_ASM:
            if DT_BF16:
                o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                    _DQ4_ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
            else:
                o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                    _DQ4_ASM_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        else:
            dt = tl.bfloat16 if DT_BF16 else tl.float16
            o0 = _dq4_ref(words, 0, MAGIC, MAGIC_C, ZC, dt, F32)
            o1 = _dq4_ref(words, 16, MAGIC, MAGIC_C, ZC, dt, F32)
            o2 = _dq4_ref(words, 4, MAGIC, MAGIC_C, ZC, dt, F32)
            o3 = _dq4_ref(words, 20, MAGIC, MAGIC_C, ZC, dt, F32)
            o4 = _dq4_ref(words, 8, MAGIC, MAGIC_C, ZC, dt, F32)
            o5 = _dq4_ref(words, 24, MAGIC, MAGIC_C, ZC, dt, F32)
            o6 = _dq4_ref(words, 12, MAGIC, MAGIC_C, ZC, dt, F32)
            o7 = _dq4_ref(words, 28, MAGIC, MAGIC_C, ZC, dt, F32)
        # o(2r + h) = nibble position r + 4h: h = p2 (row +1), r = 2*p1 + p0. tl.join appends its axis last and
        # makes it the fastest register axis: the outermost join is over h, so (o0, o1) etc. stay one 32-bit pair.
        v = tl.join(tl.join(tl.join(o0, o2), tl.join(o4, o6)), tl.join(tl.join(o1, o3), tl.join(o5, o7)))
        v = tl.reshape(v, (KT, NT, 8, 4, 4, 2, 2, 2))  # [KT, NT, g8, t4, w, p0, p1, p2]
        v = tl.permute(v, (0, 5, 3, 7, 1, 4, 6, 2))  # [KT, p0, t4, p2, NT, w, p1, g8]
        return tl.reshape(v, (KT * 16, NT * 64))

    @triton.jit
    def _dq4_ref(words, SHIFT: tl.constexpr, MAGIC: tl.constexpr, MAGIC_C: tl.constexpr, ZC: tl.constexpr,
                 dt: tl.constexpr, F32: tl.constexpr):
        """Pair element ``SHIFT`` of every word as ``q - ZC`` (the interpreter form of :func:`_dq4_magic`)."""
        qf = (((words >> SHIFT) & 0xF) | MAGIC).to(tl.int16).to(dt, bitcast=True)  # = MAGIC_C + q, exactly
        if F32:
            return qf.to(tl.float32) - (MAGIC_C + ZC)
        return qf - (MAGIC_C + ZC)

    @triton.jit
    def _load_codes(QW, k0, n0, K, N, BK: tl.constexpr, BN: tl.constexpr, BITS: tl.constexpr):
        """Codes ``[BK, BN]`` of rows ``k0..`` and columns ``n0..`` (both multiples of 16 / 64); 0 outside."""
        KT: tl.constexpr = BK // 16
        WPT: tl.constexpr = 32 * BITS  # int32 words per 16x64 tile
        kt = k0 // 16 + tl.arange(0, KT)
        wc = (n0 // 64) * WPT + tl.arange(0, BN // 64 * WPT)
        row_words = (N // 64) * WPT
        ptr = QW + kt.to(tl.int64)[:, None] * row_words + wc[None, :]
        mask = (kt[:, None] < K // 16) & (wc[None, :] < row_words)
        words = tl.load(ptr, mask=mask, other=0)
        return _unpack_codes(words, KT, BN // 64, BITS)

    @triton.jit
    def _stored_col(cols):
        """Scale/zero storage column of logical column ``cols`` (permuted inside every 64-block)."""
        return (cols // 64) * 64 + (cols % 8) * 8 + (cols % 64) // 8

    @triton.jit
    def _group_sz(s_ptrs, z_ptrs, k, group_size, N, n_mask, HAS_ZP: tl.constexpr, EVEN_N: tl.constexpr,
                  BITS: tl.constexpr, BN: tl.constexpr, GS_SHIFT: tl.constexpr):
        """Scales and zero points (fp32, ``[BN]``) of the group holding K row ``k``; ``GS_SHIFT`` >= 0: the group
        size is ``1 << GS_SHIFT`` (a shift, where a runtime division cost ~25 instructions per K block)."""
        if GS_SHIFT >= 0:
            g_off = (k >> GS_SHIFT) * N
        else:
            g_off = (k // group_size) * N
        if EVEN_N:
            s = tl.load(s_ptrs + g_off).to(tl.float32)
        else:
            s = tl.load(s_ptrs + g_off, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZP:
            if EVEN_N:
                z = tl.load(z_ptrs + g_off).to(tl.float32)
            else:
                z = tl.load(z_ptrs + g_off, mask=n_mask, other=0.0).to(tl.float32)
        else:
            z = tl.full((BN,), 1 << (BITS - 1), tl.float32)
        return s, z

    @triton.jit
    def _wna16_gemm_kernel(X, QW, S, Z, Bias, Out, Part, M, N, K, group_size, k_iters, stride_xm, stride_om,
                           BITS: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
                           MAGIC: tl.constexpr, MAGIC_C: tl.constexpr, FACTORED: tl.constexpr,
                           EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
                           SWAP_AB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr, GROUP_M: tl.constexpr, ASM_DQ: tl.constexpr, GS_SHIFT: tl.constexpr,
                           PDL: tl.constexpr):
        pdl_start(PDL)  # (lqe.kernels.triton_pdl)
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        grid_m = tl.cdiv(M, BM)
        grid_n = tl.cdiv(N, BN)
        width = GROUP_M * grid_n  # L2 swizzle: GROUP_M row tiles walk the same weight columns together
        group_id = pid // width
        first_m = group_id * GROUP_M
        size_m = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m

        offs_m = pid_m * BM + tl.arange(0, BM)
        n0 = pid_n * BN
        offs_n = n0 + tl.arange(0, BN)
        n_mask = offs_n < N
        scol = _stored_col(offs_n)
        dt = X.dtype.element_ty
        KT: tl.constexpr = BK // 16
        WPT: tl.constexpr = 32 * BITS  # int32 words per 16x64 fragment tile
        row_words = (N // 64) * WPT
        k_lo = pid_k * (k_iters * BK)
        offs_k = k_lo + tl.arange(0, BK)
        kt = k_lo // 16 + tl.arange(0, KT)
        wc = (n0 // 64) * WPT + tl.arange(0, BN // 64 * WPT)
        m_mask = offs_m < M
        # pointers advance by one K block per iteration (no per-iteration index math beyond the add)
        x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = QW + kt.to(tl.int64)[:, None] * row_words + wc[None, :]
        s_ptrs = S + scol
        z_ptrs = Z + scol
        if SWAP_AB:
            acc = tl.zeros((BN, BM), dtype=tl.float32)  # out^T: the weights are the dot's first operand
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for it in range(k_iters):  # splits divide the K blocks evenly: no empty or ragged split
            k0 = k_lo + it * BK
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            else:
                x = tl.load(x_ptrs, mask=m_mask[:, None] & (offs_k[None, :] < K - it * BK), other=0.0)
            if EVEN_K and EVEN_N:
                words = tl.load(w_ptrs)
            else:
                words = tl.load(w_ptrs, mask=(kt[:, None] < K // 16 - it * KT) & (wc[None, :] < row_words), other=0)
            if ASM_DQ == 0:
                q = _unpack_codes(words, KT, BN // 64, BITS)
            s, z = _group_sz(s_ptrs, z_ptrs, k0, group_size, N, n_mask, HAS_ZP, EVEN_N, BITS, BN, GS_SHIFT)
            if DOT_F32:  # interpreter: its bf16 arithmetic and dot are wrong, stay in fp32
                x = x.to(tl.float32)
            if FACTORED and ASM_DQ != 0:  # symmetric 4-bit, magic-number dequantization (ASM_DQ=2: interpreter form)
                qf = _dq4_magic(words, KT, BN // 64, MAGIC, MAGIC_C, 1 << (BITS - 1), ASM_DQ == 1,
                                X.dtype.element_ty == tl.bfloat16, DOT_F32)
                if SWAP_AB:
                    acc += tl.dot(tl.trans(qf), tl.trans(x)) * s[:, None]
                else:
                    acc += tl.dot(x, qf) * s[None, :]
            elif FACTORED:
                if MAGIC != 0:
                    qf = (q | MAGIC).to(tl.int16).to(dt, bitcast=True)  # = MAGIC_C + q, exactly
                else:
                    qf = q.to(tl.float32).to(dt)  # exact: codes < 256
                if DOT_F32:
                    qf = qf.to(tl.float32) - (z + MAGIC_C)[None, :]
                else:
                    qf = qf - (z + MAGIC_C).to(dt)[None, :]  # q - z: exact small integers (packed HSUB2)
                if SWAP_AB:
                    acc += tl.dot(tl.trans(qf), tl.trans(x)) * s[:, None]
                else:
                    acc += tl.dot(x, qf) * s[None, :]
            else:
                w = ((q.to(tl.float32) - z[None, :]) * s[None, :]).to(dt)
                if DOT_F32:
                    w = w.to(tl.float32)
                if SWAP_AB:
                    acc = tl.dot(tl.trans(w), tl.trans(x), acc)
                else:
                    acc = tl.dot(x, w, acc)
            x_ptrs += BK
            w_ptrs += KT * row_words
        if SWAP_AB:
            acc = tl.trans(acc)
        mask = (offs_m[:, None] < M) & n_mask[None, :]
        if SPLIT:
            tl.store(Part + (pid_k * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :], acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(Out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], acc.to(Out.dtype.element_ty),
                     mask=mask)

    @triton.jit
    def _splitk_reduce_kernel(Part, Bias, Out, M, N, stride_om, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                              BM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)  # (lqe.kernels.triton_pdl)
        offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        idx = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for s in tl.static_range(SPLITS):  # fixed order: deterministic; unrolled, every split in flight
            acc += tl.load(Part + s * M * N + idx, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], acc.to(Out.dtype.element_ty),
                 mask=mask)

    @triton.jit
    def _wna16_dequant_kernel(QW, S, Z, W, N, K, group_size, n_lo, n_hi, stride_w, BITS: tl.constexpr,
                              HAS_ZP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
        """Columns ``n_lo .. n_hi`` (``n_lo`` a multiple of 64) of the dense weights into ``W`` (row stride
        ``stride_w``, column 0 = ``n_lo``)."""
        k0 = tl.program_id(0) * BK
        n0 = n_lo + tl.program_id(1) * BN
        KT: tl.constexpr = BK // 16
        q = tl.reshape(_load_codes(QW, k0, n0, K, N, BK, BN, BITS).to(tl.float32), (KT, 16, BN))
        offs_n = n0 + tl.arange(0, BN)
        kt = k0 // 16 + tl.arange(0, KT)
        pmask = (kt[:, None, None] < K // 16) & (offs_n[None, None, :] < n_hi)
        sidx = (kt * 16 // group_size)[:, None, None] * N + _stored_col(offs_n)[None, None, :]
        s = tl.load(S + sidx, mask=pmask, other=0.0).to(tl.float32)
        if HAS_ZP:
            z = tl.load(Z + sidx, mask=pmask, other=0.0).to(tl.float32)
        else:
            z = (1 << (BITS - 1)) * 1.0
        # (q - z) is an exact small integer and s has <= 11 significant bits: one rounding, as the CUDA kernel
        w = tl.reshape((q - z) * s, (BK, BN)).to(W.dtype.element_ty)
        offs_k = k0 + tl.arange(0, BK)
        mask = (offs_k[:, None] < K) & (offs_n[None, :] < n_hi)
        tl.store(W + offs_k.to(tl.int64)[:, None] * stride_w + (offs_n - n_lo)[None, :], w, mask=mask)


def _magic(dtype: torch.dtype, bits: int) -> tuple[int, float]:
    """``(OR mask, value it adds)`` turning a code into a float with one OR; ``(0, 0)``: convert instead."""
    if dtype == torch.float16:
        return 0x6400, 1024.0  # 1024 + q exact for q < 1024
    if bits == 4:
        return 0x4300, 128.0  # bf16: 128 + q exact for q < 128
    return 0, 0.0  # bf16 8-bit: 128 + 255 is not representable


def _gs_shift(group_size: int) -> int:
    """log2 of a power-of-two group size (the kernel shifts), else -1 (it divides)."""
    return group_size.bit_length() - 1 if group_size > 0 and group_size & (group_size - 1) == 0 else -1


def _asm_dq(cfg: WNA16Config, p, magic: int) -> int:
    """How the swap-AB kernel dequantizes symmetric 4-bit codes: 1 = one ``lop3`` per packed pair into a magic-number
    fp16 / bf16 pair and one packed ``fma`` (inline PTX, as the CUDA kernels' ``Dq<T, 4>``), 2 = the same values and
    layout from Triton ops (the interpreter runs no PTX), 0 = the generic unpack. A SASS review (sm_90, Triton 3.6)
    counted 22 instructions per 8 weights for the generic form and 11 for this one; the swap kernel at M = 16 went
    from 536 to 338 instructions per K tile (issue-bound before: ~3.4 TB/s at most), without its shared-memory round
    trip of the dequantized tile. The plain kernel stays generic (Triton 3.6 re-lays its operand: no gain there).
    Bit-identical: (MAGIC_C + q) * 1 - (MAGIC_C + 8) is exact in round-to-nearest. Not measured yet."""
    if magic == 0 or p.bits != 4 or p.zeros is not None or not cfg.factored or not cfg.swap_ab:
        return 0
    return 2 if _INTERPRET else 1


def gemm(x: torch.Tensor, p: PackedWNA16, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
         config: WNA16Config | None = None) -> torch.Tensor:
    """``x [M, K] @ W + bias`` for contiguous ``x`` already gathered by ``p.perm`` (act-order), in x's dtype."""
    m, k = x.shape
    n = p.n
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg, split, k_iters = resolve(config or pick_config(m, n, k), m, n, k, p.group_size, x.device)
    magic, magic_c = _magic(x.dtype, p.bits)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    _wna16_gemm_kernel[grid](
        x, p.qweight, p.scales, p.zeros if p.zeros is not None else p.scales, bias if bias is not None else p.scales,
        out, part, m, n, k, p.group_size, k_iters, x.stride(0), out.stride(0),
        BITS=p.bits, HAS_ZP=p.zeros is not None, HAS_BIAS=bias is not None, MAGIC=magic, MAGIC_C=magic_c,
        FACTORED=cfg.factored, EVEN_K=k % cfg.block_k == 0, EVEN_N=n % cfg.block_n == 0, SPLIT=split > 1,
        DOT_F32=_INTERPRET and x.dtype == torch.bfloat16, SWAP_AB=cfg.swap_ab,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=8,
        ASM_DQ=_asm_dq(cfg, p, magic), GS_SHIFT=_gs_shift(p.group_size),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x.device))
    if split > 1:
        rbm, rbn = 16, 256
        _splitk_reduce_kernel[(triton.cdiv(m, rbm), triton.cdiv(n, rbn))](
            part, bias if bias is not None else part, out, m, n, out.stride(0), SPLITS=split,
            HAS_BIAS=bias is not None, BM=rbm, BN=rbn, num_warps=4, **pdl_args(x.device))
    return out


def dequantize(p: PackedWNA16, out: torch.Tensor | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
    """Dense ``[K, N]`` weights in sorted-K order and the scales' dtype (bit-equal to the CUDA dequantize); with
    ``cols = (lo, hi)`` (``lo`` a multiple of 64) only those columns, ``[K, hi - lo]`` (``out`` may be a view with
    a longer row stride)."""
    lo, hi = cols or (0, p.n)
    if lo % 64 or not 0 <= lo < hi <= p.n:
        raise ValueError(f"dequantize cols {cols}: need 0 <= lo < hi <= N={p.n} with lo a multiple of 64")
    if out is None:
        out = torch.empty(p.k, hi - lo, dtype=p.scales.dtype, device=p.qweight.device)
    if out.shape != (p.k, hi - lo) or out.stride(1) != 1:
        raise ValueError(f"dequantize out {tuple(out.shape)} (strides {out.stride()}): need [{p.k}, {hi - lo}] "
                         "with contiguous rows")
    bk, bn = DEQUANT_BLOCK
    _wna16_dequant_kernel[(triton.cdiv(p.k, bk), triton.cdiv(hi - lo, bn))](
        p.qweight, p.scales, p.zeros if p.zeros is not None else p.scales, out, p.n, p.k, p.group_size, lo, hi,
        out.stride(0), BITS=p.bits, HAS_ZP=p.zeros is not None, BK=bk, BN=bn, num_warps=8)
    return out


def l2_chunk_cols(k: int, n: int, device: torch.device) -> int | None:
    """Columns per dequantize + cuBLAS chunk whose bf16/fp16 weights fit in half the GPU's L2 (a multiple of 256,
    at least 512), or None (one pass: it all fits, or no CUDA device). NOT MEASURED: the hypothesis the
    ``triton-dequant-l2+cublas`` row tests is that cuBLAS then reads each chunk from L2 while it is still there,
    so the dense weights never make the round trip through HBM that costs dequantize + cuBLAS its ~25 % at large M."""
    if device.type != "cuda":
        return None
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    cols = max(512, (l2 // 2) // (2 * k) // 256 * 256)
    return cols if cols < n else None


def dequant_matmul(x: torch.Tensor, p: PackedWNA16, bias: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, chunk_cols: int | None = None) -> torch.Tensor:
    """Triton dequantize into a temporary ``[K, N]`` + cuBLAS (prefill-sized M); with ``chunk_cols`` (a multiple of
    64) the weights go ``chunk_cols`` columns at a time through one ``[K, chunk_cols]`` buffer, each chunk's GEMM
    right after its dequantize (``triton-dequant-l2+cublas``: :func:`l2_chunk_cols`)."""
    if out is None:
        out = torch.empty(x.shape[0], p.n, dtype=x.dtype, device=x.device)
    if chunk_cols is None or chunk_cols >= p.n:
        w = dequantize(p, torch.empty(p.k, p.n, dtype=x.dtype, device=x.device))
        if bias is None:
            return torch.matmul(x, w, out=out)
        return torch.addmm(bias, x, w, out=out)
    if chunk_cols % 64:
        raise ValueError(f"chunk_cols={chunk_cols} must be a multiple of 64 (the weight layout's column tile)")
    buf = torch.empty(p.k, chunk_cols, dtype=x.dtype, device=x.device)
    for lo in range(0, p.n, chunk_cols):
        hi = min(p.n, lo + chunk_cols)
        w = dequantize(p, buf[:, :hi - lo], cols=(lo, hi))
        if bias is None:
            torch.mm(x, w, out=out[:, lo:hi])
        else:
            torch.addmm(bias[lo:hi], x, w, out=out[:, lo:hi])
    return out


def flops_bytes(m: int, n: int, k: int, bits: int, group_size: int, has_zp: bool) -> tuple[float, float]:
    """``(FLOPs, minimal bytes)`` of one GEMM call (bf16/fp16 activations; used by the benchmark)."""
    groups = math.ceil(k / group_size)
    wbytes = k * n * bits / 8 + groups * n * 2 * (2 if has_zp else 1)
    return 2.0 * m * n * k, wbytes + 2 * m * k + 2 * m * n
