"""AWQ (Lin et al. 2023), written from the paper: for each group of linears sharing an input, search a
per-input-channel scale ``s`` over a grid of exponents ``alpha`` that minimizes the error of the block those
linears feed when they hold the RTN-quantized ``W * s`` applied to ``x / s``; fold ``1/s`` into the previous op
(the RMSNorm weight, or the previous linear's output rows), keep ``W * s``.

The error is measured on the output of the module the linears belong to (the whole attention for q/k/v, the
whole MLP for gate/up, the linear itself for o_proj and down_proj), so an error that attention or the SiLU gate
damps counts less than one they amplify. ``s = mean|x|^alpha`` (the paper's form) or, with ``duo``,
``mean|x|^alpha / mean|w~|^(1-alpha)`` where ``w~`` is the weight normalized by its group's max (the form
AutoAWQ searches by default). ``s = 1`` (plain RTN) is always a candidate, so the search never makes the
calibration error worse. Optional clipping search (``--awq-clip``): shrink each group's range by the ratio that
minimizes that group's output error."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from tools.convert.rtn import fake_quant

# (previous op, linears reading its output, module whose output the loss compares) in a Llama/Qwen decoder layer
AWQ_MAPPINGS = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
                ("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
                ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
                ("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"))
NO_CLIP = ("q_proj", "k_proj")  # attention logits are sensitive to clipping (as AutoAWQ does)

Loss = Callable[[list[torch.Tensor]], float]


def linear_loss(x: torch.Tensor, weights: list[torch.Tensor]) -> Loss:
    """Error of the linears themselves: ``sum_i mean (x (Q_i - W_i)^T)^2`` for inputs ``x [T, K]``."""
    def loss(quantized: list[torch.Tensor]) -> float:
        return float(sum(((x @ (q - w).t()) ** 2).mean() for w, q in zip(weights, quantized)))
    return loss


@contextmanager
def swapped_weights(linears: list[nn.Linear], weights: list[torch.Tensor]) -> Iterator[None]:
    saved = [lin.weight.data for lin in linears]
    try:
        for lin, w in zip(linears, weights):
            lin.weight.data = w.to(lin.weight.dtype)
        yield
    finally:
        for lin, w in zip(linears, saved):
            lin.weight.data = w


def module_loss(run: Callable[[int], torch.Tensor], n_batches: int, linears: list[nn.Linear]) -> Loss:
    """Mean squared error of ``run(batch)`` (a module's output) with the linears' weights swapped for the
    candidates, against the output with the current (float) weights."""
    with torch.no_grad():
        ref = [run(b).float() for b in range(n_batches)]

    def loss(quantized: list[torch.Tensor]) -> float:
        with torch.no_grad(), swapped_weights(linears, quantized):
            sq = sum(float(((run(b).float() - r) ** 2).sum()) for b, r in enumerate(ref))
        return sq / sum(r.numel() for r in ref)
    return loss


def weight_mean(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Per input channel mean of ``|w| / max |w| of its (row, group)`` over the rows of all ``weights``."""
    w = torch.cat([x.float() for x in weights])
    n, k = w.shape
    g = k if group_size == -1 or k % group_size else group_size
    a = w.abs().reshape(n, k // g, g)
    a = a / a.amax(-1, keepdim=True).clamp_min(1e-8)
    return a.reshape(n, k).mean(0)


def search_scale(loss: Loss, x_mean: torch.Tensor, weights: list[torch.Tensor], bits: int, group_size: int, sym: bool,
                 grid: int = 20, scale_dtype: torch.dtype = torch.float16,
                 duo: bool = False) -> tuple[torch.Tensor, float, float]:
    """``(s [K], best loss, loss at s = 1)`` for torch-layout weights ``[N_i, K]`` reading inputs whose mean
    ``|x|`` per channel is ``x_mean``."""
    base = loss([fake_quant(w, bits, group_size, sym, scale_dtype) for w in weights])
    best_s, best = torch.ones_like(x_mean, dtype=torch.float32), base
    x_mean = x_mean.float().clamp(min=1e-4)
    w_mean = weight_mean(weights, group_size).clamp(min=1e-4) if duo else None
    for i in range(grid):
        alpha = i / grid
        s = x_mean.pow(alpha) / w_mean.pow(1 - alpha) if duo else x_mean.pow(alpha)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = loss([fake_quant(w * s, bits, group_size, sym, scale_dtype) / s for w in weights])
        if err < best:
            best, best_s = err, s
    return best_s, best, base


def fold_scale(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """``prev`` output / s, linears' input columns * s: the float function is unchanged."""
    with torch.no_grad():
        if isinstance(prev, nn.Linear):
            prev.weight.div_(s.view(-1, 1))
            if prev.bias is not None:
                prev.bias.div_(s)
        else:
            prev.weight.div_(s)
        for lin in linears:
            lin.weight.mul_(s.view(1, -1))


def search_clip(x: torch.Tensor, weight: torch.Tensor, bits: int, group_size: int, sym: bool, steps: int = 10,
                min_ratio: float = 0.5, scale_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Weight with each (channel, group) range shrunk by the ratio minimizing that group's output error."""
    n, k = weight.shape
    g = k if group_size == -1 else group_size
    if k % g:
        return weight
    w = weight.float().reshape(n, k // g, g)
    xg = x.float().reshape(-1, k // g, g)
    wmax, wmin = w.amax(-1, keepdim=True), w.amin(-1, keepdim=True)
    if sym:
        wmax = torch.maximum(wmax.abs(), wmin.abs())
        wmin = -wmax
    best_err = torch.full((n, k // g), float("inf"), device=weight.device)
    best = w.clone()
    for i in range(steps + 1):
        r = 1 - i * (1 - min_ratio) / steps
        wc = torch.maximum(torch.minimum(w, wmax * r), wmin * r)
        q = fake_quant(wc.reshape(n, k), bits, group_size, sym, scale_dtype).reshape(n, k // g, g)
        err = (torch.einsum("tgc,ngc->tng", xg, q - w) ** 2).mean(0)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better.unsqueeze(-1), wc, best)
    return best.reshape(n, k).to(weight.dtype)


def awq_layer(layer: nn.Module, inputs: dict[str, list[torch.Tensor]], layer_kwargs: list[dict],
              means: dict[str, torch.Tensor], bits: int, group_size: int, sym: bool, clip: bool = False,
              scale_dtype: torch.dtype = torch.float16, duo: bool = False, grid: int = 20) -> dict[str, float]:
    """Scale-search and fold every mapping of one decoder layer in place; returns loss(best s) / loss(s = 1) per
    mapping.

    ``inputs[name]`` are calibration batches ``[B, T, K]`` of the first linear of each mapping (whole sequences:
    attention needs them), ``layer_kwargs[b]`` the keyword arguments the decoder layer got with batch ``b``
    (mask, rotary embeddings), ``means[name]`` the mean ``|x|`` per channel over all calibration tokens."""
    mods = dict(layer.named_modules())
    report = {}
    for prev_name, names, inspect in AWQ_MAPPINGS:
        if prev_name not in mods or not all(n in mods for n in names) or names[0] not in inputs:
            continue
        prev, lins = mods[prev_name], [mods[n] for n in names]
        if isinstance(prev, nn.Linear) and prev.out_features != lins[0].in_features:
            continue  # e.g. v_proj -> o_proj under grouped-query attention: shapes differ, no fold
        xs = [x.float() for x in inputs[names[0]]]
        module = mods.get(inspect)
        if module is None:  # a layout without that module: measure the linears themselves
            loss = linear_loss(torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]), [m.weight.float() for m in lins])
        else:
            def run(b, xs=xs, module=module, attention=inspect == "self_attn"):
                out = module(hidden_states=xs[b], **layer_kwargs[b]) if attention else module(xs[b])
                return out[0] if isinstance(out, tuple) else out
            loss = module_loss(run, len(xs), lins)
        s, best, base = search_scale(loss, means[names[0]], [m.weight.float() for m in lins], bits, group_size,
                                     sym, grid, scale_dtype, duo)
        fold_scale(prev, lins, s)
        report[names[0]] = best / base if base > 0 else 1.0
        if clip:
            flat = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]) / s
            for name, lin in zip(names, lins):
                if not name.endswith(NO_CLIP):
                    with torch.no_grad():
                        lin.weight.copy_(search_clip(flat, lin.weight, bits, group_size, sym, scale_dtype=scale_dtype))
    return report
