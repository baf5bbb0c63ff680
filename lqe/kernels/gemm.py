"""Python entry points of the lqe W4A16/W8A16 GEMMs and kernel selection.

Two implementations read the same packed weights (:mod:`lqe.kernels.repack`; one copy per layer): the CUDA
GEMM (csrc/gemm/wna16_gemm.cu, the decode kernel for a few tokens) and the Triton kernels of
:mod:`lqe.kernels.triton_wna16` (tensor-core GEMM for tens to hundreds of tokens; dequantize + cuBLAS for
prefill). Which runs for M tokens is ``dispatch.WNA16_TABLE``, resolved per call on the host from shapes only
(graph-capturable). Everything here imports on a machine without CUDA; :func:`available` says whether the
extension could be built and loaded, :func:`unavailable_reason` says why not.
"""
from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass

import torch

from lqe.kernels import build, dispatch
from lqe.kernels.device_info import device_key, pdl_enabled, pdl_supported, sm_count as device_sm_count
from lqe.kernels import gemm_mma
from lqe.kernels.repack import PackedWNA16, repack_wna16, wna16_unsupported
from lqe.kernels.repack_mma import PackedMMA, mma_unsupported, repack_mma
from lqe.kernels.canonical import CanonicalWeight

log = logging.getLogger(__name__)

# Above this many tokens path="cuda" switches to the CUDA dequantize + cuBLAS. The default path ("auto")
# follows dispatch.WNA16_TABLE instead.
LARGE_M_THRESHOLD = 128
# What a table row becomes when its kernel is unavailable here (no triton / extension not built).
_COUNTERPART = {"lqe-wna16-fused": "triton-wna16", "lqe-wna16-ring": "triton-wna16", "triton-wna16": "lqe-wna16-fused",
                "triton-wna16-swap": "lqe-wna16-fused",
                "triton-dequant+cublas": "dequant+cublas", "dequant+cublas": "triton-dequant+cublas",
                "triton-dequant-l2+cublas": "dequant+cublas",
                "lqe-w4a16-mma": "triton-wna16", "lqe-w4a16-mma-k2": "triton-wna16",
                "lqe-w4a16-mma-dequant+cublas": "triton-dequant+cublas"}
_MMA_KERNELS = (*gemm_mma.MMA_GEMM_NAMES, "lqe-w4a16-mma-dequant+cublas")
_TRITON_KERNELS = ("triton-wna16", "triton-wna16-swap", "triton-dequant+cublas", "triton-dequant-l2+cublas")
# Split-K aims for this many resident blocks per SM so few-tile decode shapes still fill the GPU.
# NEEDS MEASUREMENT (memory-level parallelism vs. fix-up traffic).
TARGET_BLOCKS_PER_SM = 4
BLOCK_N = 256  # kWna16BlockN / kW8a8BlockN in csrc/gemm/gemm_launch.h

_state: dict[str, object] = {}


def _ext():
    if "ext" not in _state and "error" not in _state:
        try:
            _state["ext"] = build.load()
            log.info("lqe kernels: CUDA GEMM extension loaded")
        except build.BuildError as e:
            _state["error"] = str(e)
            log.info("lqe kernels unavailable, using torch paths: %s", e)
    if "ext" not in _state:
        raise RuntimeError(f"lqe CUDA kernels unavailable: {_state['error']}")
    return _state["ext"]


def available() -> bool:
    """True when the CUDA extension is built and loaded (builds it on first call on a GPU machine)."""
    try:
        _ext()
        return True
    except RuntimeError:
        return False


def unavailable_reason() -> str | None:
    return None if available() else str(_state.get("error"))


def ext():
    """The loaded extension module (raises ``RuntimeError`` with the reason when unavailable)."""
    return _ext()


def sm_count(device_index: int) -> int:
    return device_sm_count(torch.device("cuda", device_index), cpu_default=1)


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64


def plan_slabs_per_split(m: int, n: int, k: int, device: torch.device, kslab: int, unroll: int,
                         splits: int | None = None) -> int:
    """K slabs (of ``kslab`` rows) per split, a multiple of ``unroll``; ``splits=None`` picks by SM count."""
    units = k // (kslab * unroll)
    if splits is None:
        tiles = math.ceil(n / BLOCK_N) * math.ceil(m / _block_m(m))
        target = sm_count(device.index if device.index is not None else torch.cuda.current_device()) * TARGET_BLOCKS_PER_SM
        splits = max(1, min(units, target // max(1, tiles)))
    splits = max(1, min(units, int(splits)))
    return math.ceil(units / splits) * unroll


# Split-K arrival counters per device: one per (256-column, 16-row) tile. The first buffer covers N <= 65536 at
# M <= 8192 (512 KiB), so a CUDA graph captured after the first call never needs a larger one.
COUNTERS_MIN = 1 << 17
_retired_counters: list[torch.Tensor] = []  # buffers a larger one replaced: graphs captured before still use them


def counters(device: torch.device, needed: int) -> torch.Tensor:
    """Persistent zeroed split-K arrival counters (the kernels reset what they use). One stream at a time."""
    key = f"counters:{device_key(device)}"
    buf = _state.get(key)
    if buf is None or buf.numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"lqe W4A16/W8A8 CUDA GEMM: {needed} split-K counters needed inside a CUDA graph "
                               f"capture, {0 if buf is None else buf.numel()} reserved; run the layer once at this M "
                               "before capturing")
        if buf is not None:
            _retired_counters.append(buf)
        buf = torch.zeros(max(needed, COUNTERS_MIN), dtype=torch.int32, device=device)
        _state[key] = buf
    return buf


def triton_reason(device: torch.device | str) -> str | None:
    """Why the Triton W4A16 kernels cannot run on ``device`` (``None``: they can)."""
    from lqe.kernels import triton_wna16

    return triton_wna16.unavailable_reason(device)


_MMA_DECLINED: set[str] = set()  # reasons already logged by select_w4a16_kernel
_TABLES = {"": "WNA16_TABLE", "default": "WNA16_TABLE", "mma": "WNA16_MMA_TABLE", "mma-k2": "WNA16_MMA_K2_TABLE",
           "swap": "WNA16_SWAP_TABLE", "ring": "WNA16_RING_TABLE"}


def active_table() -> list[tuple[int | None, str]]:
    """``dispatch.WNA16_TABLE``, or the candidate ``dispatch.WNA16_MMA_TABLE`` / ``WNA16_MMA_K2_TABLE`` /
    ``WNA16_SWAP_TABLE`` / ``WNA16_RING_TABLE`` when ``LQE_WNA16_TABLE`` is ``mma`` / ``mma-k2`` / ``swap`` / ``ring``
    (the e2e benchmark's variants, before a measurement makes one the default)."""
    choice = os.environ.get("LQE_WNA16_TABLE", "").strip().lower()
    if choice not in _TABLES:
        raise ValueError(f"LQE_WNA16_TABLE={choice!r}: use 'mma' (dispatch.WNA16_MMA_TABLE), 'mma-k2' "
                         "(dispatch.WNA16_MMA_K2_TABLE), 'swap' (dispatch.WNA16_SWAP_TABLE), 'ring' "
                         "(dispatch.WNA16_RING_TABLE) or leave it unset")
    return getattr(dispatch, _TABLES[choice])


def table_uses_mma(table: list[tuple[int | None, str]] | None = None) -> bool:
    """True when the table names lqe-w4a16-mma: layers are then repacked into its layout."""
    return any(name in _MMA_KERNELS for _, name in (table if table is not None else active_table()))


@functools.lru_cache(maxsize=None)
def _table_for(device_key: str, has_cuda: bool, has_triton: bool, mma_layout: bool,
               table: tuple[tuple[int | None, str], ...]) -> tuple[tuple[int | None, str], ...]:
    rows = []
    for max_m, name in table:
        if mma_layout:  # one layout per layer: every row becomes the mma GEMM or the mma dequantize + cuBLAS
            name = name if name in _MMA_KERNELS else (
                "lqe-w4a16-mma-dequant+cublas" if name in gemm_mma.MMA_DEQUANT_NAMES else gemm_mma.MMA_KERNEL)
        else:
            if name in _MMA_KERNELS:
                name = _COUNTERPART[name]
            ok = has_triton if name in _TRITON_KERNELS else has_cuda
            if not ok:
                name = _COUNTERPART[name]
        rows.append((max_m, name))
    return tuple(rows)


def resolved_table(device: torch.device, mma_layout: bool = False) -> tuple[tuple[int | None, str], ...]:
    """The active W4A16 table (:func:`active_table`) with every kernel that cannot run on ``device`` (or on the
    layer's layout: ``mma_layout`` for :class:`PackedMMA` weights) replaced by its counterpart."""
    has_triton = triton_reason(device) is None
    has_cuda = available()  # the extension checks its tensors' device itself
    if not (has_cuda or has_triton):
        raise RuntimeError(f"no W4A16 kernel can run on {device}: {unavailable_reason()}; {triton_reason(device)}")
    return _table_for(str(device), has_cuda, has_triton, mma_layout, tuple(active_table()))


def kernel_for(m: int, device: torch.device, mma_layout: bool = False) -> str:
    """The kernel name that runs ``m`` tokens on ``device`` (host-only: shapes and cached availability)."""
    return dispatch.pick(list(resolved_table(device, mma_layout)), m)


def wna16_gemm(x: torch.Tensor, packed: PackedWNA16, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, splits: int | None = None, path: str = "auto",
               config=None, pdl: bool | None = None) -> torch.Tensor:
    """``x @ W (+ bias)`` for ``x [..., K]`` fp16/bf16 and a repacked 4/8-bit weight. ``path``: ``auto``
    (``dispatch.WNA16_TABLE``), a table kernel name, or the older ``fused`` (CUDA GEMM) / ``dequant`` (CUDA
    dequantize + cuBLAS) / ``cuda`` (CUDA, fused up to :data:`LARGE_M_THRESHOLD` tokens) / ``triton`` (=
    ``triton-wna16``). ``splits`` applies to the CUDA GEMM, ``config`` (a ``WNA16Config``) to the Triton GEMM.
    ``pdl`` launches the CUDA GEMM with programmatic dependent launch (sm_90+; None: ``LQE_PDL``, see
    :func:`lqe.kernels.device_info.pdl_enabled`)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, packed.k)
    if x2.dtype != packed.scales.dtype:
        raise ValueError(f"activation dtype {x2.dtype} does not match the repacked weight's {packed.scales.dtype}")
    if packed.perm is not None:
        x2 = x2.index_select(1, packed.perm)  # act-order: gather x columns like the rows were permuted
    x2 = x2.contiguous()
    m = x2.shape[0]
    if isinstance(packed, PackedMMA):
        if pdl:
            raise ValueError("pdl=True applies to the CUDA GEMV (lqe-wna16-fused / lqe-wna16-ring), not to "
                             "lqe-w4a16-mma weights")
        return _mma_call(x2, packed, bias, out, path, splits).view(*lead, packed.n)
    name = {"fused": "lqe-wna16-fused", "ring": "lqe-wna16-ring", "dequant": "dequant+cublas",
            "triton": "triton-wna16"}.get(path, path)
    if name == "auto":
        name = kernel_for(m, x2.device)
    elif name == "cuda":
        name = "dequant+cublas" if m > LARGE_M_THRESHOLD else "lqe-wna16-fused"
    if pdl and name not in ("lqe-wna16-fused", "lqe-wna16-ring"):
        raise ValueError(f"pdl=True applies to the CUDA GEMV (lqe-wna16-fused / lqe-wna16-ring), not to {name!r} "
                         f"(M = {m}); the Triton kernels follow LQE_PDL (on by default on sm_90+)")
    if out is None:
        out = torch.empty(m, packed.n, dtype=x2.dtype, device=x2.device)
    if name in ("triton-wna16", "triton-wna16-swap"):  # swap: triton_wna16.SWAP_CONFIG_TABLE (W^T x^T, Hopper)
        from lqe.kernels import triton_wna16

        if config is None and name == "triton-wna16-swap":
            config = triton_wna16.pick_config(m, packed.n, packed.k, swap_ab=True)
        triton_wna16.gemm(x2, packed, bias, out, config)
    elif name in ("triton-dequant+cublas", "triton-dequant-l2+cublas"):  # l2: column chunks that fit in L2
        from lqe.kernels import triton_wna16

        chunk = triton_wna16.l2_chunk_cols(packed.k, packed.n, x2.device) if "-l2" in name else None
        triton_wna16.dequant_matmul(x2, packed, bias, out, chunk)
    elif name == "dequant+cublas":
        w = torch.empty(packed.k, packed.n, dtype=x2.dtype, device=x2.device)
        _ext().wna16_dequant(packed.qweight, packed.scales, packed.zeros, w, packed.bits, packed.group_size)
        torch.matmul(x2, w, out=out)
        if bias is not None:
            out.add_(bias)
    elif name in ("lqe-wna16-fused", "lqe-wna16-ring"):  # ring: the weights through a cp.async ring at M <= 16
        e = _ext()
        spp = plan_slabs_per_split(m, packed.n, packed.k, x2.device, 16, 4, splits)
        cnt = counters(x2.device, math.ceil(packed.n / BLOCK_N) * math.ceil(m / 16))
        # pdl: on sm_90+ unless LQE_PDL=0 (device_info.pdl_enabled), or a benchmark's explicit choice
        if pdl and not pdl_supported(x2.device):
            raise ValueError(f"pdl=True needs a CUDA device of compute capability 9.0 or later, not {x2.device}")
        e.wna16_gemm(x2, packed.qweight, packed.scales, packed.zeros, bias, out, packed.bits, packed.group_size,
                     spp, cnt, name == "lqe-wna16-ring", pdl_enabled(x2.device) if pdl is None else pdl)
    else:
        raise ValueError(f"unknown W4A16 path {path!r}")
    return out.view(*lead, packed.n)


def _mma_call(x2: torch.Tensor, p: PackedMMA, bias: torch.Tensor | None, out: torch.Tensor | None, path: str,
              sms: int | None) -> torch.Tensor:
    """The lqe-w4a16-mma layout: its GEMM (``sms`` stripes, default the SM count) or its dequantize + cuBLAS."""
    m = x2.shape[0]
    name = kernel_for(m, x2.device, mma_layout=True) if path == "auto" else path
    if out is None:
        out = torch.empty(m, p.n, dtype=x2.dtype, device=x2.device)
    if name in ("fused", "cuda", *gemm_mma.MMA_GEMM_NAMES):
        return gemm_mma.mma_gemm(_ext(), x2, p, bias, out, sms, gemm_mma.MMA_GEMM_NAMES.get(name, 1))
    if name in ("dequant", *gemm_mma.MMA_DEQUANT_NAMES):
        return gemm_mma.mma_dequant_matmul(_ext(), x2, p, bias, out)
    raise ValueError(f"W4A16 path {path!r} cannot run lqe-w4a16-mma weights: use 'auto', {gemm_mma.MMA_KERNEL!r}, "
                     f"{gemm_mma.MMA_K2_KERNEL!r} or 'lqe-w4a16-mma-dequant+cublas'")


def wna16_dequantize(packed: PackedWNA16, kernel: str = "cuda") -> torch.Tensor:
    """Dense ``[K, N]`` weights (sorted-K order) from the CUDA (``kernel="cuda"``) or Triton dequantize kernel;
    both are bit-identical. For :class:`PackedMMA` weights, the lqe-w4a16-mma dequantize."""
    if isinstance(packed, PackedMMA):
        return gemm_mma.mma_dequantize(_ext(), packed)
    if kernel == "triton":
        from lqe.kernels import triton_wna16

        return triton_wna16.dequantize(packed)
    w = torch.empty(packed.k, packed.n, dtype=packed.scales.dtype, device=packed.qweight.device)
    return _ext().wna16_dequant(packed.qweight, packed.scales, packed.zeros, w, packed.bits, packed.group_size)


w4a16_gemm = wna16_gemm  # the name the quant layers use; handles 8-bit weights too


@dataclass(slots=True)
class WNA16Kernel:
    """What :func:`select_w4a16_kernel` returns: call it as ``kernel(x, bias)``."""

    packed: PackedWNA16 | PackedMMA
    description: str

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return wna16_gemm(x, self.packed, bias)


def select_w4a16_kernel(canonical: CanonicalWeight, device: torch.device | str,
                        dtype: torch.dtype) -> tuple[WNA16Kernel | None, str]:
    """Repack ``canonical`` for the lqe CUDA kernel when it can run it: ``(kernel, description)``, else
    ``(None, reason)`` listing every reason (the caller falls back to dequantize + matmul)."""
    device = torch.device(device)
    reasons = []
    if device.type != "cuda":
        reasons.append(f"device is {device.type}, lqe-wna16 needs cuda")
    if dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"activation dtype {dtype} (lqe-wna16 needs float16 or bfloat16)")
    use_mma = table_uses_mma() and mma_unsupported(canonical) is None and device.type == "cuda" and available()
    if table_uses_mma() and not use_mma and device.type == "cuda":  # asked for, not given: say so, once per reason
        why = mma_unsupported(canonical) or unavailable_reason() or "the lqe CUDA extension is not available"
        if why not in _MMA_DECLINED:
            _MMA_DECLINED.add(why)
            log.warning("the W4A16 table names lqe-w4a16-mma, but layers run the lqe-wna16 layout instead: %s", why)
    shape_reason = None if use_mma else wna16_unsupported(canonical)
    if shape_reason:
        reasons.append(shape_reason)
    if device.type == "cuda" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 0):
            reasons.append(f"compute capability {cap[0]}.{cap[1]} < 8.0 (mma.sync bf16 needs Ampere+)")
    if not reasons and not available() and triton_reason(device) is not None:
        why_triton = f"; triton-wna16: {triton_reason(device)}" if torch.cuda.is_available() else ""
        reasons.append(f"{_state.get('error')}{why_triton}")
    if reasons:
        return None, "lqe-wna16 unavailable: " + "; ".join(reasons)
    if use_mma:
        packed = repack_mma(_to_device(canonical, device), dtype)
        gemm_mma.reserve_workspace(device, packed.n_pad, packed.k_pad)  # at load: nothing allocated per call
    else:
        packed = repack_wna16(_to_device(canonical, device), dtype)
    k, n = canonical.shape
    table = ", ".join(f"{'M<=' + str(mx) if mx is not None else 'above'}: {name}"
                      for mx, name in resolved_table(device, use_mma))
    desc = (f"{'lqe-w4a16-mma' if use_mma else 'lqe-wna16'} (bits={canonical.bits}, group_size={canonical.group_size}, "
            f"{'asym' if canonical.zeros is not None else 'sym'}{', act-order' if packed.perm is not None else ''}, "
            f"K={k}, N={n}; {table})")
    return WNA16Kernel(packed, desc), desc


def _to_device(cw: CanonicalWeight, device: torch.device) -> CanonicalWeight:
    mv = lambda t: None if t is None else t.to(device)  # noqa: E731
    return CanonicalWeight(mv(cw.codes), mv(cw.scales), mv(cw.zeros), mv(cw.g_idx), cw.bits, cw.group_size)
