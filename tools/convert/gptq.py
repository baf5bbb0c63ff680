"""GPTQ for one linear layer (Frantar et al. 2022), written from the paper's algorithm: quantize input columns
one at a time, spreading each column's error over the not-yet-quantized columns through the inverse Hessian
``H = X^T X`` of the layer's calibration inputs (Cholesky form, lazy block updates). Supports damping,
act-order (columns by decreasing ``diag(H)``; groups formed in that order, recorded in ``g_idx``) and static
groups (group parameters fixed up front on the original column order, trivial ``g_idx``).

Group parameters use :func:`lqe.quant_layers.reference.rtn_quantize` (the engine's RTN conventions), with the
scale rounded to the storage dtype first, so the error feedback sees exactly the stored weights.
"""
from __future__ import annotations

import logging

import torch

from lqe.kernels.canonical import CanonicalWeight, build_canonical
from lqe.quant_layers.reference import num_groups, rtn_quantize

logger = logging.getLogger("lqe.convert")


class HessianAccumulator:
    """Running ``sum x^T x`` over calibration tokens of one linear's input; with the float model's input ``x_fp`` of
    the same tokens also ``sum (x_fp - x)^T x``, the drift of the quantized stream (see :func:`drift_target`). The sums
    live in fp32 on ``device``, by default that of the first input. :meth:`hessian` / :meth:`drift` end the sums: the
    float64 results are kept (the same tensor on every call) and the fp32 sums freed."""

    def __init__(self, k: int, device: torch.device | str | None = None) -> None:
        self.k = k
        self.h: torch.Tensor | None = None if device is None else torch.zeros(k, k, dtype=torch.float32, device=device)
        self.d: torch.Tensor | None = None
        self.count = 0
        self._hessian: torch.Tensor | None = None
        self._drift: torch.Tensor | None = None

    def add(self, x: torch.Tensor, x_fp: torch.Tensor | None = None) -> None:
        if self._hessian is not None or self._drift is not None:
            raise RuntimeError("HessianAccumulator.add after hessian()/drift(): the sums are closed")
        x = x.reshape(-1, x.shape[-1]).float()
        if self.h is None:
            self.h = torch.zeros(self.k, self.k, dtype=torch.float32, device=x.device)
        self.h.addmm_(x.t(), x)  # fp32 products, summed per batch (a few thousand tokens each)
        if x_fp is not None:
            if self.d is None:
                self.d = torch.zeros_like(self.h)
            self.d.addmm_((x_fp.reshape(-1, x.shape[-1]).float() - x).t(), x)
        self.count += x.shape[0]

    def hessian(self) -> torch.Tensor:
        if self._hessian is None:
            h, self.h = self.h, None
            self._hessian = torch.zeros(self.k, self.k, dtype=torch.float64) if h is None else self._scaled(h)
        return self._hessian

    def drift(self) -> torch.Tensor | None:
        if self._drift is None and self.d is not None:
            d, self.d = self.d, None
            self._drift = self._scaled(d)
        return self._drift

    def _scaled(self, s: torch.Tensor) -> torch.Tensor:
        """``2 / count * s`` in float64, scaled in place: the fp32 sum and one float64 matrix alive at a time (the
        out-of-place product would hold a second float64 one: 3.8 GiB instead of 2.3 for Llama-3-8B's down_proj)."""
        out = s.double()
        del s  # (the caller dropped its reference: the fp32 sum goes now)
        return out.mul_(2.0 / max(self.count, 1))


def drift_target(weight: torch.Tensor, hessian: torch.Tensor, drift: torch.Tensor, alpha: float,
                 damp: float = 0.01) -> torch.Tensor:
    """The weight GPTQ should reproduce when its inputs ``x`` (quantized model) differ from the float model's
    ``x_fp``: ``min_Q sum |Q x - W x_fp|^2`` equals ``sum |(Q - W*) x|^2`` plus a constant, with the least-squares
    ``W* = W + W D H^-1`` (``D = sum (x_fp - x) x^T``, ``H = sum x x^T``, damped as GPTQ damps it). ``alpha``
    scales the correction (1 = the full least-squares target; less trusts a small calibration set less)."""
    h = hessian.to(device=weight.device, dtype=torch.float64).clone()
    h.diagonal().add_(damp * torch.mean(torch.diag(h)))  # = h + damp * mean(diag) * I, without an identity matrix
    corr = torch.linalg.solve(h, drift.to(device=weight.device, dtype=torch.float64).t()).t()  # D H^-1 (H symmetric)
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


DAMP_RETRIES = 4  # a Hessian that is not positive definite once damped: tried again with 10x the damping, this often


def _inverse_upper_factor(damped, damp: float, k: int) -> torch.Tensor:
    """The upper Cholesky factor of ``H^-1`` for ``H = damped(damp)``, float64 (GPTQ's ``Hinv``). When ``H`` is not
    positive definite (a rank-deficient or numerically indefinite Hessian: a Cholesky step fails), it warns and tries
    again with ten times the damping (0.01 from none), up to :data:`DAMP_RETRIES` times; the first attempt is the
    plain computation, so a Hessian that factors gives the same bits as without retries. K x K float64 matrices
    alive at once: two (H and its factor; the factor inverted in place and cuSOLVER's copy; the inverse and its upper
    factor)."""
    d = damp
    for attempt in range(DAMP_RETRIES + 1):
        h = damped(d)
        hinv, info = torch.linalg.cholesky_ex(h)
        del h  # each K x K float64 step frees the one before it
        failed = "H"
        if not info.item():
            torch.cholesky_inverse(hinv, out=hinv)  # in place: the factor is column-major, which out= uses as it is
            upper, info = torch.linalg.cholesky_ex(hinv, upper=True)
            del hinv
            if not info.item():
                return upper
            del upper
            failed = "H^-1"
        else:
            del hinv
        nxt = d * 10 if d > 0 else 0.01
        if attempt == DAMP_RETRIES:
            raise torch.linalg.LinAlgError(
                f"GPTQ: the damped Hessian is not positive definite (Cholesky of {failed} failed) with damping "
                f"{damp:g} to {d:g} x mean(diag(H)); the layer's calibration inputs may hold inf / NaN")
        logger.warning("GPTQ: the Hessian (K=%d) damped by %g x mean(diag) is not positive definite (Cholesky of %s "
                       "failed): trying again with %g", k, d, failed, nxt)
        d = nxt
    raise AssertionError("not reached")


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, sym: bool,
                  damp: float = 0.01, act_order: bool = False, static_groups: bool = False, block_size: int = 128,
                  scale_dtype: torch.dtype = torch.float16, mse: bool = False) -> CanonicalWeight:
    """Torch-layout ``weight [N, K]`` + ``hessian [K, K]`` -> CanonicalWeight (``g_idx`` set for act-order)."""
    w = weight.detach().float().clone()
    n, k = w.shape
    dev = w.device
    hessian = hessian.to(device=dev, dtype=torch.float64)  # (the caller's tensor when it is already that: read only)
    diag = torch.diag(hessian)
    dead = diag == 0
    w[:, dead] = 0
    g = k if group_size == -1 else group_size
    maxq = (1 << bits) - 1
    static: list[tuple[torch.Tensor, torch.Tensor]] = []
    if static_groups:
        static = [_group_params(w[:, i:i + g], bits, sym, scale_dtype, mse) for i in range(0, k, g)]
    # K x K float64 matrices alive beside the caller's H: two at most (the working copy of H and its factor; the
    # factor inverted in place and cuSOLVER's working copy of it; the inverse and its upper factor)
    if act_order:
        perm = torch.argsort(torch.where(dead, 1.0, diag), descending=True)  # a dead column's diagonal counts as 1
        w = w[:, perm]
    else:
        perm = torch.arange(k, device=dev)
    del diag

    def damped(d: float) -> torch.Tensor:  # H (permuted, dead columns' diagonal 1) + d * mean(diag) * I
        if act_order:  # one gather of H's rows and columns in the new order: no unpermuted copy first
            h = hessian[perm[:, None], perm[None, :]]
            h.diagonal()[dead[perm]] = 1
        else:
            h = hessian.clone()
            h.diagonal()[dead] = 1
        h.diagonal().add_(d * torch.mean(torch.diag(h)))  # without an identity matrix
        return h

    perm_cols = perm.tolist() if static_groups else []
    upper = _inverse_upper_factor(damped, damp, k)
    hinv = upper.float()
    del upper
    codes = torch.zeros(n, k, dtype=torch.uint8, device=dev)
    ng = num_groups(k, group_size)
    scales = torch.ones(ng, n, device=dev)
    zeros = torch.zeros(ng, n, device=dev)
    scale = zero = None
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if static_groups:
                gid = perm_cols[col] // g
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
