"""AWQ (Lin et al. 2023), written from the paper: for each group of linears sharing an input, search a
per-input-channel scale ``s = mean|x|^alpha`` (normalized) over a grid of ``alpha`` that minimizes the output
error of the RTN-quantized ``W * s`` applied to ``x / s``; fold ``1/s`` into the previous op (the RMSNorm weight,
or the previous linear's output rows), keep ``W * s``. Optional clipping search (``--awq-clip``): shrink each
group's range by a ratio that minimizes that group's output error."""
from __future__ import annotations

import torch
from torch import nn

from tools.convert.rtn import fake_quant

# (previous op, linears reading its output) in a Llama/Qwen decoder layer
AWQ_MAPPINGS = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                ("self_attn.v_proj", ("self_attn.o_proj",)),
                ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
                ("mlp.up_proj", ("mlp.down_proj",)))
NO_CLIP = ("q_proj", "k_proj")  # attention logits are sensitive to clipping (as AutoAWQ does)


def output_error(x: torch.Tensor, weights: list[torch.Tensor], quantized: list[torch.Tensor]) -> float:
    return float(sum(((x @ (q - w).t()) ** 2).mean() for w, q in zip(weights, quantized)))


def search_scale(x: torch.Tensor, x_mean: torch.Tensor, weights: list[torch.Tensor], bits: int, group_size: int,
                 sym: bool, grid: int = 20, scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, float, float]:
    """``(s [K], best error, error at s = 1)`` for inputs ``x [T, K]`` and torch-layout weights ``[N_i, K]``."""
    best_s, best, base = torch.ones_like(x_mean), float("inf"), float("inf")
    for i in range(grid):
        alpha = i / grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        q = [fake_quant(w * s, bits, group_size, sym, scale_dtype) / s for w in weights]
        err = output_error(x, weights, q)
        if i == 0:
            base = err
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
    best_err = torch.full((n, k // g), float("inf"))
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


def awq_layer(layer: nn.Module, inputs: dict[str, torch.Tensor], means: dict[str, torch.Tensor], bits: int,
              group_size: int, sym: bool, clip: bool = False, scale_dtype: torch.dtype = torch.float16) -> dict[str, float]:
    """Scale-search and fold every mapping of one decoder layer in place; returns the error reduction per group.

    ``inputs[name]`` is a token sample ``[T, K]`` of the first linear of each mapping, ``means[name]`` its mean |x|
    over all calibration tokens."""
    mods = dict(layer.named_modules())
    report = {}
    for prev_name, names in AWQ_MAPPINGS:
        if prev_name not in mods or not all(n in mods for n in names) or names[0] not in inputs:
            continue
        prev, lins = mods[prev_name], [mods[n] for n in names]
        if isinstance(prev, nn.Linear) and prev.out_features != lins[0].in_features:
            continue  # e.g. v_proj -> o_proj under grouped-query attention: shapes differ, no fold
        x = inputs[names[0]].float()
        s, best, base = search_scale(x, means[names[0]].float(), [m.weight.float() for m in lins], bits, group_size,
                                     sym, scale_dtype=scale_dtype)
        fold_scale(prev, lins, s)
        report[names[0]] = best / base if base > 0 else 1.0
        if clip:
            for name, lin in zip(names, lins):
                if not name.endswith(NO_CLIP):
                    with torch.no_grad():
                        lin.weight.copy_(search_clip(x / s, lin.weight, bits, group_size, sym, scale_dtype=scale_dtype))
    return report
