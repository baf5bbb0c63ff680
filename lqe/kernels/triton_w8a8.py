"""Triton W8A8 int8 GEMMs on the checkpoint's own weight layout: int8 ``w [N, K]`` row-major (K contiguous).

``out[m, n] = a_scale[m] * w_scale[n] * (sum_k xq[m, k] * w[n, k] - azp[m] * colsum[n]) + bias[n]``, cast to the
output dtype; ``a_scale`` per token ``[M]`` or one scalar (static), ``azp`` optional (asymmetric activations, per
token or scalar), ``bias`` optional. K-major int8 is what Hopper's int8 wgmma wants for both operands, so the
weight needs no repack and one copy serves every M: the same tensor feeds ``torch._int_mm`` as ``w.t()``.

* :func:`w8a8_mm`: the tiled int8 tensor-core GEMM with the epilogue fused. With ``split_k > 1`` (small M:
  weight streaming) the K range is cut over ``split_k`` programs per tile, whose int32 partial sums are added
  into an int32 workspace with atomics (exact, so the result does not depend on their order), and the last
  program of each tile (an arrival counter) reads the total back, zeroes workspace and counter for the next
  call, and applies the epilogue: one launch, deterministic, nothing allocated per call.
* :func:`int_mm_w8a8`: ``torch._int_mm`` (cuBLASLt int8, M > 16 only) then :func:`w8a8_epilogue`, a Triton
  kernel that applies the same epilogue to the int32 product.

Tile configurations are chosen on the host from ``(M, N, K)`` by :func:`pick_config` (a table per M bucket,
no ``triton.autotune``: nothing syncs, so both paths can be captured in a CUDA graph). The workspace is
allocated up front by :func:`reserve_workspace` (called when a layer's weights are processed) and is shared by
all layers of a device: calls on one stream run one after another and each leaves it zeroed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from lqe.kernels.device_info import sm_count
from lqe.kernels.triton_gemm_common import (SplitKWorkspace, check_operands, gemm_io, nonempty_splits,
                                            per_token_vec)

try:
    import triton
    import triton.language as tl

    from lqe.kernels.triton_gemm_common import (grouped_tile, kmajor_ptrs, load_ab, scale_rows_cols,
                                                split_k_range, store_tile, tile_offsets)
except ImportError:  # pragma: no cover - triton is optional on CPU
    triton = None
    tl = None


def available() -> str | None:
    """Why the Triton W8A8 kernels cannot run, or ``None``."""
    if triton is None:
        return "triton is not installed"
    return None


@dataclass(frozen=True, slots=True)
class W8A8Config:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1  # 0 = choose from the SM count (small M)
    group_m: int = 8

    def __str__(self) -> str:
        sk = "auto" if self.split_k == 0 else self.split_k
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"
                f"sk{sk}")


# (max_m, config), first row covering M wins. BLOCK_M >= 64 with 4/8 warps runs on Hopper's wgmma; smaller
# tiles on mma.sync. To be set from `python benchmarks/kernels.py --w8a8-sweep` on the target GPU. The M <= 64 rows
# had BLOCK_K = 256: 4 stages of (64 + 64) x 256 bytes = 128 KB of shared memory, one program per SM, so the split-K
# grid ran 1.9-3.4 waves on 132 SMs (a SASS / occupancy review, sm_90; measured 0.66x cuBLAS bf16 at M = 64 on the
# H200). BLOCK_K = 128 halves it (3 programs per SM at M = 64); not measured yet (int-mm+epilogue runs M <= 128).
CONFIGS: list[tuple[int | None, W8A8Config]] = [
    (16, W8A8Config(16, 64, 128, num_warps=4, num_stages=4, split_k=0)),
    (32, W8A8Config(32, 64, 128, num_warps=4, num_stages=4, split_k=0)),
    (64, W8A8Config(64, 64, 128, num_warps=4, num_stages=4, split_k=0)),
    (128, W8A8Config(64, 128, 128, num_warps=4, num_stages=4)),
    (256, W8A8Config(128, 128, 128, num_warps=8, num_stages=4)),
    (None, W8A8Config(128, 256, 128, num_warps=8, num_stages=3)),
]


def sweep_configs(m: int) -> list[W8A8Config]:
    """Candidate configurations for ``m`` tokens (benchmarks/kernels.py --w8a8-sweep times them all)."""
    out = []
    if m <= 64:
        bms = [16] if m <= 16 else ([32] if m <= 32 else [32, 64])
        for bm in bms:
            for bn in (64, 128):
                for bk in (128, 256, 512):
                    for st in (3, 4, 5):
                        for sk in (0, 1):
                            if (bm + bn) * bk * st > 200 * 1024:  # shared memory of the pipeline stages
                                continue
                            out.append(W8A8Config(bm, bn, bk, 4, st, sk))
    else:
        bms = [64, 128] if m <= 256 else [128]
        for bm in bms:
            for bn in (128, 256):
                for bk in (64, 128):
                    for st in (3, 4, 5):
                        for nw in (4, 8):
                            if (bm + bn) * bk * st > 200 * 1024 or (bn == 256 and nw == 4):
                                continue
                            out.append(W8A8Config(bm, bn, bk, nw, st, 1))
    return out


def pick_config(m: int, n: int, k: int, device: torch.device | None = None,
                table: list[tuple[int | None, W8A8Config]] | None = None) -> W8A8Config:
    """The tile configuration for an ``[m, k] x [k, n]`` product: the first row of ``table`` (default
    :data:`CONFIGS`) covering ``m``, with ``split_k == 0`` resolved from the SM count. Host-only, no sync."""
    for max_m, cfg in (table or CONFIGS):
        if max_m is None or m <= max_m:
            break
    if cfg.split_k == 0:
        cfg = W8A8Config(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages,
                         auto_split_k(m, n, k, cfg, sm_count(device, cpu_default=8)), cfg.group_m)
    return cfg


def asym_config(cfg: W8A8Config) -> W8A8Config:
    """``cfg`` for asymmetric activations: their epilogue widens the accumulator tile to int64 (``acc - azp x colsum``
    can leave int32), so a thread holds at most 64 accumulators; the 128 x 256 x 8-warp tile (128 each) spills 532
    bytes with Triton 3.9 (tests/test_hopper_launches.py), so it runs as 128 x 128."""
    per_thread = cfg.block_m * cfg.block_n // (32 * cfg.num_warps)
    return cfg if per_thread <= 64 else replace(cfg, block_n=max(16, cfg.block_n * 64 // per_thread))


def auto_split_k(m: int, n: int, k: int, cfg: W8A8Config, sms: int) -> int:
    """Enough K splits that about two programs run per SM, each still streaming >= 4 K blocks."""
    tiles = math.ceil(m / cfg.block_m) * math.ceil(n / cfg.block_n)
    k_blocks = math.ceil(k / cfg.block_k)
    want = max(1, (2 * sms) // max(tiles, 1))
    return max(1, min(want, k_blocks // 4, 32))


# ------------------------------------------------------------------------------------------------ workspace
_WS = SplitKWorkspace("triton-w8a8", "lqe.kernels.triton_w8a8", torch.int32, zeroed=True)


def reserve_workspace(device: torch.device | str, rows: int, n: int) -> None:
    """Make the split-K workspace of ``device`` hold ``rows x n`` int32 partial sums (zeroed). Call before any
    CUDA-graph capture: growing it allocates."""
    _WS.reserve(device, rows * n)


def workspace_rows(table: list[tuple[int | None, W8A8Config]] | None = None) -> int:
    """Rows of split-K workspace the table's split-K buckets can use (M rounded up to BLOCK_M)."""
    rows = 0
    for max_m, cfg in (table or CONFIGS):
        if cfg.split_k != 1:
            rows = max(rows, math.ceil((max_m or 64) / cfg.block_m) * cfg.block_m)
    return max(rows, 16)


# ------------------------------------------------------------------------------------------------ kernels
if triton is not None:

    @triton.jit
    def _epilogue(acc, rm, rn, M, N, out_ptr, stride_om, a_scale_ptr, a_scale_stride, w_scale_ptr,
                  azp_ptr, azp_stride, colsum_ptr, bias_ptr, HAS_AZP: tl.constexpr, HAS_BIAS: tl.constexpr):
        mask_m = rm < M
        mask_n = rn < N
        if HAS_AZP:  # int64: an asymmetric row whose range excludes 0 can have |azp| > 127
            azp = tl.load(azp_ptr + rm * azp_stride, mask=mask_m, other=0).to(tl.int64)
            cs = tl.load(colsum_ptr + rn, mask=mask_n, other=0).to(tl.int64)
            accf = (acc.to(tl.int64) - azp[:, None] * cs[None, :]).to(tl.float32)
        else:
            accf = acc.to(tl.float32)
        y = scale_rows_cols(accf, rm, rn, mask_m, mask_n, a_scale_ptr, a_scale_stride, w_scale_ptr)
        store_tile(y, rm, rn, mask_m, mask_n, out_ptr, stride_om, bias_ptr, HAS_BIAS)

    @triton.jit
    def _w8a8_mm_kernel(a_ptr, b_ptr, out_ptr, a_scale_ptr, w_scale_ptr, azp_ptr, colsum_ptr, bias_ptr,
                        ws_ptr, cnt_ptr, M, N, K, stride_am, stride_bn, stride_om, a_scale_stride, azp_stride,
                        HAS_AZP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m, pid_n, num_pid_m, num_pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm, rn, ram, rbn = tile_offsets(pid_m, pid_n, M, N, BLOCK_M, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        kb0, kb1 = split_k_range(pid_k, K, BLOCK_K, SPLIT_K)
        a_ptrs, b_ptrs = kmajor_ptrs(a_ptr, b_ptr, ram, rbn, rk, kb0, stride_am, stride_bn, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for kb in range(kb0, kb1):
            a, b = load_ab(a_ptrs, b_ptrs, kb, rk, K, BLOCK_K, EVEN_K)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K

        if SPLIT_K == 1:
            _epilogue(acc, rm, rn, M, N, out_ptr, stride_om, a_scale_ptr, a_scale_stride, w_scale_ptr,
                      azp_ptr, azp_stride, colsum_ptr, bias_ptr, HAS_AZP, HAS_BIAS)
        else:
            mask = (rm < M)[:, None] & (rn < N)[None, :]
            ws_ptrs = ws_ptr + rm[:, None] * N + rn[None, :]
            tl.atomic_add(ws_ptrs, acc, mask=mask, sem="relaxed")
            tl.debug_barrier()  # every thread's partial sums are issued before the (release) arrival below
            tile = pid_m * num_pid_n + pid_n
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:  # last program of this tile: read the total, leave zeros behind
                total = tl.atomic_xchg(ws_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32), mask=mask)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")  # (stream order publishes it to the next launch)
                _epilogue(total, rm, rn, M, N, out_ptr, stride_om, a_scale_ptr, a_scale_stride, w_scale_ptr,
                          azp_ptr, azp_stride, colsum_ptr, bias_ptr, HAS_AZP, HAS_BIAS)

    @triton.jit
    def _epilogue_kernel(c_ptr, out_ptr, a_scale_ptr, w_scale_ptr, azp_ptr, colsum_ptr, bias_ptr, M, N,
                         stride_cm, stride_om, a_scale_stride, azp_stride, HAS_AZP: tl.constexpr,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.load(c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :], mask=(rm < M)[:, None] & (rn < N)[None, :],
                      other=0)
        _epilogue(acc, rm, rn, M, N, out_ptr, stride_om, a_scale_ptr, a_scale_stride, w_scale_ptr,
                  azp_ptr, azp_stride, colsum_ptr, bias_ptr, HAS_AZP, HAS_BIAS)


# ------------------------------------------------------------------------------------------------ host side
def _check(xq: torch.Tensor, w: torch.Tensor) -> None:
    if xq.dtype != torch.int8 or w.dtype != torch.int8:
        raise ValueError(f"triton-w8a8 needs int8 activations and weights, got {xq.dtype} and {w.dtype}")


def w8a8_mm(xq: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
            azp: torch.Tensor | None = None, colsum: torch.Tensor | None = None, bias: torch.Tensor | None = None,
            out_dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None,
            config: W8A8Config | None = None) -> torch.Tensor:
    """int8 ``xq [M, K]`` x int8 ``w [N, K]`` with the fused epilogue (see the module docstring)."""
    _check(xq, w)
    xq, out, m, n, k = gemm_io("triton-w8a8", xq, w, out, out_dtype)
    if m == 0:
        return out
    cfg = config or pick_config(m, n, k, xq.device)
    if cfg.split_k == 0:
        cfg = pick_config(m, n, k, xq.device, [(None, cfg)])
    sa, sa_stride = per_token_vec(a_scale, m, torch.float32)
    zp, zp_stride = per_token_vec(azp, m, torch.int32)
    if zp is not None and colsum is None:
        raise ValueError("triton-w8a8: asymmetric activations need the weight's colsum")
    if zp is not None:
        cfg = asym_config(cfg)
    w_scale = w_scale.reshape(-1)
    grid_mn = math.ceil(m / cfg.block_m) * math.ceil(n / cfg.block_n)
    split_k = nonempty_splits(cfg.split_k, k, cfg.block_k)
    rows = math.ceil(m / cfg.block_m) * cfg.block_m
    split_k, ws, cnt = _WS.for_launch(xq.device, split_k, rows * n, f"{rows}x{n}", grid_mn, w_scale)
    _w8a8_mm_kernel[(grid_mn, split_k)](
        xq, w, out, sa, w_scale, zp if zp is not None else sa, colsum if zp is not None else w_scale,
        bias if bias is not None else w_scale, ws, cnt, m, n, k, xq.stride(0), w.stride(0), out.stride(0),
        sa_stride, zp_stride, HAS_AZP=zp is not None, HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split_k, GROUP_M=cfg.group_m,
        EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def w8a8_epilogue(acc: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, azp: torch.Tensor | None = None,
                  colsum: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """The epilogue alone on an int32 product ``acc [M, N]`` (one read of ``acc``, one write of ``out``)."""
    m, n = acc.shape
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=acc.device)
    if m == 0:
        return out
    sa, sa_stride = per_token_vec(a_scale, m, torch.float32)
    zp, zp_stride = per_token_vec(azp, m, torch.int32)
    w_scale = w_scale.reshape(-1)
    bm, bn = 32, 128
    _epilogue_kernel[(math.ceil(m / bm), math.ceil(n / bn))](
        acc, out, sa, w_scale, zp if zp is not None else sa, colsum if zp is not None else w_scale,
        bias if bias is not None else w_scale, m, n, acc.stride(0), out.stride(0), sa_stride, zp_stride,
        HAS_AZP=zp is not None, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
    return out


def int_mm_unsupported(m: int, n: int, k: int) -> str | None:
    """Why ``torch._int_mm`` refuses this product (its own checks, evaluated on the host), or ``None``."""
    if m <= 16:
        return f"torch._int_mm needs M > 16 (M={m})"
    if k % 8 or n % 8:
        return f"torch._int_mm needs K and N multiples of 8 (K={k}, N={n})"
    return None


def int_mm_w8a8(xq: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                azp: torch.Tensor | None = None, colsum: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch._int_mm(xq, w.t())`` (cuBLASLt int8, column-major B) then :func:`w8a8_epilogue`."""
    _check(xq, w)
    check_operands("torch._int_mm", xq, w)
    acc = torch._int_mm(xq.contiguous(), w.t())
    return w8a8_epilogue(acc, a_scale, w_scale, azp, colsum, bias, out_dtype, out)
