"""GEMV-class W8A8 kernels for M <= 16 tokens: int8 x int8 and fp8 e4m3 x fp8 e4m3, on the checkpoint's own
``w [N, K]`` (K contiguous), with the per-token x per-channel scale epilogue fused.

``out[m, n] = a_scale[m] * w_scale[n] * (sum_k xq[m, k] * w[n, k] - azp[m] * colsum[n]) + bias[n]``

At M <= 16 a layer is a weight stream: every weight byte is read once and used M times, so the time floor is the
weight bytes at copy bandwidth (half of bf16's). The kernel is laid out for that stream:

* the grid is ``(ceil(N / BLOCK_N), SPLIT_K)``: many small CTAs over N, and K cut in ``SPLIT_K`` ranges when N
  alone gives too few programs to keep every SM's memory pipe busy (:func:`auto_split_k`);
* each program loads ``[BLOCK_N, BLOCK_K]`` weight tiles along contiguous K (16-byte vector loads per thread) and
  the ``[BLOCK_M, BLOCK_K]`` activations beside them (tiny, L2/L1 resident; the registers hold them for the tile);
* ``USE_DOT=False`` (M <= 4 class): a CUDA-core multiply-reduce along K in fp32 FMAs (for int8 each BLOCK_K <= 1024
  block sum is exact in fp32 and is added to an int32 accumulator; fp8 accumulates in fp32); int8 at M = 1 instead
  runs ``dp4a`` on int32 words of w and x (``DP4A``: four products per instruction, exact in int32, the K loop
  pipelined); ``USE_DOT=True`` (M up to 16): ``tl.dot`` with the tokens padded to 16 rows (int8 / fp8 tensor
  cores, mma.sync), the weight the K-major B operand;
* split-K partials go to a workspace ``[SPLIT_K, BLOCK_M, N]`` (int32, fp32 stored bit-cast) and the last program
  of an N tile (an arrival counter) sums them **in split order** and applies the epilogue: one launch, no
  order-dependent float atomics, so the result is deterministic run to run; the counter is reset by that program.

Configurations come from :data:`CONFIGS` (int8) / :data:`FP8_CONFIGS` (fp8) per M bucket on the host (no autotune, no
sync: CUDA-graph capturable); ``benchmarks/kernels.py --w8a8-sweep`` / ``--fp8-sweep`` time :func:`sweep_configs` and
print the tables they imply, paste-able. The tables below are guesses until measured.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from lqe.kernels.device_info import sm_count
from lqe.kernels.triton_gemm_common import SplitKWorkspace, gemm_io, nonempty_splits, per_token_vec
from lqe.kernels.triton_pdl import pdl_args, pdl_start, prefetch_l2

try:
    import triton
    import triton.language as tl

    from lqe.kernels.triton_gemm_common import split_k_range
    from lqe.kernels.triton_w8a8 import _epilogue
except ImportError:  # pragma: no cover - triton is optional on CPU
    triton = None
    tl = None

MAX_M = 16
# Triton's interpreter (the CPU tests) runs no inline PTX: dp4a is emulated there (_dp4a)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)


def available() -> str | None:
    """Why the GEMV kernels cannot run, or ``None``."""
    return "triton is not installed" if triton is None else None


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int
    block_k: int
    use_dot: bool = False
    split_k: int = 0  # 0 = from the SM count (auto_split_k)
    num_warps: int = 4
    num_stages: int = 3
    dp4a: bool = True  # int8 at M = 1 on the CUDA cores: dp4a on int32 words (where K and the strides allow)
    # use_dot only: out^T = W x^T, the weight tile wgmma's M operand (BLOCK_N >= 64) and the 16 token rows its N, so
    # fp8 runs native fp8 wgmma (no fp16 upcast: one F2FP per weight byte and per activation byte in every warp
    # before, 240 -> 70 SASS instructions per 8 KB at BLOCK_K = 128; int8 IGMMA) on sm_90 (a SASS review, Triton
    # 3.6; NOT MEASURED).
    swap_ab: bool = False
    precise_acc: bool = True  # fp8 swap_ab: promote to fp32 every BLOCK_K (as triton_fp8.Fp8Config.precise_acc)

    def __str__(self) -> str:
        sk = "auto" if self.split_k == 0 else self.split_k
        swap = "dot-swap" if self.precise_acc else "dot-swap-fast"
        path = (swap if self.swap_ab else "dot") if self.use_dot else "fma" if not self.dp4a else "fma-dp4a"
        return f"{path}-n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}sk{sk}"


# (max_m, config): first row covering M wins. Measured on the H200 at 0ebe3f7 (graph-timed, Llama-3-8B shapes,
# benchmarks/results/kernels-graph-nvidia-h200.json): M=1 on the CUDA cores 1.27x cuBLAS bf16, M=16 on the tensor cores
# 1.46x; M=4 ran a CUDA-core config then (a [4, 32, 256] broadcast-reduce: 648 warp shuffles per K block, 0.24x,
# 47 us on 4096x4096 against 10 us at M=1 and M=16), so M = 2..16 share the tensor-core config (its cost does not
# depend on M; M = 2..8 not measured yet). The CUDA-core path now reduces one token at a time for BLOCK_M > 1.
# Re-measured at 257cdec: M=1 1.49x, M=4 1.16x, M=16 1.30x (4096x6144, 4096^2). A SASS review then found the int8
# M=1 path issue-bound (~700 instructions per warp per 16 KB K block, its compute adding to its loads', no K
# pipeline): int8 at M=1 now runs dp4a on int32 words with a pipelined K loop (GemvConfig.dp4a, num_stages), ~60
# instructions per block; not measured yet.
# `python benchmarks/kernels.py --w8a8-sweep --m 1 2 4 8 16` sweeps the alternatives (dp4a on / off / unpipelined).
CONFIGS: list[tuple[int, GemvConfig]] = [
    (1, GemvConfig(32, 512, use_dot=False, num_warps=4)),
    (16, GemvConfig(64, 256, use_dot=True, num_warps=4)),
]

# the fp8 GEMV's own table (fp8 x fp8 with fp32 accumulation: another balance than int8), the same guesses until
# `python benchmarks/kernels.py --fp8-sweep --m 1 2 4 8 16` measures it
FP8_CONFIGS: list[tuple[int, GemvConfig]] = list(CONFIGS)

WS_ROWS = 256  # split_k * BLOCK_M rows of partial sums the workspace holds per output column
# Under PDL (the default on sm_90+) each program pulls the first PDL_PREFETCH_LINES 128-byte lines of each of its
# BLOCK_N weight rows into L2 before it waits for the kernel before it: 32 rows x 2 lines = 8 KB a program (64 rows:
# 16 KB), ~4 MB over a 4096 x 4096 layer's 512 programs at M = 1 (a quarter of it; the rest streams after the wait).
# Measured only together with the rest of PDL (H200, af342f8: the W8A8 model's batch-1 decode step 0.92 -> 0.68 ms of
# GPU time, e2e-nvidia-h200.json); not without the prefetch.
PDL_PREFETCH_LINES = 2


def block_m(m: int, use_dot: bool) -> int:
    return 16 if use_dot else max(1, triton.next_power_of_2(m) if triton else 1 << (m - 1).bit_length())


def sweep_configs(m: int) -> list[GemvConfig]:
    """Candidate configurations for ``m <= 16`` tokens (benchmarks/kernels.py --w8a8-sweep)."""
    out = []
    for use_dot in ((False, True) if m <= 4 else (True,)):
        for bn in (16, 32, 64, 128):
            for bk in (128, 256, 512, 1024):
                if not use_dot and bn * bk * block_m(m, False) > 32 * 1024:  # register tile of the CUDA-core path
                    continue
                if use_dot and (bn < 32 or bk > 512):
                    continue
                for nw in (4, 8):  # split_k from the SM count (1 where N alone fills the GPU)
                    out.append(GemvConfig(bn, bk, use_dot, 0, nw, 3))
                    if not use_dot and m == 1:  # the dp4a path without its K pipeline, and the fp32-FMA path
                        out.append(GemvConfig(bn, bk, use_dot, 0, nw, 1))
                        out.append(GemvConfig(bn, bk, use_dot, 0, nw, 3, dp4a=False))
                if use_dot and bn >= 64 and bk == 128:
                    # deeper K pipelines, fixed splits (the auto split gave o_proj 2 K blocks per program), and the
                    # swapped GEMM (a SASS / occupancy review's candidates, sm_90: none measured yet)
                    for st in (4, 5):
                        out.append(GemvConfig(bn, bk, True, 0, 4, st))
                    for sk in (1, 2, 4):
                        out.append(GemvConfig(bn, bk, True, sk, 4, 3))
                    for st in (3, 5):
                        out.append(GemvConfig(bn, bk, True, 0, 4, st, swap_ab=True))
                        out.append(GemvConfig(bn, bk, True, 0, 4, st, swap_ab=True, precise_acc=False))
    return out


def auto_split_k(m: int, n: int, k: int, cfg: GemvConfig, sms: int) -> int:
    """K splits so that at most about four programs run per SM (memory-level parallelism), each streaming >= 2 K
    blocks, within the workspace (``split * BLOCK_M <= WS_ROWS``). Rounded down: 5-6 programs fit an SM, and rounding
    up put 896 programs (1.36 waves) on 132 SMs at M = 1, N = 14336 (a SASS / occupancy review; not measured)."""
    tiles = math.ceil(n / cfg.block_n)
    want = max(1, (4 * sms) // max(tiles, 1))
    k_blocks = math.ceil(k / cfg.block_k)
    return max(1, min(want, k_blocks // 2, WS_ROWS // block_m(m, cfg.use_dot), 32))


def pick_config(m: int, n: int, k: int, device: torch.device | None = None,
                table: list[tuple[int, GemvConfig]] | None = None) -> GemvConfig:
    """The configuration for ``m`` tokens with ``split_k`` resolved. Host-only, no sync."""
    if m > MAX_M:
        raise ValueError(f"triton-gemv serves M <= {MAX_M} tokens (got M={m}); larger M goes to the GEMM kernels")
    cfg = next((c for max_m, c in (table or CONFIGS) if m <= max_m), (table or CONFIGS)[-1][1])
    return resolve(cfg, m, n, k, device)


def resolve(cfg: GemvConfig, m: int, n: int, k: int, device: torch.device | None) -> GemvConfig:
    if cfg.split_k != 0:
        return cfg
    return dataclasses.replace(cfg, split_k=auto_split_k(m, n, k, cfg, sm_count(device, cpu_default=8)))


# ------------------------------------------------------------------------------------------------ workspace
_WS = SplitKWorkspace("triton-gemv", "lqe.kernels.triton_gemv_w8a8", torch.int32)


def reserve_workspace(device: torch.device | str, n: int) -> None:
    """Make the split-K workspace of ``device`` hold ``WS_ROWS x n`` partial sums. Call before a CUDA-graph
    capture (growing it allocates). The counters start and stay zero between calls."""
    _WS.reserve(device, WS_ROWS * n)


# ------------------------------------------------------------------------------------------------ kernel
if triton is not None:

    @triton.jit
    def _dp4a(a, b, c, ASM: tl.constexpr):
        """``c + sum_i a.byte_i * b.byte_i`` (signed bytes of int32 words): the ``dp4a`` instruction, or under the
        interpreter (which runs no PTX) the same sum from shifted bytes."""
        if ASM:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                             is_pure=True, pack=1)
        else:
            s = c
            for i in tl.static_range(4):
                s += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
            return s

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, a_scale_ptr, w_scale_ptr, azp_ptr, colsum_ptr, bias_ptr, ws_ptr,
                     cnt_ptr, M, N, K, stride_xm, stride_wn, stride_om, a_scale_stride, azp_stride,
                     HAS_AZP: tl.constexpr, HAS_BIAS: tl.constexpr, IS_FP8: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr,
                     EVEN_K: tl.constexpr, DP4A: tl.constexpr, DP4A_ASM: tl.constexpr, K_STAGES: tl.constexpr,
                     SWAP_AB: tl.constexpr, PROMOTE: tl.constexpr, PDL: tl.constexpr, PF_LINES: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        # padding tokens / columns re-read a valid row (stores are masked): no masks on the weight stream
        rxm = tl.minimum(rm, M - 1)
        rwn = tl.max_contiguous(tl.multiple_of(rn % N, BLOCK_N), BLOCK_N)
        kb0, kb1 = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
        if PDL:  # the first PF_LINES 128-byte lines of each of this program's weight rows into L2, before the wait
            pf_k = tl.minimum(kb0 * BLOCK_K + tl.arange(0, PF_LINES) * 128, K - 1)
            prefetch_l2(w_ptr + rwn[:, None] * stride_wn + pf_k[None, :])
        pdl_start(PDL)  # (lqe.kernels.triton_pdl: nothing above reads memory an earlier kernel writes)
        if IS_FP8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # (SWAP_AB)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
        x_ptrs = x_ptr + rxm[:, None] * stride_xm + (kb0 * BLOCK_K + rk)[None, :]
        if DP4A:
            # int8 at M = 1 (BLOCK_M == 1) on the CUDA cores, on int32 words of w and x (K, the row strides and
            # both bases multiples of 4: gemv_w8a8 checks): one dp4a per 4 products into [BLOCK_N, BLOCK_K / 4]
            # int32 accumulators (exact: |sum| <= K * 2^14), reduced once after the K loop. The fp32-FMA path below
            # spent ~700 SASS instructions per warp per 16 KB K block (byte permutes, float adds, shuffles, a
            # shared-memory exchange of x): issue-bound at about the copy bandwidth, its compute adding to the
            # loads'; this one ~60 (sm_90, Triton 3.6). tl.range pipelines the K loop (K_STAGES cp.async stages).
            KW: tl.constexpr = BLOCK_K // 4
            rkw = tl.arange(0, KW)
            x32 = x_ptr.to(tl.pointer_type(tl.int32))
            w32 = w_ptr.to(tl.pointer_type(tl.int32))
            sw = stride_wn // 4
            accw = tl.zeros((BLOCK_N, KW), dtype=tl.int32)
            for kb in tl.range(kb0, kb1, num_stages=K_STAGES):
                kw = kb * KW + rkw
                if EVEN_K:
                    xv = tl.load(x32 + kw)
                    wv = tl.load(w32 + rwn[:, None] * sw + kw[None, :])
                else:
                    kmw = kw < K // 4
                    xv = tl.load(x32 + kw, mask=kmw, other=0)
                    wv = tl.load(w32 + rwn[:, None] * sw + kw[None, :], mask=kmw[None, :], other=0)
                accw = _dp4a(wv, tl.broadcast_to(xv[None, :], (BLOCK_N, KW)), accw, DP4A_ASM)
            acc += tl.sum(accw, axis=1)[None, :]
        else:
            for kb in range(kb0, kb1):
                kmask = (kb * BLOCK_K + rk) < K
                if EVEN_K:
                    x = tl.load(x_ptrs)
                else:
                    x = tl.load(x_ptrs, mask=kmask[None, :], other=0.0)
                if USE_DOT and not SWAP_AB:  # weight tile as the K-major B operand [BLOCK_K, BLOCK_N]
                    w_ptrs = w_ptr + rwn[None, :] * stride_wn + (kb * BLOCK_K + rk)[:, None]
                    if EVEN_K:
                        w = tl.load(w_ptrs)
                    else:
                        w = tl.load(w_ptrs, mask=kmask[:, None], other=0.0)
                    if IS_FP8:
                        acc = tl.dot(x, w, acc, out_dtype=tl.float32)
                    else:
                        acc = tl.dot(x, w, acc, out_dtype=tl.int32)
                else:  # the weight tile [BLOCK_N, BLOCK_K] along contiguous K
                    w_ptrs = w_ptr + rwn[:, None] * stride_wn + (kb * BLOCK_K + rk)[None, :]
                    if EVEN_K:
                        w = tl.load(w_ptrs)
                    else:
                        w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)
                if USE_DOT and SWAP_AB:  # as wgmma's M operand, x^T its B
                    if IS_FP8:
                        acc_t = tl.dot(w, tl.trans(x), acc_t, out_dtype=tl.float32, max_num_imprecise_acc=PROMOTE)
                    else:
                        acc_t = tl.dot(w, tl.trans(x), acc_t, out_dtype=tl.int32)
                elif not USE_DOT:  # multiply-reduce on the CUDA cores
                    # fp32 FMAs (twice the int32 rate): int8 products are integers <= 2^14 and a BLOCK_K <= 1024 sum
                    # stays <= 2^24, so the block sum is exact in fp32 whatever the order; int32 across blocks
                    if IS_FP8:
                        wf = w.to(tl.float32)
                    else:
                        # int8 -> fp32 without the conversion unit (cvt.rn.f32.s16: 16 results per clock per SM on
                        # Hopper, the GEMV's bottleneck at M = 1): 0x4B400000 + q is the float 12582912 + q exactly
                        # for |q| <= 2^22, so one integer add and one exact float subtract give float(q)
                        wf = (w.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
                    if BLOCK_M == 1:
                        blk = tl.sum(wf * x.to(tl.float32), axis=1)[None, :]
                        if IS_FP8:
                            acc += blk
                        else:
                            acc += blk.to(tl.int32)
                    else:
                        # one 2-d [BLOCK_N, BLOCK_K] multiply-reduce per token, in the weight tile's own layout
                        for mi in tl.static_range(BLOCK_M):
                            xr = tl.load(x_ptr + tl.minimum(mi, M - 1) * stride_xm + kb * BLOCK_K + rk, mask=kmask,
                                         other=0.0)
                            row = tl.sum(wf * xr.to(tl.float32)[None, :], axis=1)
                            if IS_FP8:
                                acc += tl.where(rm[:, None] == mi, row[None, :], 0.0)
                            else:
                                acc += tl.where(rm[:, None] == mi, row.to(tl.int32)[None, :], 0)
                x_ptrs += BLOCK_K
            if USE_DOT and SWAP_AB:
                acc = tl.trans(acc_t)

        if SPLIT_K == 1:
            _epilogue(acc, rm, rn, M, N, out_ptr, stride_om, a_scale_ptr, a_scale_stride, w_scale_ptr,
                      azp_ptr, azp_stride, colsum_ptr, bias_ptr, HAS_AZP, HAS_BIAS)
        else:
            mask = (rm < M)[:, None] & (rn < N)[None, :]  # (padding tokens: never stored, read back as 0)
            part = ws_ptr + (pid_k * BLOCK_M + rm)[:, None] * N + rn[None, :]
            if IS_FP8:
                tl.store(part, acc.to(tl.int32, bitcast=True), mask=mask)
            else:
                tl.store(part, acc, mask=mask)
            tl.debug_barrier()  # every thread's partials are issued before the (release) arrival below
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:  # the last program of this N tile: sum the partials in split order
                if IS_FP8:
                    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                else:
                    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
                for s in tl.static_range(SPLIT_K):  # unrolled: every split's load in flight, summed in order
                    p = tl.load(ws_ptr + (s * BLOCK_M + rm)[:, None] * N + rn[None, :], mask=mask, other=0,
                                cache_modifier=".cg")  # L2: other SMs wrote them
                    if IS_FP8:
                        total += p.to(tl.float32, bitcast=True)
                    else:
                        total += p
                tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed")  # (stream order publishes it to the next launch)
                _epilogue(total, rm, rn, M, N, out_ptr, stride_om, a_scale_ptr, a_scale_stride, w_scale_ptr,
                          azp_ptr, azp_stride, colsum_ptr, bias_ptr, HAS_AZP, HAS_BIAS)


# ------------------------------------------------------------------------------------------------ host side
def gemv_w8a8(xq: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
              azp: torch.Tensor | None = None, colsum: torch.Tensor | None = None, bias: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
              config: GemvConfig | None = None) -> torch.Tensor:
    """``xq [M, K] x w [N, K]`` (both int8, or both float8_e4m3fn) with the fused epilogue, ``M <= 16``."""
    fp8 = FP8_DTYPE is not None and w.dtype == FP8_DTYPE
    if not (fp8 or w.dtype == torch.int8) or xq.dtype != w.dtype:
        raise ValueError(f"triton-gemv needs int8 x int8 or float8_e4m3fn x float8_e4m3fn, got activations {xq.dtype} "
                         f"and weight {w.dtype}")
    if fp8 and azp is not None:
        raise ValueError("triton-gemv: fp8 activations have no zero point")
    xq, out, m, n, k = gemm_io("triton-gemv", xq, w, out, out_dtype)
    if m == 0:
        return out
    cfg = resolve(config, m, n, k, xq.device) if config is not None else \
        pick_config(m, n, k, xq.device, FP8_CONFIGS if fp8 else None)
    sa, sa_stride = per_token_vec(a_scale, m, torch.float32, "triton-gemv: ")
    zp, zp_stride = per_token_vec(azp, m, torch.int32, "triton-gemv: ")
    if zp is not None and colsum is None:
        raise ValueError("triton-gemv: asymmetric activations need the weight's colsum")
    w_scale = w_scale.reshape(-1)
    bm = block_m(m, cfg.use_dot)
    if bm < m:
        raise ValueError(f"triton-gemv: M={m} exceeds {MAX_M}")
    if not cfg.use_dot and cfg.block_k > 1024:
        raise ValueError(f"triton-gemv: BLOCK_K={cfg.block_k} > 1024 breaks the exact fp32 block sums of int8")
    # dp4a reads w and x as int32 words: K, both row strides and both bases must be multiples of 4 bytes
    dp4a = (cfg.dp4a and not fp8 and not cfg.use_dot and bm == 1 and k % 4 == 0 and xq.stride(0) % 4 == 0
            and w.stride(0) % 4 == 0 and xq.data_ptr() % 4 == 0 and w.data_ptr() % 4 == 0)
    split_k = nonempty_splits(min(cfg.split_k, WS_ROWS // bm), k, cfg.block_k)
    tiles = math.ceil(n / cfg.block_n)
    split_k, ws, cnt = _WS.for_launch(xq.device, split_k, WS_ROWS * n, f"N={n}", tiles, w_scale)
    _gemv_kernel[(tiles, split_k)](
        xq, w, out, sa, w_scale, zp if zp is not None else sa, colsum if zp is not None else w_scale,
        bias if bias is not None else w_scale, ws, cnt, m, n, k, xq.stride(0), w.stride(0), out.stride(0),
        sa_stride, zp_stride, HAS_AZP=zp is not None, HAS_BIAS=bias is not None, IS_FP8=fp8, BLOCK_M=bm,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split_k, USE_DOT=cfg.use_dot,
        EVEN_K=k % cfg.block_k == 0, DP4A=dp4a, DP4A_ASM=not _INTERPRET, K_STAGES=cfg.num_stages,
        SWAP_AB=cfg.use_dot and cfg.swap_ab, PROMOTE=cfg.block_k if cfg.precise_acc else None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, PF_LINES=PDL_PREFETCH_LINES, **pdl_args(xq.device))
    return out


def bytes_floor(m: int, n: int, k: int) -> int:
    """Bytes a GEMV must move: the weight once, the activations, scales and the output (bf16)."""
    return n * k + m * k + 4 * (m + n) + 2 * m * n
