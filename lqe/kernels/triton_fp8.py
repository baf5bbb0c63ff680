"""Triton FP8 e4m3 GEMMs on the checkpoint's ``w [N, K]`` (K contiguous, what Hopper's fp8 wgmma wants for B):

* per-token x per-channel (``BLOCK_SCALE=0``): ``out = a_scale[m] * w_scale[n] * (xq @ w.T) + bias``, the scale
  epilogue fused (the alternative is ``torch._scaled_mm`` with row-wise scales: cuBLASLt, measured 1.20-1.60x bf16
  on the H100 in issue 25; which one a layer runs is the FP8_TABLE of lqe/kernels/dispatch.py, guessed until measured);
* block-scaled (``BLOCK_SCALE=128``): 128 x 128 weight blocks ``w_scale [ceil(N/128), ceil(K/128)]`` and 1 x 128
  activation groups ``a_scale [M, ceil(K/128)]`` (DeepSeek-V3 / llm-compressor FP8 block checkpoints): each 128-wide
  K step's fp32 product is scaled by ``a_scale[m, kb] * w_scale[n // 128, kb]`` before it is accumulated.
  ``torch._scaled_mm`` has no such mode on every torch, so this kernel serves every M: split-K for small M.

Split-K partials go to an fp32 workspace ``[SPLIT_K, M_pad, N]`` and the last program of a tile (arrival counter)
sums them in split order: deterministic, one launch. Configurations per M bucket in :data:`CONFIGS` (per channel) and
:data:`BLOCK_CONFIGS` (block-scaled), guessed until ``benchmarks/kernels.py --fp8-sweep`` measures them (it prints both
tables, paste-able); host-only choice, CUDA-graph capturable. The split-K workspace is ``WS_ROWS x N`` whatever M:
:func:`reserve_workspace` at load (lqe/kernels/w8a8.reserve_fp8_workspaces) covers every batch size.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from lqe.kernels.device_info import sm_count
from lqe.kernels.triton_gemm_common import SplitKWorkspace, gemm_io, nonempty_splits
from lqe.kernels.triton_pdl import pdl_args, pdl_start

try:
    import triton
    import triton.language as tl

    from lqe.kernels.triton_gemm_common import (grouped_tile, kmajor_ptrs, load_ab, scale_rows_cols,
                                                split_k_range, store_tile, tile_offsets)
except ImportError:  # pragma: no cover
    triton = None
    tl = None

SCALE_BLOCK = 128


def available() -> str | None:
    return "triton is not installed" if triton is None else None


@dataclass(frozen=True, slots=True)
class Fp8Config:
    block_m: int
    block_n: int
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1  # 0 = from the SM count
    group_m: int = 8
    # out^T = W x^T (per-channel scales only): the weight tile is wgmma's M operand (BLOCK_N >= 64 with 4 warps), the
    # tokens its N, so BLOCK_M = 16 runs native fp8 wgmma with no fp16 upcast (sm_90, Triton 3.6: 139 -> 75 SASS
    # instructions per 8 KB K block at M = 16, no F2FP; a SASS review). NOT MEASURED.
    swap_ab: bool = False
    # swap_ab: promote the fp8 wgmma sums to fp32 every BLOCK_K (max_num_imprecise_acc = BLOCK_K; +8 FADD per block).
    # Hopper's fp8 wgmma accumulates with fewer bits than fp32 (the M >= 64 tiles take that as it is); the fp16
    # mma.sync path of BLOCK_M = 16 sums exactly. Promoting serializes the K steps: Triton 3.6 adds the partial
    # sums before it waits for the wgmma, and ptxas inserts the wait itself (warning C7517; a review). The sweep
    # times both.
    precise_acc: bool = True

    def __str__(self) -> str:
        sk = "auto" if self.split_k == 0 else self.split_k
        sw = ("-swap" if self.precise_acc else "-swap-fast") if self.swap_ab else ""
        return f"m{self.block_m}n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}sk{sk}{sw}"


# GUESSED, NOT MEASURED (written without a GPU): BLOCK_M >= 64 with 4/8 warps runs on Hopper's fp8 wgmma.
CONFIGS: list[tuple[int | None, Fp8Config]] = [
    (16, Fp8Config(16, 64, 128, 4, 4, split_k=0)),
    (64, Fp8Config(64, 64, 128, 4, 4, split_k=0)),
    (256, Fp8Config(128, 128, 128, 8, 4)),
    (None, Fp8Config(128, 256, 128, 8, 3)),
]


# the block-scaled kernel's (BLOCK_K = 128: one activation group / weight block column per K step; BLOCK_N <= 128:
# one weight block row per tile). GUESSED, NOT MEASURED: CONFIGS with those two bounds applied.
BLOCK_CONFIGS: list[tuple[int | None, Fp8Config]] = [
    (16, Fp8Config(16, 64, 128, 4, 4, split_k=0)),
    (64, Fp8Config(64, 64, 128, 4, 4, split_k=0)),
    (256, Fp8Config(128, 128, 128, 8, 4)),
    (None, Fp8Config(128, 128, 128, 8, 3)),
]


def sweep_configs(m: int) -> list[Fp8Config]:
    out = []
    bms = [16] if m <= 16 else [32, 64] if m <= 64 else [64, 128]
    for bm in bms:
        for bn in (64, 128, 256):
            for bk in (128,) if m <= 64 else (64, 128):
                for st in (3, 4, 5):
                    for nw in (4, 8):
                        if (bm + bn) * bk * st > 200 * 1024 or (bn == 256 and nw == 4) or (bm < 64 and nw == 8):
                            continue
                        out.append(Fp8Config(bm, bn, bk, nw, st, 0 if m <= 64 else 1))
                        if bm == 16 and bn >= 64 and nw == 4:  # the swapped GEMM (fp8 wgmma at 16 tokens)
                            out.append(Fp8Config(bm, bn, bk, nw, st, 0, swap_ab=True))
                            out.append(Fp8Config(bm, bn, bk, nw, st, 0, swap_ab=True, precise_acc=False))
    return out


def pick_config(m: int, n: int, k: int, device: torch.device | None = None,
                table: list[tuple[int | None, Fp8Config]] | None = None) -> Fp8Config:
    cfg = next(c for max_m, c in (table or CONFIGS) if max_m is None or m <= max_m)
    return resolve(cfg, m, n, k, device)


def resolve(cfg: Fp8Config, m: int, n: int, k: int, device: torch.device | None) -> Fp8Config:
    if cfg.split_k != 0:
        return cfg
    tiles = math.ceil(m / cfg.block_m) * math.ceil(n / cfg.block_n)
    want = math.ceil(2 * sm_count(device, cpu_default=8) / max(tiles, 1))
    rows = math.ceil(m / cfg.block_m) * cfg.block_m
    sk = max(1, min(want, math.ceil(k / cfg.block_k) // 4, WS_ROWS // rows, 32))
    return dataclasses.replace(cfg, split_k=sk)


# ------------------------------------------------------------------------------------------------ workspace
WS_ROWS = 512  # split_k * M_pad rows of fp32 partials per output column
# zeroed: the split-K sums read the padding rows of a tile (rows >= M), which no split writes (they are dropped)
_WS = SplitKWorkspace("triton-fp8", "lqe.kernels.triton_fp8", torch.float32, zeroed=True)


def reserve_workspace(device: torch.device | str, n: int) -> None:
    """Make the split-K workspace hold ``WS_ROWS x n`` partials. Call before a CUDA-graph capture."""
    _WS.reserve(device, WS_ROWS * n)


# ------------------------------------------------------------------------------------------------ kernel
if triton is not None:

    @triton.jit
    def _fp8_epilogue(acc, rm, rn, M, N, out_ptr, stride_om, a_scale_ptr, a_scale_stride, w_scale_ptr, bias_ptr,
                      HAS_BIAS: tl.constexpr, BLOCK_SCALE: tl.constexpr):
        mask_m = rm < M
        mask_n = rn < N
        y = acc
        if BLOCK_SCALE == 0:
            y = scale_rows_cols(acc, rm, rn, mask_m, mask_n, a_scale_ptr, a_scale_stride, w_scale_ptr)
        store_tile(y, rm, rn, mask_m, mask_n, out_ptr, stride_om, bias_ptr, HAS_BIAS)

    @triton.jit
    def _fp8_mm_kernel(a_ptr, b_ptr, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, K,
                       stride_am, stride_bn, stride_om, a_scale_stride, stride_sam, stride_swn,
                       HAS_BIAS: tl.constexpr, BLOCK_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
                       EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr, PROMOTE: tl.constexpr, RED_STAGES: tl.constexpr,
                       PDL: tl.constexpr):
        pdl_start(PDL)  # (lqe.kernels.triton_pdl)
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m, pid_n, num_pid_m, num_pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm, rn, ram, rbn = tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        kb0, kb1 = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
        a_ptrs, b_ptrs = kmajor_ptrs(a_ptr, b_ptr, ram, rbn, rk, kb0, stride_am, stride_bn, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # (SWAP_AB)
        for kb in range(kb0, kb1):
            a, b = load_ab(a_ptrs, b_ptrs, kb, rk, K, BLOCK_K, EVEN_K)
            if SWAP_AB:  # out^T = W x^T: both operands K-major in shared memory, as wgmma takes them
                acc_t = tl.dot(tl.trans(b), tl.trans(a), acc_t, out_dtype=tl.float32, max_num_imprecise_acc=PROMOTE)
            elif BLOCK_SCALE == 0:
                acc = tl.dot(a, b, acc, out_dtype=tl.float32)
            else:  # BLOCK_K == BLOCK_SCALE: one activation group / weight block column per step
                sa = tl.load(a_scale_ptr + ram * stride_sam + kb)
                sw = tl.load(w_scale_ptr + (rbn // BLOCK_SCALE) * stride_swn + kb)
                part = tl.dot(a, b, out_dtype=tl.float32)
                acc += part * (sa[:, None] * sw[None, :])
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if SWAP_AB:
            acc = tl.trans(acc_t)
        if SPLIT_K == 1:
            _fp8_epilogue(acc, rm, rn, M, N, out_ptr, stride_om, a_scale_ptr, a_scale_stride, w_scale_ptr,
                          bias_ptr, HAS_BIAS, BLOCK_SCALE)
        else:
            m_pad = num_pid_m * BLOCK_M
            # padding rows (rm >= M) are never stored; the sums read them back as whatever the workspace holds (zeroed
            # at allocation), and the epilogue drops them (a row mask on those loads cost 13 registers at 64 x 64,
            # split 5)
            mask = (rn < N)[None, :]
            tl.store(ws_ptr + (pid_k * m_pad + rm)[:, None] * N + rn[None, :], acc, mask=mask & (rm < M)[:, None])
            tl.debug_barrier()
            tile = pid_m * num_pid_n + pid_n
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:  # last program of the tile: sum the partials in split order
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                if RED_STAGES == 0:
                    for s in tl.static_range(SPLIT_K):  # unrolled: every split's load in flight, summed in order
                        total += tl.load(ws_ptr + (s * m_pad + rm)[:, None] * N + rn[None, :], mask=mask,
                                         other=0.0, cache_modifier=".cg")
                else:  # pipelined (cp.async): RED_STAGES - 1 splits in flight, the same order, fewer registers
                    for s in tl.range(0, SPLIT_K, num_stages=RED_STAGES):
                        total += tl.load(ws_ptr + (s * m_pad + rm)[:, None] * N + rn[None, :], mask=mask,
                                         other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")  # (stream order publishes it to the next launch)
                _fp8_epilogue(total, rm, rn, M, N, out_ptr, stride_om, a_scale_ptr, a_scale_stride, w_scale_ptr,
                              bias_ptr, HAS_BIAS, BLOCK_SCALE)


# ------------------------------------------------------------------------------------------------ host side
def fp8_mm(xq: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
           bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
           config: Fp8Config | None = None, block_scale: bool = False) -> torch.Tensor:
    """fp8 ``xq [M, K]`` x fp8 ``w [N, K]``. Per-token/per-channel: ``a_scale [M]|[M,1]|one``, ``w_scale [N]``.
    Block-scaled (``block_scale=True``): ``a_scale [M, ceil(K/128)]`` (1 x 128 groups), ``w_scale
    [ceil(N/128), ceil(K/128)]`` (128 x 128 blocks)."""
    f8 = torch.float8_e4m3fn
    if xq.dtype != f8 or w.dtype != f8:
        raise ValueError(f"triton-fp8 needs float8_e4m3fn activations and weights, got {xq.dtype} and {w.dtype}")
    xq, out, m, n, k = gemm_io("triton-fp8", xq, w, out, out_dtype)
    if m == 0:
        return out
    cfg = resolve(config, m, n, k, xq.device) if config is not None else \
        pick_config(m, n, k, xq.device, BLOCK_CONFIGS if block_scale else None)
    kb = math.ceil(k / SCALE_BLOCK)
    if block_scale:
        if cfg.block_k != SCALE_BLOCK or cfg.block_n > SCALE_BLOCK:
            cfg = dataclasses.replace(cfg, block_n=min(cfg.block_n, SCALE_BLOCK), block_k=SCALE_BLOCK)
        if a_scale.shape != (m, kb) or w_scale.shape != (math.ceil(n / SCALE_BLOCK), kb):
            raise ValueError(f"triton-fp8 block scales: a_scale {tuple(a_scale.shape)} should be {(m, kb)}, w_scale "
                             f"{tuple(w_scale.shape)} should be {(math.ceil(n / SCALE_BLOCK), kb)}")
        sa, sw = a_scale.float().contiguous(), w_scale.float().contiguous()
        sa_stride, stride_sam, stride_swn = 0, sa.stride(0), sw.stride(0)
    else:
        sa = a_scale.float().reshape(-1)
        if sa.numel() not in (1, m):
            raise ValueError(f"triton-fp8: a_scale has {sa.numel()} elements for M={m}")
        sa_stride = 0 if sa.numel() == 1 else 1
        sa, sw = sa.contiguous(), w_scale.float().reshape(-1).contiguous()
        stride_sam = stride_swn = 0
    grid_mn = math.ceil(m / cfg.block_m) * math.ceil(n / cfg.block_n)
    m_pad = math.ceil(m / cfg.block_m) * cfg.block_m
    split_k = nonempty_splits(min(cfg.split_k, WS_ROWS // m_pad), k, cfg.block_k)
    split_k, ws, cnt = _WS.for_launch(xq.device, split_k, WS_ROWS * n, f"N={n}", grid_mn, sw)
    _fp8_mm_kernel[(grid_mn, split_k)](
        xq, w, out, sa, sw, bias if bias is not None else sw, ws, cnt, m, n, k, xq.stride(0), w.stride(0),
        out.stride(0), sa_stride, stride_sam, stride_swn, HAS_BIAS=bias is not None, BLOCK_SCALE=SCALE_BLOCK if block_scale else 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split_k, GROUP_M=cfg.group_m,
        EVEN_K=k % cfg.block_k == 0, SWAP_AB=cfg.swap_ab and not block_scale,
        PROMOTE=cfg.block_k if cfg.precise_acc else None,
        RED_STAGES=red_stages(cfg, split_k), num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(xq.device))
    return out


def red_stages(cfg: Fp8Config, split_k: int) -> int:
    """How the last program of a split-K tile sums the partials: 0 = unrolled (every split's tile live in registers
    at once), else a pipelined loop with that many stages. Unrolled, a 64 x 64 tile at split 5 took 188 registers
    (2 programs per SM: 320 programs ran 1.21 waves on 132 SMs); pipelined 168 (3 per SM, 0.81 waves), the same
    summation order (sm_90, Triton 3.6; a SASS review, not measured). Unrolled while the partials take <= 64
    registers per thread."""
    return 0 if cfg.block_m * cfg.block_n * split_k <= 64 * 32 * cfg.num_warps else 4


def block_fp8_ref(xq, a_scale, w, w_scale, bias=None):
    """float64 reference of the block-scaled product (dequantize both operands, multiply)."""
    m, k = xq.shape
    n = w.shape[0]
    sa = a_scale.double().repeat_interleave(SCALE_BLOCK, 1)[:, :k]
    sw = w_scale.double().repeat_interleave(SCALE_BLOCK, 0)[:n].repeat_interleave(SCALE_BLOCK, 1)[:, :k]
    out = (xq.double() * sa) @ (w.double() * sw).t()
    return out if bias is None else out + bias.double()
