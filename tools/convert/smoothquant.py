"""SmoothQuant (Xiao et al. 2022), written from the paper: migrate activation outliers into the weights with a
per-input-channel factor ``s = max|x|^alpha / max|W|^(1-alpha)``; the previous RMSNorm weight is divided by
``s`` and the following linears' input columns multiplied by it (an exact float transform), so per-token int8
activations and per-channel int8 weights both see flatter ranges."""
from __future__ import annotations

import torch
from torch import nn

from tools.convert.awq import fold_scale

SQ_MAPPINGS = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
               ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")))


def smooth_factors(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float = 0.5) -> torch.Tensor:
    """``s [K]``; channels that never saw activation (or weight) keep 1."""
    w_absmax = torch.stack([w.float().abs().amax(0) for w in weights]).amax(0)
    a = act_absmax.float()
    ok = (a > 0) & (w_absmax > 0)
    s = a.clamp_min(1e-8).pow(alpha) / w_absmax.clamp_min(1e-8).pow(1 - alpha)
    return torch.where(ok, s.clamp(min=1e-5), torch.ones_like(s))


def smooth_layer(layer: nn.Module, act_absmax: dict[str, torch.Tensor], alpha: float = 0.5) -> list[str]:
    """Smooth every norm -> linears mapping of a decoder layer in place; returns the smoothed groups."""
    mods = dict(layer.named_modules())
    done = []
    for prev_name, names in SQ_MAPPINGS:
        if prev_name not in mods or not all(n in mods for n in names) or names[0] not in act_absmax:
            continue
        lins = [mods[n] for n in names]
        fold_scale(mods[prev_name], lins, smooth_factors(act_absmax[names[0]], [m.weight for m in lins], alpha))
        done.append(prev_name)
    return done
