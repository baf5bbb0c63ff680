"""Load-time checks that catch weights which would make every output meaningless: NaN / inf in any float
tensor (embeddings, norms, float linears, scales), scales that are zero or negative, and unpacked integer zero
points outside the int8 range. One pass over each tensor, run after the checkpoint is read and before the
quantized layers are repacked, so the names are the checkpoint's own (fused layers: ``qkv_proj`` columns).

By default a bad tensor is an error naming it, the first bad group and how many values are bad;
``allow_nonfinite_weights=True`` (``--allow-nonfinite-weights``) loads anyway and logs a warning per tensor.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger("lqe")

# float parameters whose values multiply codes: must be finite and > 0
_SCALE_NAMES = ("scales", "weight_scale", "weight_scale_inv", "input_scale", "weight_global_scale")


class BadWeightsError(ValueError):
    """A checkpoint tensor holds values that would make the model's outputs meaningless."""


def _loaded(module: nn.Module, name: str, param: torch.Tensor) -> bool:
    shards = getattr(param, "loaded_shards", None)
    if shards is None:  # parameters outside the quant methods: load_weights fills them or fails
        return True
    from lqe.quant_layers.loading import is_loaded

    return is_loaded(module, name)


def _where(t: torch.Tensor, bad: torch.Tensor, name: str) -> str:
    idx = [int(i) for i in torch.nonzero(bad)[0].tolist()]
    value = t[tuple(idx)].item()
    if name in ("scales",) and t.dim() == 2:  # GPTQ / AWQ: [groups, N]
        pos = f"group {idx[0]}, output column {idx[1]}"
    elif t.dim() == 2 and name.startswith("weight_scale"):  # compressed-tensors / fp8: [N, groups]
        pos = f"output row {idx[0]}, group {idx[1]}"
    else:
        pos = f"index {tuple(idx) if len(idx) > 1 else idx[0]}"
    return f"{pos} = {value}"


def check_tensor(full_name: str, name: str, t: torch.Tensor, packed: bool = False) -> str | None:
    """A message describing what is wrong with ``t``, or None when it is fine. ``packed``: several integer
    fields per stored word (their range is that of the bit width by construction)."""
    if t.is_floating_point() and t.dtype.itemsize == 1:  # fp8: no isfinite / comparisons on every device
        t = t.float()
    if t.is_floating_point():
        if name in _SCALE_NAMES:
            bad = ~((t > 0) & (t != float("inf")))  # NaN, -inf, +inf, 0 and negatives, in one pass
            what = "non-finite or non-positive scales"
            fix = "scales must be finite and > 0"
        else:
            bad = ~torch.isfinite(t)
            what = "non-finite values (NaN / inf)"
            fix = "weights must be finite"
        if not bool(bad.any()):
            return None
        n = int(bad.sum())
        return (f"tensor {full_name} {list(t.shape)} holds {n} {what}; first at {_where(t, bad, name)}. {fix}: the "
                "checkpoint is corrupt or its export overflowed. Re-export it, or pass allow_nonfinite_weights=True "
                "(--allow-nonfinite-weights) to load it anyway")
    if name.endswith("zero_point") and not packed and t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < -128 or hi > 255:
            return (f"tensor {full_name} {list(t.shape)} holds zero points in [{lo}, {hi}], outside the 8-bit range "
                    "of its format; the checkpoint is corrupt. Re-export it, or pass allow_nonfinite_weights=True "
                    "to load it anyway")
    return None


def check_model_weights(model: nn.Module, allow: bool = False) -> list[str]:
    """Check every loaded parameter of ``model``; raise ``BadWeightsError`` on the first bad tensor, or with
    ``allow`` log a warning for each and return the messages."""
    problems = []
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or not _loaded(module, name, param):
                continue
            seen.add(id(param))
            msg = check_tensor(f"{module_name}.{name}" if module_name else name, name, param.data,
                               getattr(param, "packed_dim", None) is not None)
            if msg is None:
                continue
            if not allow:
                raise BadWeightsError(msg)
            logger.warning("lqe: %s (loaded anyway: allow_nonfinite_weights=True; outputs may be meaningless)", msg)
            problems.append(msg)
    return problems


def config_number(value, key: str, where: str, kind: type = int):
    """``kind(value)`` for a config value, or a ValueError naming the key and the file (not ``invalid literal``)."""
    try:
        if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
            raise ValueError
        if kind is int and isinstance(value, float):
            if not value.is_integer():
                raise ValueError
            return int(value)
        return kind(value)
    except (TypeError, ValueError):
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{where}: {key!r} must be {what}, got {value!r}; fix that value in the file") from None
