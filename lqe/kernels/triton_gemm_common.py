"""Pieces shared by the Triton quantized GEMM / GEMV kernels (lqe/kernels/triton_w8a8.py, triton_fp8.py,
triton_gemv_w8a8.py), written once:

* :func:`grouped_tile`: the grouped ("super-grouping") order of output tiles: ``GROUP_M`` row tiles sweep a column
  of tiles together so the weight tiles they share stay in L2;
* :func:`split_k_range`: the K blocks ``[kb0, kb1)`` of split ``pid_k`` (``SPLIT_K`` even shares, the last ragged);
  :func:`nonempty_splits` (host) trims ``SPLIT_K`` so that no split is left without a K block;
* :func:`tile_offsets` / :func:`kmajor_ptrs` / :func:`load_ab`: a tile's row / column indices (out-of-range rows and
  columns re-read a valid one, stores are masked), the K-contiguous A ``[BLOCK_M, BLOCK_K]`` / B ``[BLOCK_K, BLOCK_N]``
  pointers and their loads (K-masked unless ``EVEN_K``);
* :func:`scale_rows_cols` / :func:`store_tile`: the per-token x per-channel scale of the epilogue, and the bias add
  plus masked store;
* :func:`check_operands` / :func:`gemm_io` (host): the shape check of ``xq [M, K]`` x ``w [N, K]`` and the output
  every wrapper starts with;
* :func:`per_token_vec` (host): a per-token or one-element tensor as (contiguous tensor, stride 1 or 0);
* :class:`SplitKWorkspace` (host): a kernel family's per-device split-K partials and per-tile arrival counters, and
  :meth:`SplitKWorkspace.for_launch`, what one launch passes for them.

The ``@triton.jit`` helpers are inlined into the calling kernel by Triton: no call, no extra registers; constexpr
arguments stay constexpr.
"""
from __future__ import annotations

import torch

from lqe.kernels.device_info import device_key

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU
    triton = None
    tl = None


def nonempty_splits(split_k: int, k: int, block_k: int) -> int:
    """The fewest splits with the same per-split share as ``split_k``: :func:`split_k_range` gives each split
    ``ceil(k_blocks / split_k)`` blocks, so e.g. 56 K blocks over 9 splits fill 8 and leave the 9th empty (a program
    that only zeroes, arrives and waits). Same work per program, no empty ones."""
    k_blocks = max(1, -(-k // block_k))
    split_k = max(1, min(split_k, k_blocks))
    return -(-k_blocks // -(-k_blocks // split_k))


class SplitKWorkspace(dict):
    """The split-K buffers of one kernel family, per device: ``self[device_key(device)] = (partials, arrival
    counters)``.

    :meth:`reserve` grows them (at load, before any CUDA-graph capture: growing allocates); :meth:`acquire` grows
    them outside a capture and refuses inside one, naming the reserve call to make first."""

    def __init__(self, kernel: str, module: str, dtype: torch.dtype, zeroed: bool = False, cnt_slots: int = 8192):
        super().__init__()
        self.kernel, self.module, self.dtype, self.zeroed, self.cnt_slots = kernel, module, dtype, zeroed, cnt_slots
        # Buffers replaced by a larger reserve: a CUDA graph captured earlier still addresses them, so they are
        # kept alive (never freed, never reused by the caching allocator) rather than dropped.
        self.retired: list[tuple[torch.Tensor, torch.Tensor]] = []

    def reserve(self, device: torch.device | str, numel: int, what: str = "this layer") -> None:
        device, key = torch.device(device), device_key(device)
        ws = self.get(key)
        if ws is None or ws[0].numel() < numel:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{self.kernel} split-K workspace too small for {what} during CUDA-graph capture: "
                                   f"call {self.module}.reserve_workspace before capturing")
            if ws is not None:
                self.retired.append(ws)
            alloc = torch.zeros if self.zeroed else torch.empty
            self[key] = (alloc(max(numel, 1), dtype=self.dtype, device=device),
                                 torch.zeros(self.cnt_slots, dtype=torch.int32, device=device))

    def acquire(self, device: torch.device, numel: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        ws = self.get(device_key(device))
        if ws is None or ws[0].numel() < numel:
            self.reserve(device, numel, what)
            ws = self[device_key(device)]
        return ws

    def for_launch(self, device: torch.device, split_k: int, numel: int, what: str, tiles: int,
                   unused: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """``(split_k, partials, counters)`` of one launch: the workspace when ``split_k > 1`` and its counters have
        a slot per output tile; otherwise ``split_k`` 1 and ``unused`` (any tensor of the device) for both."""
        if split_k > 1:
            ws, cnt = self.acquire(device, numel, what)
            if tiles <= cnt.numel():
                return split_k, ws, cnt
        return 1, unused, unused


def check_operands(who: str, xq: torch.Tensor, w: torch.Tensor) -> None:
    """``xq [M, K]`` and the weight ``w [N, K]`` with K contiguous, or a ValueError naming ``who`` and the shapes."""
    if xq.dim() != 2 or w.dim() != 2 or xq.shape[1] != w.shape[1] or w.stride(1) != 1:
        raise ValueError(f"{who}: xq {tuple(xq.shape)} and w [N, K] {tuple(w.shape)} (K contiguous) do not match")


def gemm_io(who: str, xq: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None,
            out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """Check ``xq [M, K]`` against the weight ``w [N, K]`` (K contiguous); return ``xq`` with K contiguous, ``out``
    (``[M, N]`` of ``out_dtype`` when not given), and ``M, N, K``. ``who`` names the kernel in the error."""
    check_operands(who, xq, w)
    m, k = xq.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    return (xq if xq.stride(1) == 1 else xq.contiguous()), out, m, n, k


def per_token_vec(t: torch.Tensor | None, m: int, dtype: torch.dtype,
                  who: str = "") -> tuple[torch.Tensor | None, int]:
    """Per-token ``[M]`` / ``[M, 1]`` or one-element tensor -> (contiguous tensor, stride 1 or 0). No sync.
    ``who`` prefixes the error message (the kernel's name)."""
    if t is None:
        return None, 0
    t = t.reshape(-1)
    if t.dtype != dtype:
        t = t.to(dtype)
    if t.numel() == 1:
        return t, 0
    if t.numel() != m:
        raise ValueError(f"{who}per-token tensor has {t.numel()} elements for M={m}")
    return t.contiguous(), 1


if triton is not None:

    @triton.jit
    def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Output tile ``(pid_m, pid_n)`` of program ``pid`` in grouped order, and the tile counts."""
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        in_group = GROUP_M * num_pid_n
        first_m = (pid // in_group) * GROUP_M
        size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % size_m
        pid_n = (pid % in_group) // size_m
        return pid_m, pid_n, num_pid_m, num_pid_n

    @triton.jit
    def split_k_range(pid_k, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        """K blocks ``[kb0, kb1)`` of split ``pid_k``."""
        k_blocks = tl.cdiv(K, BLOCK_K)
        per_split = tl.cdiv(k_blocks, SPLIT_K)
        kb0 = pid_k * per_split
        kb1 = tl.minimum(kb0 + per_split, k_blocks)
        return kb0, kb1

    @triton.jit
    def tile_offsets(pid_m, pid_n, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Rows ``rm`` / columns ``rn`` of the tile, and the wrapped ``ram`` / ``rbn`` the loads use (out-of-range
        rows / columns load a valid row again instead of masking; stores are masked)."""
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ram = tl.max_contiguous(tl.multiple_of(rm % M, BLOCK_M), BLOCK_M)
        rbn = tl.max_contiguous(tl.multiple_of(rn % N, BLOCK_N), BLOCK_N)
        return rm, rn, ram, rbn

    @triton.jit
    def kmajor_ptrs(a_ptr, b_ptr, ram, rbn, rk, kb0, stride_am, stride_bn, BLOCK_K: tl.constexpr):
        """A ``[BLOCK_M, BLOCK_K]`` and B ``[BLOCK_K, BLOCK_N]`` (K-major, from ``w [N, K]``) at K block ``kb0``."""
        a_ptrs = a_ptr + ram[:, None] * stride_am + (kb0 * BLOCK_K + rk)[None, :]
        b_ptrs = b_ptr + rbn[None, :] * stride_bn + (kb0 * BLOCK_K + rk)[:, None]
        return a_ptrs, b_ptrs

    @triton.jit
    def load_ab(a_ptrs, b_ptrs, kb, rk, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        """The A and B tiles of K block ``kb`` (K-masked, zero-filled, unless ``EVEN_K``)."""
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = (kb * BLOCK_K + rk) < K
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None], other=0.0)
        return a, b

    @triton.jit
    def scale_rows_cols(acc, rm, rn, mask_m, mask_n, a_scale_ptr, a_scale_stride, w_scale_ptr):
        """``a_scale[m] * w_scale[n] * acc`` (fp32; ``a_scale_stride`` 0 for one static scale)."""
        sa = tl.load(a_scale_ptr + rm * a_scale_stride, mask=mask_m, other=0.0)
        sw = tl.load(w_scale_ptr + rn, mask=mask_n, other=0.0)
        return (sa[:, None] * sw[None, :]) * acc

    @triton.jit
    def store_tile(y, rm, rn, mask_m, mask_n, out_ptr, stride_om, bias_ptr, HAS_BIAS: tl.constexpr):
        """``y + bias[n]`` cast to the output dtype, stored where ``mask_m`` (rows) and ``mask_n`` (columns)."""
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        # int64 rows: M x N passes 2^31 at 37k tokens of a 57,344-wide gate_up (a long prefill chunk)
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])
