"""Closed-form refit of a quantized layer's group scales (and zero points) with its integer codes fixed.

GPTQ picks each group's scale before it rounds the group's columns, from the weights as they are at that moment;
once every code is chosen, other scales fit better. With codes ``q`` and zeros ``z`` fixed, the dequantized row
``w~_n = sum_g s_gn a_gn`` (``a_gn[k] = (q_kn - z_gn) [k in g]``) is linear in the scales, so the scales that
minimize the layer's output error on the calibration inputs, ``(w~_n - w_n) H (w~_n - w_n)^T`` with ``H = X^T X``,
solve one ``G x G`` system per output row: ``(A_n^T H A_n) s_n = A_n^T H w_n``. With ``zeros`` (asymmetric
layers) the ``2G`` system in ``(s, s z)`` is solved first, the zero points rounded to integers in range, and the
scales refitted for them. Scales are rounded to the storage dtype, and a row keeps its old parameters unless the
new ones lower its error: the refit never makes a layer's Hessian-weighted error worse.

:func:`refine_codes` alternates that refit with passes of cyclic coordinate descent over the codes (QuantEase,
Behdin et al. 2023, written from the paper): with every other weight fixed, the error is a parabola in ``w~_k``
with curvature ``H_kk``, so the best code of column ``k`` is the one nearest to ``w~_k - R_k / H_kk`` where
``R = (w~ - w) H``; each step, and so each pass, can only lower the error. GPTQ's answer is the starting point.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from lqe.kernels.canonical import CanonicalWeight, build_canonical


@dataclass(slots=True)
class RefitReport:
    before: float  # sum over rows of (w~ - w) H (w~ - w)^T
    after: float
    rows_changed: int


@contextmanager
def loop_threads(device: torch.device) -> Iterator[None]:
    """One intra-op thread on the CPU around loops of small per-column ops: with two threads such loops run 5-30x
    slower as soon as another process shares the cores (measured on 2 cores), and about as fast when none does."""
    n = torch.get_num_threads()
    if device.type != "cpu" or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def row_errors(w_hat: torch.Tensor, weight: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """``[N]`` Hessian-weighted error of each output row (torch layout ``[N, K]`` weights)."""
    e = (w_hat.double() - weight.double())
    return ((e @ hessian.double()) * e).sum(1)


def _normal_equations(basis: list[torch.Tensor], gi: torch.Tensor, n_groups: int, h: torch.Tensor,
                      hw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For per-row basis matrices ``basis[j] [N, K]`` (column k of parameter ``(j, g)`` is ``basis[j][:, k]`` where
    ``gi[k] == g``, zero elsewhere): ``M [N, P, P]`` and ``r [N, P]`` with ``P = len(basis) * n_groups``."""
    n = hw.shape[0]
    p = len(basis) * n_groups
    m = torch.zeros(n, p, p, dtype=torch.float64, device=hw.device)
    members = [(gi == g).nonzero().flatten() for g in range(n_groups)]
    for j, bj in enumerate(basis):
        for g, idx in enumerate(members):
            if idx.numel() == 0:
                continue
            proj = bj[:, idx] @ h[idx, :]  # [N, K]: row n of (A_n column (j, g))^T H
            for l, bl in enumerate(basis):
                row = torch.zeros(n, n_groups, dtype=torch.float64, device=hw.device).index_add_(1, gi, proj * bl)
                m[:, j * n_groups + g, l * n_groups:(l + 1) * n_groups] = row
    r = torch.cat([torch.zeros(n, n_groups, dtype=torch.float64, device=hw.device).index_add_(1, gi, bj * hw)
                   for bj in basis], dim=1)
    return m, r


def _solve(m: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    diag = torch.diagonal(m, dim1=-2, dim2=-1)
    ridge = 1e-9 * diag.abs().mean(-1, keepdim=True).clamp_min(1e-30) + (diag == 0) * 1.0
    m = m + torch.diag_embed(ridge.expand_as(diag))
    return torch.linalg.solve(m, r.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def refit_scales(cw: CanonicalWeight, weight: torch.Tensor, hessian: torch.Tensor,
                 scale_dtype: torch.dtype = torch.float16, zeros: bool = False) -> tuple[CanonicalWeight, RefitReport]:
    """``cw`` with refitted scales (and zero points with ``zeros``, asymmetric only) for the target ``weight
    [N, K]`` (torch layout) under ``hessian [K, K]``; codes and ``g_idx`` are unchanged."""
    maxq = (1 << cw.bits) - 1
    h = hessian.double()
    w = weight.detach().double()
    gi = cw.group_index()
    n_groups = cw.scales.shape[0]
    codes = cw.codes.t().double()  # [N, K]
    z_old = cw.zero_points().double()  # [G, N]
    s_old = cw.scales.double()
    hw = w @ h  # [N, K] (H symmetric)
    err_old = row_errors(cw.dequantize().t(), w, h)

    def scales_for(z: torch.Tensor) -> torch.Tensor:
        m, r = _normal_equations([codes - z.t()[:, gi]], gi, n_groups, h, hw)
        s = _solve(m, r).t()  # [G, N]
        return torch.where(s > 0, s, s_old).to(scale_dtype).double().clamp_min(torch.finfo(scale_dtype).tiny)

    z_new = z_old
    if zeros and cw.zeros is not None:
        ones = torch.ones_like(codes)
        m, r = _normal_equations([codes, -ones], gi, n_groups, h, hw)
        sol = _solve(m, r)
        s, t = sol[:, :n_groups].t(), sol[:, n_groups:].t()
        z = torch.where(s > 0, t / s.clamp_min(1e-30), z_old).round()
        lo = torch.where(z_old >= 1, 1.0, 0.0)  # GPTQ v1 cannot store a zero point of 0: never introduce one
        z_new = torch.minimum(torch.maximum(z, lo), torch.full_like(z, maxq))
    s_new = scales_for(z_new)
    cand = build_canonical(cw.codes, s_new.float(), None if cw.zeros is None else z_new.to(torch.uint8),
                           cw.g_idx, cw.bits, cw.group_size)
    err_new = row_errors(cand.dequantize().t(), w, h)
    better = err_new < err_old
    scales = torch.where(better[None, :], s_new, s_old).float()
    zs = None if cw.zeros is None else torch.where(better[None, :], z_new, z_old).to(torch.uint8)
    out = build_canonical(cw.codes, scales, zs, cw.g_idx, cw.bits, cw.group_size)
    report = RefitReport(float(err_old.sum()), float(torch.minimum(err_new, err_old).sum()), int(better.sum()))
    return out, report


def _coordinate_pass(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, w: torch.Tensor, h: torch.Tensor,
                     maxq: int, block: int = 128) -> int:
    """One cyclic pass over the rows of ``codes [K, N]`` (math layout, float, updated in place) for per-element
    ``scale`` and ``zero`` ``[K, N]`` and target ``w [K, N]``; lazy block updates of ``R = H (w~ - w)`` as in GPTQ.
    Returns the number of codes changed.

    The column loop never reads a value back to the host (on a GPU it is launch-bound, and a sync per column would
    drain the launch queue K times per pass): a column none of whose codes moves is updated by zeros, which leaves
    every value as it was (``w~_k`` is exactly ``s (c - z)`` when ``d = 0``, so ``q = c``)."""
    k_all = codes.shape[0]
    w_hat = scale * (codes - zero)
    r = h @ (w_hat - w)
    diag = torch.diagonal(h).clamp_min(1e-30)
    changed = torch.zeros((), dtype=torch.int64, device=codes.device)
    for i1 in range(0, k_all, block):
        i2 = min(i1 + block, k_all)
        rb = r[i1:i2].clone()
        hb = h[i1:i2, i1:i2]
        deltas = torch.empty_like(rb)
        for j in range(i2 - i1):
            k = i1 + j
            s, z = scale[k], zero[k]
            q = torch.clamp(torch.round((w_hat[k] - rb[j] / diag[k]) / s) + z, 0, maxq)
            d = torch.sub(s * (q - z), w_hat[k], out=deltas[j])
            changed += torch.count_nonzero(d)
            codes[k] = q
            w_hat[k] += d
            rb.addr_(hb[:, j], d)
        r.addmm_(h[:, i1:i2], deltas)
    return int(changed)


@torch.no_grad()
def refine_codes(cw: CanonicalWeight, weight: torch.Tensor, hessian: torch.Tensor, passes: int = 2,
                 scale_dtype: torch.dtype = torch.float16, damp: float = 0.01) -> tuple[CanonicalWeight, RefitReport]:
    """``passes`` rounds of (coordinate descent over the codes, then :func:`refit_scales`) on the damped Hessian
    ``H + damp * mean(diag H) I`` (the objective GPTQ minimizes); ``cw``'s grid (scales, zeros, ``g_idx``) is the start.
    The reported errors are on that damped Hessian."""
    h = hessian.double().clone()
    h.diagonal().add_(damp * torch.mean(torch.diagonal(h)))
    w = weight.detach().double()
    maxq = (1 << cw.bits) - 1
    before = float(row_errors(cw.dequantize().t(), w, h).sum())
    gi = cw.group_index()
    w32, h32 = w.t().float().contiguous(), h.float()
    changed = 0
    for _ in range(passes):
        scale = cw.scales.float()[gi]  # [K, N]
        zero = cw.zero_points().float()[gi]
        codes = cw.codes.float()
        with loop_threads(codes.device):
            changed += _coordinate_pass(codes, scale, zero, w32, h32, maxq)
        cw = build_canonical(codes.to(torch.uint8), cw.scales, cw.zeros, cw.g_idx, cw.bits, cw.group_size)
        cw, _ = refit_scales(cw, w, h, scale_dtype)
    after = float(row_errors(cw.dequantize().t(), w, h).sum())
    return cw, RefitReport(before, after, changed)
