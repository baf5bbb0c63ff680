"""Triton kernels for paged attention: prefill over a cached prefix, split-K decode (+ reduce); the KV store
(``lqe.kernels.triton_kv_store``) is re-exported here.

Layout (see ``lqe.forward_context``): ``query [T, H, D]``, ``kv_cache [2, num_blocks, block_size, KVH, D]``.
A step may mix decode rows (query length 1) and prefill rows (a chunk of new tokens after ``seq_len - q_len``
cached ones). The decode kernel is launched over every sequence and skips the prefill rows; it never reads host
data, so a decode-only step can be captured in a CUDA graph (the number of splits is fixed per launch; split
lengths are computed in the kernel from the device ``seq_lens``). The prefill kernel is launched over the step's
tile map (``lqe.kernels.prefill_tiles``: the (sequence, m-tile) pairs of its prefill rows, built once per step
from the host lists), so a mixed step runs no idle programs; with GQA one program covers all query heads of a
KV head (rows = tokens x heads), so each K/V tile is loaded once per KV head.

Prefill reads its own new K/V back from the cache (they are stored first), which keeps one code path for
"no prefix", "prefix-cached prefix" and chunked prefill. Softmax runs in base 2 with the scale folded in.

fp8 cache (``QUANT``): the store kernel writes ``x / scale`` saturated to the format's range; the attention
kernels load fp8 tiles, widen them (exactly) to the query dtype, and apply the scales in fp32: ``k_scale``
folds into the score scale, ``v_scale`` multiplies the output. The scales are read from device tensors, so a
captured CUDA graph follows them. No dequantized copy of the cache is ever made.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lqe.forward_context import AttentionMetadata
from lqe.kernels.attention_plan import choose_num_splits
from lqe.kernels.prefill_tiles import step_plan
from lqe.kernels.triton_kv_store import _check_cache, _scales, _store_kv_kernel, store_kv  # noqa: F401 (re-exported)
from lqe.kernels.triton_pdl import pdl_args, pdl_start

_LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# --------------------------------------------------------------------------------------------- shared
@triton.jit
def _kv_tile(KV, table, offs_n, n_mask, offs_d, d_mask, kvh, q, stride_kv, stride_blk, stride_slot, stride_ch,
             PAGE: tl.constexpr):
    """K and V ``[BLOCK_N, BLOCK_D]`` of KV head ``kvh`` at a sequence's positions ``offs_n`` (paged through its block
    table row ``table``; masked rows read 0), widened to the query's dtype (fp32 with ``DOT_F32``; exact from fp8)."""
    blk = tl.load(table + offs_n // PAGE, mask=n_mask, other=0)
    return _kv_tile_at(KV, blk, offs_n, n_mask, offs_d, d_mask, kvh, q, stride_kv, stride_blk, stride_slot,
                       stride_ch, PAGE)


@triton.jit
def _kv_tile_at(KV, blk, offs_n, n_mask, offs_d, d_mask, kvh, q, stride_kv, stride_blk, stride_slot, stride_ch,
                PAGE: tl.constexpr):
    """:func:`_kv_tile` with the positions' cache blocks ``blk`` already read from the block table."""
    rows = _kv_rows(blk, offs_n, kvh, stride_blk, stride_slot, stride_ch, PAGE)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(KV + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(KV + stride_kv + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    return k.to(q.dtype), v.to(q.dtype)


@triton.jit
def _kv_rows(blk, offs_n, kvh, stride_blk, stride_slot, stride_ch, PAGE: tl.constexpr):
    """Element offsets of KV head ``kvh``'s K rows at positions ``offs_n`` in cache blocks ``blk`` (V: + stride_kv)."""
    return blk.to(tl.int64) * stride_blk + (offs_n % PAGE) * stride_slot + kvh * stride_ch


def _f8x4_to_f16_asm(e5m2: bool) -> str:
    """PTX widening one 32-bit word of 4 fp8 codes (little-endian: code i in byte i) to 4 fp16 values, exactly
    (e4m3 and e5m2 fit fp16): two ``cvt.rn.f16x2`` of the word's halves, each a pair (code 2i in the low half)."""
    ty = "e5m2x2" if e5m2 else "e4m3x2"
    return ("{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; "
            f"cvt.rn.f16x2.{ty} a, lo; cvt.rn.f16x2.{ty} b, hi; mov.b32 {{$0, $1}}, a; mov.b32 {{$2, $3}}, b; }}")


_F8_ASM_E4M3 = tl.constexpr(_f8x4_to_f16_asm(False))
_F8_ASM_E5M2 = tl.constexpr(_f8x4_to_f16_asm(True))


@triton.jit
def _v_tile_f16(KVW, rows, n_mask, stride_kv, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, F8: tl.constexpr, V_ASM: tl.constexpr):
    """V ``[BLOCK_N, BLOCK_D]`` of an fp8 cache (codes of type ``F8``) at element offsets ``rows``, widened to fp16
    in registers as it is loaded from ``KVW``, the cache viewed as int32 words of 4 codes (``V_ASM`` 1: inline PTX,
    2: the same values and layout from Triton ops, for the interpreter, which runs no PTX). Widened this way the
    tile reaches the PV dot as 16-bit data, which Triton passes through shared memory and reads with transposing
    ldmatrix. An fp8 tile widened by ``.to()`` was instead moved into the dot operand's layout as bytes (Triton
    hoists the layout change above the conversion, and 8-bit data has no transposing ldmatrix): 64 single-byte
    shared loads and ~200 more instructions per 64-key tile (SASS, sm_90, Triton 3.6: 740 -> 535 per tile)."""
    offs_w = tl.arange(0, BLOCK_D // 4)
    w = tl.load(KVW + (stride_kv >> 2) + (rows >> 2)[:, None] + offs_w[None, :],
                mask=n_mask[:, None] & (offs_w < HEAD_DIM // 4)[None, :], other=0)
    if V_ASM == 1:
        if F8 == tl.float8e5:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(_F8_ASM_E5M2, "=h,=h,=h,=h,r", [w], dtype=(tl.float16,) * 4,
                                                       is_pure=True, pack=1)
        else:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(_F8_ASM_E4M3, "=h,=h,=h,=h,r", [w], dtype=(tl.float16,) * 4,
                                                       is_pure=True, pack=1)
    else:
        c0 = (w & 0xFF).to(tl.uint8).to(F8, bitcast=True).to(tl.float16)
        c1 = ((w >> 8) & 0xFF).to(tl.uint8).to(F8, bitcast=True).to(tl.float16)
        c2 = ((w >> 16) & 0xFF).to(tl.uint8).to(F8, bitcast=True).to(tl.float16)
        c3 = ((w >> 24) & 0xFF).to(tl.uint8).to(F8, bitcast=True).to(tl.float16)
    # tl.join appends its axis last: [word, p, q] holds code 2 p + q for join(join(c0, c2), join(c1, c3))
    return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (BLOCK_N, BLOCK_D))


@triton.jit
def _fp8_cache_query(q, scale_log2, KScale, DOT_F32: tl.constexpr):
    """(q, qk_scale) for attention over an fp8 cache. A float32 model (or the interpreter's ``DOT_F32``) keeps exact
    fp32 dots, k_scale folded into the score scale. A 16-bit model's dots run in fp16: K / V widen to fp16 exactly
    with one conversion per pair (e4m3 and e5m2 fit fp16), where widening to bf16 went through fp16 one element at
    a time (SASS on sm_90: 2 conversions and a byte permute per element; the decode kernel issue-bound at 891
    instructions per 64-key tile, 706 this way; prefill 647 -> 498 per tile, bf16 KV 544); q takes both
    scales in fp32 and is rounded once to fp16 (3 more mantissa bits than bf16; clamped so an outlier cannot
    become inf), p is rounded to fp16 for the PV dot."""
    if DOT_F32 or q.dtype == tl.float32:
        qk_scale = scale_log2 * tl.load(KScale)
        qs = q
    else:
        qs = tl.clamp(q.to(tl.float32) * (scale_log2 * tl.load(KScale)), -65504.0, 65504.0).to(tl.float16)
        qk_scale = 1.0
    return qs, qk_scale


@triton.jit
def _softmax_step(q, k, v, keep, qk_scale, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One K/V tile of the online softmax in base 2: the scores where ``keep`` (else -inf), then the running max
    ``m_i``, sum ``l_i`` and output ``acc`` rescaled and updated."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


# --------------------------------------------------------------------------------------------- prefill
@triton.jit
def _prefill_kernel(Q, KV, Out, BlockTables, QueryStart, SeqLens, Tiles, KScale, VScale, scale_log2,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_kv, stride_blk, stride_slot, stride_ch,
                    stride_bt, tiles_per_seq, GROUP: tl.constexpr, PACK: tl.constexpr, HEAD_DIM: tl.constexpr,
                    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    DENSE: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr):
    """One program per (tile, pack of ``PACK`` query heads of one KV head): its ``BLOCK_M`` rows are
    ``BLOCK_M // PACK`` query tokens x ``PACK`` heads (row ``r``: token ``r // PACK``, head ``r % PACK``), so the
    K/V tiles are loaded once for the pack. ``Tiles`` lists the (sequence, m-tile) pairs of the step's prefill
    rows; ``DENSE`` (benchmark baseline) instead runs ``tiles_per_seq`` tiles of every sequence and skips the
    ones past its query or of a decode row."""
    TOKENS: tl.constexpr = BLOCK_M // PACK
    pid = tl.program_id(0)
    pid_h = tl.program_id(1)
    if DENSE:
        b = pid // tiles_per_seq
        tile = pid % tiles_per_seq
    else:
        b = tl.load(Tiles + 2 * pid)
        tile = tl.load(Tiles + 2 * pid + 1)
    q_start = tl.load(QueryStart + b)
    q_len = tl.load(QueryStart + b + 1) - q_start
    if DENSE:  # constexpr: resolved at compile time, so the early return below is a plain scalar branch
        if (tile * TOKENS >= q_len) | (q_len <= 1):
            return
    seq_len = tl.load(SeqLens + b)
    ctx_len = seq_len - q_len
    kvh = (pid_h * PACK) // GROUP

    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = tile * TOKENS + offs_r // PACK
    head = pid_h * PACK + offs_r % PACK
    d_mask = offs_d < HEAD_DIM
    m_mask = (offs_r < TOKENS * PACK) & (tok < q_len)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = ctx_len + tok
    qk_scale = scale_log2
    if QUANT:  # dequantization folded into the scores (k_scale) and the output (v_scale)
        q, qk_scale = _fp8_cache_query(q, scale_log2, KScale, DOT_F32)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite, so fully masked rows never give inf - inf
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(seq_len, ctx_len + (tile + 1) * TOKENS)  # causal: later keys are never seen
    table = BlockTables + b.to(tl.int64) * stride_bt
    for start in range(0, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        k, v = _kv_tile(KV, table, offs_n, n_mask, offs_d, d_mask, kvh, q, stride_kv, stride_blk, stride_slot,
                        stride_ch, PAGE)
        keep = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        m_i, l_i, acc = _softmax_step(q, k, v, keep, qk_scale, m_i, l_i, acc, PRECISION)
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if QUANT:
        acc = acc * tl.load(VScale)
    tl.store(Out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


# --------------------------------------------------------------------------------------------- decode
@triton.jit
def _decode_kernel(Q, KV, KVW, Out, PartOut, PartLse, BlockTables, QueryStart, SeqLens, KScale, VScale, scale_log2,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_kv, stride_blk, stride_slot, stride_ch,
                   stride_bt, stride_pb, stride_ph, stride_ps, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
                   V_ASM: tl.constexpr, PDL: tl.constexpr):
    """One program per (sequence, KV head, split): all ``GROUP`` query heads of a KV head share its loads."""
    pdl_start(PDL)  # (lqe.kernels.triton_pdl: before every load and exit)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(QueryStart + b)
    if tl.load(QueryStart + b + 1) - q_start != 1:
        return
    seq_len = tl.load(SeqLens + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h
    q_row = q_start.to(tl.int64)
    q = tl.load(Q + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    qk_scale = scale_log2
    if QUANT:  # dequantization folded into the scores (k_scale) and the output (v_scale)
        q, qk_scale = _fp8_cache_query(q, scale_log2, KScale, DOT_F32)

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = BlockTables + b.to(tl.int64) * stride_bt
    # A tile's block-table entries are read one tile ahead: read in the tile's own iteration they put a second
    # dependent global round trip (table, then K / V at the addresses it gives) on every iteration's critical path
    # (a SASS review, sm_90: LDG of the table, IMAD.WIDE, then the K / V cp.async), in a kernel bound by latency
    # (~10 bytes per instruction for a 16-bit cache). It costs ~25-50 instructions per 64-key tile (16-bit cache
    # 418 -> 468, 118 registers; fp8 with V_ASM 535 -> 561, 126 registers: 4 programs per SM still fit). The fp8
    # cache of a float32 model (fp32 dots, ``.to()`` widening, issue-bound) keeps the in-iteration read.
    offs_n = lo + tl.arange(0, BLOCK_N)
    blk = tl.load(table + offs_n // PAGE, mask=offs_n < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        if QUANT and V_ASM == 0:
            k, v = _kv_tile(KV, table, offs_n, n_mask, offs_d, d_mask, kvh, q, stride_kv, stride_blk, stride_slot,
                            stride_ch, PAGE)
        else:
            cur = blk
            blk = tl.load(table + (offs_n + BLOCK_N) // PAGE, mask=offs_n + BLOCK_N < hi, other=0)
            if V_ASM != 0:
                rows = _kv_rows(cur, offs_n, kvh, stride_blk, stride_slot, stride_ch, PAGE)
                k = tl.load(KV + rows[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :],
                            other=0.0).to(q.dtype)
                v = _v_tile_f16(KVW, rows, n_mask, stride_kv, HEAD_DIM, BLOCK_N, BLOCK_D, KV.dtype.element_ty,
                                V_ASM)
            else:
                k, v = _kv_tile_at(KV, cur, offs_n, n_mask, offs_d, d_mask, kvh, q, stride_kv, stride_blk,
                                   stride_slot, stride_ch, PAGE)
        m_i, l_i, acc = _softmax_step(q, k, v, n_mask[None, :], qk_scale, m_i, l_i, acc, PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if QUANT:
        out = out * tl.load(VScale)
    if NUM_SPLITS == 1:
        tl.store(Out + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        part = b.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(PartOut + part[:, None] + offs_d[None, :], out, mask=h_mask[:, None] & d_mask[None, :])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(PartLse + part // BLOCK_D, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(Out, PartOut, PartLse, QueryStart, stride_ot, stride_oh, stride_pb, stride_ph,
                          stride_ps, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    q_start = tl.load(QueryStart + b)
    if tl.load(QueryStart + b + 1) - q_start != 1:
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    base = b.to(tl.int64) * stride_pb + h * stride_ph + offs_s * stride_ps
    lse = tl.load(PartLse + base // BLOCK_D, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top)))
    part = tl.load(PartOut + base[:, None] + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + q_start.to(tl.int64) * stride_ot + h * stride_oh + offs_d,
             out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)


# --------------------------------------------------------------------------------------------- host side
def _decode_launch_opts(quant: bool, dtype: torch.dtype) -> dict:
    """The fp8-cache decode kernel of a 16-bit model compiled to <= 128 registers: at 140-147 only 3 programs of 4
    warps fit an SM, and a 64-sequence x 8-KV-head step (512 programs) ran 1.29 waves on 132 SMs; at 128 (no spills,
    sm_90, Triton 3.6) 4 fit, one wave. A float32 model's kernel (fp32 dots) would spill 2.6x more under the limit:
    it keeps none. (The interpreter takes no register limit.)"""
    return {"maxnreg": 128} if quant and dtype != torch.float32 and not _INTERPRET else {}


def _v_asm(kv_cache: torch.Tensor, dtype: torch.dtype, quant: bool, head_dim: int) -> int:
    """The decode kernel's ``V_ASM``: how a 16-bit model's fp8 V is widened (:func:`_v_tile_f16`; rows of whole
    16-byte runs, ``head_dim % 16 == 0``): 1 by inline PTX, 2 by the same layout from Triton ops (the interpreter),
    0 by ``.to()`` (a 16-bit cache, a float32 model's fp32 dots)."""
    if (not quant or dtype == torch.float32 or head_dim % 16 or kv_cache.stride(-1) != 1
            or kv_cache.data_ptr() % 16 or any(s % 16 for s in kv_cache.stride()[:-1])):
        return 0  # (the int32 view needs strides in whole words; the kernel's 16-byte vectors, whole 16-byte runs)
    return 2 if _INTERPRET else 1


def _blocks(head_dim: int, fp32: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for prefill: no register spills on sm_90 (ptxas -v, every PACK, 16-bit and
    fp8 KV; tests/test_prefill_tiles.py). At head dim 128 four warps spill (~500 bytes), eight fit in ~190
    registers; head dim 256 needs the smaller tile. A head dim padded to 128 (80, 96) takes 32-key tiles: at 64 keys
    a 3-head GQA pack spills 44 bytes with Triton 3.6 (the GPU machine's; 3.9 fits it). A float32 model's tiles
    take twice the registers: 32 keys at head dim 64 (64 spill 2 KB), 16 up to 128 (32 spill 1 KB); the same
    64-token tiles, so GQA packing is unchanged (tests/test_hopper_launches.py, Triton 3.6 and 3.9)."""
    bd = triton.next_power_of_2(head_dim)
    if fp32:
        return (64, 32, 8) if bd <= 64 else (64, 16, 8) if bd <= 128 else (32, 16, 8)
    if bd <= 64:
        return 64, 64, 4
    if bd <= 128:
        return (64, 64, 8) if bd == head_dim else (64, 32, 8)
    return 32, 32, 8


def _pack(group: int, block_m: int) -> int:
    """Query heads per prefill program: the whole GQA group while a tile keeps >= 4 tokens (K/V loaded once per
    KV head), else one head per program."""
    return group if 1 < group and 4 * group <= block_m else 1


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    out: torch.Tensor | None = None, num_splits: int | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    prefill_grid: str = "tiles", pack_gqa: bool | None = None) -> torch.Tensor:
    """Causal attention of ``query [T, H, D]`` over the paged cache (K/V of this step already stored); an fp8
    cache is read through ``k_scale`` / ``v_scale``.

    ``prefill_grid`` / ``pack_gqa`` exist for benchmarks: ``"tiles"`` (default) launches prefill over the step's
    tile map, ``"dense"`` over every (m-tile, sequence) of the step as before; ``pack_gqa`` (default: by head
    dim and group) makes one program handle every query head of a KV head."""
    _check_cache(kv_cache)
    t, num_heads, head_dim = query.shape
    num_kv_heads, page = kv_cache.shape[3], kv_cache.shape[2]
    if query.stride(2) != 1:
        raise ValueError("query needs a contiguous last (head_dim) dimension")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if prefill_grid not in ("tiles", "dense"):
        raise ValueError(f"prefill_grid must be 'tiles' or 'dense'; got {prefill_grid!r}")
    if out is None:
        out = torch.empty_like(query)
    b = meta.num_seqs
    if t == 0 or b == 0:
        return out
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    dot_f32 = _INTERPRET and query.dtype == torch.bfloat16  # the interpreter's bf16 tl.dot is wrong
    scale_log2 = float(scale) * _LOG2E
    precision = "ieee" if query.dtype == torch.float32 else None  # fp32 tests want exact fp32, not tf32
    kv_strides = (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3))
    quant, _, ks, vs = _scales(kv_cache, k_scale, v_scale)
    decode_only = meta.max_query_len == 1
    has_decode = decode_only or step_plan(meta).has_decode

    if not decode_only:
        block_m, block_n, warps = _blocks(head_dim, query.dtype == torch.float32)
        pack = _pack(group, block_m) if pack_gqa is None else (group if pack_gqa else 1)
        if block_m // pack < 1:
            raise ValueError(f"pack_gqa=True needs a GQA group <= {block_m} (BLOCK_M); got {group}")
        tokens = block_m // pack
        if prefill_grid == "tiles":
            tiles = step_plan(meta).tile_map(tokens, query.device)
            n_tiles, per_seq = tiles.shape[0], 0
        else:
            tiles, per_seq = meta.query_start_loc, triton.cdiv(meta.max_query_len, tokens)  # tiles: unread
            n_tiles = per_seq * b
        if n_tiles:
            _prefill_kernel[(n_tiles, num_heads // pack)](
                query, kv_cache, out, meta.block_tables, meta.query_start_loc, meta.seq_lens, tiles, ks, vs,
                scale_log2, query.stride(0), query.stride(1), out.stride(0), out.stride(1), *kv_strides,
                meta.block_tables.stride(0), per_seq, GROUP=group, PACK=pack, HEAD_DIM=head_dim, PAGE=page,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DENSE=prefill_grid == "dense",
                DOT_F32=dot_f32, PRECISION=precision, QUANT=quant, num_warps=warps, num_stages=2,
            )
    if not has_decode:
        return out

    splits = num_splits or meta.num_splits or choose_num_splits(b, num_kv_heads, meta.max_seq_len, query.device)
    block_h = max(16, triton.next_power_of_2(group))
    block_n = 64 if block_d <= 128 else 32
    if query.dtype == torch.float32 and block_d > 64:  # a float32 model: 64 keys x 128 dims spill ~800 bytes,
        block_n = 16  # 32 keys ~500
    if splits > 1:
        # PartLse shares PartOut's index (without the D axis): lse index = PartOut offset // BLOCK_D
        part_out = torch.empty(b, num_heads, splits, block_d, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(b, num_heads, splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused
    p_strides = (num_heads * splits * block_d, splits * block_d, block_d)
    v_asm = _v_asm(kv_cache, query.dtype, quant, head_dim)
    _decode_kernel[(b, num_kv_heads, splits)](
        query, kv_cache, kv_cache.view(torch.int32) if v_asm else kv_cache, out, part_out, part_lse,
        meta.block_tables, meta.query_start_loc, meta.seq_lens, ks, vs,
        scale_log2, query.stride(0), query.stride(1), out.stride(0), out.stride(1), *kv_strides,
        meta.block_tables.stride(0), *p_strides, GROUP=group, HEAD_DIM=head_dim, PAGE=page,
        NUM_SPLITS=splits, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, DOT_F32=dot_f32, PRECISION=precision,
        QUANT=quant, V_ASM=v_asm, num_warps=4, num_stages=2, **_decode_launch_opts(quant, query.dtype),
        **pdl_args(query.device),
    )
    if splits > 1:
        _decode_reduce_kernel[(b, num_heads)](
            out, part_out, part_lse, meta.query_start_loc, out.stride(0), out.stride(1), *p_strides,
            HEAD_DIM=head_dim, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
            **pdl_args(query.device),
        )
    return out
