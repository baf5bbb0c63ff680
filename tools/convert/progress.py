"""What the calibration progress bar shows per decoder layer: the relative error of the calibrated layer's output
(:class:`LayerErrorProbe`), or for RTN, which has no calibration inputs, of its weights (:func:`weight_error`)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from lqe.kernels.canonical import CanonicalWeight
from tools.convert.blocks import BlockRunner, slice_batch


@contextmanager
def hooks_suspended(module: nn.Module) -> Iterator[None]:
    """The forward (pre-)hooks of ``module`` and its submodules switched off inside."""
    saved = [(m, m._forward_pre_hooks, m._forward_hooks) for m in module.modules()]
    for m, _, _ in saved:
        m._forward_pre_hooks, m._forward_hooks = type(m._forward_pre_hooks)(), type(m._forward_hooks)()
    try:
        yield
    finally:
        for m, pre, post in saved:
            m._forward_pre_hooks, m._forward_hooks = pre, post


def _out(y):
    return y[0] if isinstance(y, tuple) else y


class LayerErrorProbe:
    """Relative error of one decoder layer's update on its first calibration sequences (up to ``tokens`` tokens):
    ``|y_q - y_f|^2 / |y_f - x|^2`` with ``x`` the layer's input (the quantized stream), ``y_f`` the float layer's
    output, taken when the runner first runs the layer (after any transform, before quantization), and ``y_q`` the
    calibrated layer's output, read from the runner once the loop body has advanced it: what the progress bar
    shows."""

    def __init__(self, runner: BlockRunner, tokens: int = 4096) -> None:
        self.runner, self.tokens = runner, tokens
        self.steps = runner.steps
        self.x = self.y = None
        runner.before_next_run(self._reference)

    def _reference(self, layer: nn.Module) -> None:
        x = self.runner.inputs[0]
        self.m = max(1, min(x.shape[0], self.tokens // max(1, x.shape[1] if x.dim() == 3 else 1)))
        self.x = x[:self.m].to(self.runner.device, copy=True)
        with torch.no_grad(), hooks_suspended(layer):  # the method's statistics hooks must not see this forward
            self.y = _out(layer(self.x, **slice_batch(self.runner.kwargs[0], self.m, x.shape[0])))

    def error(self) -> float | None:
        if self.y is None or self.runner.steps == self.steps:  # no reference, or no calibrated outputs to compare
            return None
        y_q = self.runner.inputs[0][:self.m].to(self.y.device)
        den = float(((self.y.float() - self.x.float()) ** 2).sum())
        return float(((y_q.float() - self.y.float()) ** 2).sum()) / max(den, 1e-30)


def weight_error(layer: nn.Module, prefix: str, canon: dict[str, CanonicalWeight]) -> float | None:
    """Mean over the layer's quantized linears of ``|W - Q|^2 / |W|^2``, ``W`` the layer's (float) weights: the progress
    figure of RTN, which has no calibration inputs."""
    errs = []
    for name, mod in layer.named_modules():
        cw = canon.get(prefix + name)
        if cw is not None and isinstance(mod, nn.Linear) and not mod.weight.is_meta:
            w = mod.weight.float()
            errs.append(float(((cw.dequantize().t() - w) ** 2).sum()) / max(float((w ** 2).sum()), 1e-30))
    return sum(errs) / len(errs) if errs else None
