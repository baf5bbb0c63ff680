"""Recover the quantization grid of fake-quantized float weights exactly, per group and output channel.

A fake-quantized group holds values ``s * (q - z)`` with integer codes, so every value is an integer multiple of
the scale ``s``. With ``a`` the largest magnitude in the group, ``s = a / m`` for some integer ``m``; the smallest
``m`` for which all values are integer multiples within the code range gives the largest consistent scale (any
consistent scale decodes to the same weights). Candidates whose scale survives rounding to the storage dtype
exactly are preferred. The zero point is then any integer keeping codes in range (``2^(b-1)`` when possible,
never 0 unless forced). All-zero groups get scale 1 and codes = zero.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lqe.kernels.canonical import CanonicalWeight, build_canonical
from lqe.quant_layers.reference import num_groups

CODE_TOL = 1e-3  # allowed distance from an integer code, in units of the scale (fp32 sources)


@dataclass(slots=True)
class GridFit:
    cw: CanonicalWeight | None
    max_dev: float  # largest |w - dequant| over the layer (for an off-grid layer: of the best candidate fit)
    bad_columns: int  # (group, channel) pairs that are on no grid


def _code_tol(dtype: torch.dtype, m_max: int) -> float:
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return min(0.25, max(CODE_TOL, 4 * eps * m_max))


def _candidate(v, safe, m, bits, sym, scale_dtype, tol):
    """Try ``s = amax / m`` per column (``m`` a scalar or ``[N]``): (s, offsets, ok, ok in the storage dtype, dev)."""
    half, maxq = 1 << (bits - 1), (1 << bits) - 1
    s = safe / m
    t = v / s
    r = t.round()
    dev = (v - r * s).abs().amax(0)
    in_range = ((r.amin(0) >= -half) & (r.amax(0) <= half - 1)) if sym else (r.amax(0) - r.amin(0) <= maxq)
    ok = ((t - r).abs().amax(0) <= tol) & in_range
    s_store = s.to(scale_dtype).double()
    ok_exact = ok & ((v - r * s_store).abs().amax(0) <= 1e-6 * safe)
    return torch.where(ok_exact, s_store, s), r.long(), ok, ok_exact, dev


def fit_group(v: torch.Tensor, bits: int, sym: bool, scale_dtype: torch.dtype, tol: float):
    """``v [r, N]`` float64 -> (scale [N], signed offsets q - z [r, N] int64, ok [N] bool, dev [N])."""
    maxq, half = (1 << bits) - 1, 1 << (bits - 1)
    amax = v.abs().amax(0)
    zero = amax == 0  # all-zero columns: any scale, offsets 0
    safe = torch.where(zero, torch.ones_like(amax), amax)
    # first guess: the smallest gap between distinct values is usually one scale step
    sv = v.sort(0).values
    gaps = sv[1:] - sv[:-1] if v.shape[0] > 1 else safe.unsqueeze(0)
    gaps = torch.where(gaps > 1e-3 * safe, gaps, torch.full_like(gaps, float("inf"))).amin(0)
    m0 = torch.where(torch.isfinite(gaps), (safe / gaps).round().clamp(1, maxq), torch.ones_like(safe))
    scale, offs, found, exact, best_dev = _candidate(v, safe, m0, bits, sym, scale_dtype, tol)
    found, exact = found | zero, exact | zero
    scale = torch.where(zero, torch.ones_like(scale), scale)
    offs = torch.where(zero.unsqueeze(0), torch.zeros_like(offs), offs)
    best_dev = torch.where(zero | found, torch.where(zero, torch.zeros_like(best_dev), best_dev), torch.full_like(best_dev, float("inf")))
    for m in range(1, (half if sym else maxq) + 1):
        todo = (~exact).nonzero().flatten()
        if todo.numel() == 0:
            break
        s, r, ok, ok_exact, dev = _candidate(v[:, todo], safe[todo], m, bits, sym, scale_dtype, tol)
        # take the first exact candidate; else keep the first valid one until an exact one turns up
        take = ok_exact | (ok & ~found[todo])
        cols = todo[take]
        scale[cols], offs[:, cols] = s[take], r[:, take]
        best_dev[todo] = torch.where(take, dev, torch.where(found[todo], best_dev[todo], torch.minimum(best_dev[todo], dev)))
        found[todo] |= ok
        exact[todo] |= ok_exact
        if bool(found.all()) and m > 2 * half and not bool(exact.all()):
            break  # every column fits; the rest only differ in the dtype rounding of the scale
    return scale, offs, found, best_dev


def recover_grid(weight: torch.Tensor, bits: int, group_size: int, sym: bool, g_idx: torch.Tensor | None = None,
                 scale_dtype: torch.dtype = torch.float16) -> GridFit:
    """Torch-layout fake-quantized ``weight [N, K]`` -> its exact CanonicalWeight (or the deviation if off-grid)."""
    w = weight.detach().double().t()  # [K, N]
    k, n = w.shape
    g = num_groups(k, group_size)
    gi = g_idx.long() if g_idx is not None else torch.arange(k) // (k if group_size == -1 else group_size)
    maxq, half = (1 << bits) - 1, 1 << (bits - 1)
    tol = _code_tol(weight.dtype, half if sym else maxq)
    scales = torch.ones(g, n, dtype=torch.float64)
    zeros = torch.full((g, n), half, dtype=torch.int64)
    codes = torch.zeros(k, n, dtype=torch.int64)
    bad, worst = 0, 0.0
    for grp in range(g):
        rows = (gi == grp).nonzero().flatten()
        if rows.numel() == 0:
            continue
        s, offs, ok, dev = fit_group(w[rows], bits, sym, scale_dtype, tol)
        bad += int((~ok).sum())
        worst = max(worst, float(dev.max()))
        scales[grp] = s
        if not sym:
            lo = (-offs.amin(0)).clamp(min=0)
            hi = (maxq - offs.amax(0)).clamp(max=maxq)
            zeros[grp] = torch.maximum(lo, torch.minimum(hi, torch.full_like(lo, half)))
        codes[rows] = (offs + zeros[grp]).clamp(0, maxq)
    if bad:
        return GridFit(None, worst, bad)
    cw = build_canonical(codes.to(torch.uint8), scales.float(), None if sym else zeros.to(torch.uint8),
                         None if g_idx is None else g_idx.to(torch.int32), bits, group_size)
    return GridFit(cw, worst, 0)
