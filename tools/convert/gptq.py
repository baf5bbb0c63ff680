"""GPTQ for one linear layer (Frantar et al. 2022), written from the paper's algorithm: quantize input columns
one at a time, spreading each column's error over the not-yet-quantized columns through the inverse Hessian
``H = X^T X`` of the layer's calibration inputs (Cholesky form, lazy block updates). Supports damping,
act-order (columns by decreasing ``diag(H)``; groups formed in that order, recorded in ``g_idx``) and static
groups (group parameters fixed up front on the original column order, trivial ``g_idx``).

Group parameters use :func:`lqe.quant_layers.reference.rtn_quantize` (the engine's RTN conventions), with the
scale rounded to the storage dtype first, so the error feedback sees exactly the stored weights.
"""
from __future__ import annotations

import torch

from lqe.quant_layers.canonical import CanonicalWeight, build_canonical
from lqe.quant_layers.reference import num_groups, rtn_quantize


class HessianAccumulator:
    """Running ``sum x^T x`` over calibration tokens of one linear's input; with the float model's input ``x_fp`` of
    the same tokens also ``sum (x_fp - x)^T x``, the drift of the quantized stream (see :func:`drift_target`)."""

    def __init__(self, k: int) -> None:
        self.h = torch.zeros(k, k, dtype=torch.float32)
        self.d: torch.Tensor | None = None
        self.count = 0

    def add(self, x: torch.Tensor, x_fp: torch.Tensor | None = None) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.h.addmm_(x.t(), x)  # fp32 products, summed per batch (a few thousand tokens each)
        if x_fp is not None:
            if self.d is None:
                self.d = torch.zeros_like(self.h)
            self.d.addmm_((x_fp.reshape(-1, x.shape[-1]).float() - x).t(), x)
        self.count += x.shape[0]

    def hessian(self) -> torch.Tensor:
        return (2.0 / max(self.count, 1)) * self.h.double()

    def drift(self) -> torch.Tensor | None:
        return None if self.d is None else (2.0 / max(self.count, 1)) * self.d.double()


def drift_target(weight: torch.Tensor, hessian: torch.Tensor, drift: torch.Tensor, alpha: float,
                 damp: float = 0.01) -> torch.Tensor:
    """The weight GPTQ should reproduce when its inputs ``x`` (quantized model) differ from the float model's
    ``x_fp``: ``min_Q sum |Q x - W x_fp|^2`` equals ``sum |(Q - W*) x|^2`` plus a constant, with the least-squares
    ``W* = W + W D H^-1`` (``D = sum (x_fp - x) x^T``, ``H = sum x x^T``, damped as GPTQ damps it). ``alpha``
    scales the correction (1 = the full least-squares target; less trusts a small calibration set less)."""
    h = hessian.double().clone()
    h += damp * torch.mean(torch.diag(h)) * torch.eye(h.shape[0], dtype=h.dtype)
    corr = torch.linalg.solve(h, drift.double().t()).t()  # D H^-1 (H symmetric)
    w = weight.detach().double()
    return (w + alpha * (w @ corr)).to(weight.dtype)


MSE_SHRINKS = torch.linspace(1.0, 0.7, 16).tolist()  # range factors tried by the clipping search
MSE_NORM = 2.4  # error norm of the clipping search (the value GPTQ's reference quantizer uses)


def _group_params(w_cols: torch.Tensor, bits: int, sym: bool, scale_dtype: torch.dtype,
                  mse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """scale [N], zero [N] (float) for the columns ``w_cols [N, g]`` of one group.

    With ``mse``, each output row's range is shrunk by the factor (from ``MSE_SHRINKS``) that minimises
    ``sum |w - dequant(quant(w))|^2.4`` over the group: clipping a few outliers buys resolution for the rest."""
    best_scale = best_zero = best_err = None
    maxq = (1 << bits) - 1
    for shrink in (MSE_SHRINKS if mse else [1.0]):
        cw = rtn_quantize(w_cols * shrink, bits, -1, sym)
        scale, zero = cw.scales[0].to(scale_dtype).float(), cw.zero_points()[0]
        if not mse:
            return scale, zero
        q = torch.clamp(torch.round(w_cols / scale[:, None]) + zero[:, None], 0, maxq)
        err = ((q - zero[:, None]) * scale[:, None] - w_cols).abs().pow(MSE_NORM).sum(1)
        if best_err is None:
            best_scale, best_zero, best_err = scale, zero, err
        else:
            better = err < best_err
            best_scale = torch.where(better, scale, best_scale)
            best_zero = torch.where(better, zero, best_zero)
            best_err = torch.minimum(err, best_err)
    return best_scale, best_zero


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, sym: bool,
                  damp: float = 0.01, act_order: bool = False, static_groups: bool = False, block_size: int = 128,
                  scale_dtype: torch.dtype = torch.float16, mse: bool = False) -> CanonicalWeight:
    """Torch-layout ``weight [N, K]`` + ``hessian [K, K]`` -> CanonicalWeight (``g_idx`` set for act-order)."""
    w = weight.detach().float().clone()
    n, k = w.shape
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    g = k if group_size == -1 else group_size
    maxq = (1 << bits) - 1
    static: list[tuple[torch.Tensor, torch.Tensor]] = []
    if static_groups:
        static = [_group_params(w[:, i:i + g], bits, sym, scale_dtype, mse) for i in range(0, k, g)]
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    codes = torch.zeros(n, k, dtype=torch.uint8)
    ng = num_groups(k, group_size)
    scales = torch.ones(ng, n)
    zeros = torch.zeros(ng, n)
    scale = zero = None
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if static_groups:
                gid = int(perm[col]) // g
                scale, zero = static[gid]
                scales[gid], zeros[gid] = scale, zero
            elif col % g == 0:
                cols = torch.cat([w1[:, i:], w[:, i2:]], dim=1)[:, :g]
                scale, zero = _group_params(cols, bits, sym, scale_dtype, mse)
                scales[col // g], zeros[col // g] = scale, zero
            x = w1[:, i]
            q = torch.clamp(torch.round(x / scale) + zero, 0, maxq)
            codes[:, col] = q.to(torch.uint8)
            e = (x - scale * (q - zero)) / hinv1[i, i]
            w1[:, i:] -= e.unsqueeze(1) @ hinv1[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    inv = torch.argsort(perm)
    codes = codes[:, inv].t().contiguous()  # [K, N] in original column order
    if static_groups or not act_order:
        g_idx = None
    else:
        g_idx = (inv // g).to(torch.int32)  # column c sat at position inv[c] of the quantization order
    return build_canonical(codes, scales, None if sym else zeros.round().to(torch.uint8), g_idx, bits, group_size)
