"""Checked weight loaders for quantized parameters (DESIGN.md rule 6: name the tensor, expected vs found).

Every parameter a quant method registers gets a ``weight_loader`` from :func:`make_loader` that checks the
dtype, places fused shards (handling packed output dims whose shards are padded separately), records which
shards arrived, and lets :func:`require_loaded` report a tensor the checkpoint never provided.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _label(layer: nn.Module, name: str, shard_id: str | int | None) -> str:
    return f"{layer.prefix}.{name}" + (f" (shard {shard_id!r})" if shard_id is not None else "")


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def _like(loaded: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``loaded`` (a checkpoint tensor, on the CPU) on ``target``'s device and in its dtype: never assume they share one."""
    return loaded.to(device=target.device, dtype=target.dtype)


def make_loader(
    layer: nn.Module,
    name: str,
    dtypes: tuple[torch.dtype, ...],
    mode: str = "split",
    packed_size: Callable[[int], int] | None = None,
    hint: str = "",
) -> Callable[[torch.Tensor, torch.Tensor, str | int | None], None]:
    """A ``weight_loader(param, tensor, shard_id)`` for parameter ``name`` of ``layer``.

    mode ``split``: shards go to their slice of ``param.output_dim``; when that dim is packed,
    ``packed_size(n)`` maps a shard's output size to its packed size (shards are padded separately).
    mode ``shared``: every shard carries the same tensor (GPTQ ``g_idx``); later shards must agree.
    mode ``per_shard``: ``param`` has one row per shard (per-tensor scales, ``weight_shape``); the tensor fills one row."""
    from lqe.layers.linear import copy_checked  # lqe.layers imports this package

    def loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        label = _label(layer, name, shard_id)
        if loaded.dtype not in dtypes:
            raise ValueError(f"tensor {label}: expected dtype {_names(dtypes)}, found {loaded.dtype}. {hint}".rstrip())
        fused = shard_id is not None and len(layer.output_sizes) > 1
        target = param.data
        if mode == "split" and fused:
            layer.shard_slice(shard_id)  # raises on an unknown shard id
            i = layer.shard_ids.index(shard_id)
            dim = param.output_dim
            sizes = layer.output_sizes
            if getattr(param, "packed_dim", None) == dim and packed_size is not None:
                sizes = [packed_size(s) for s in sizes]
            target = target.narrow(dim, sum(sizes[:i]), sizes[i])
        elif mode == "shared" and param.loaded_shards:
            if tuple(loaded.shape) != tuple(target.shape) or not torch.equal(_like(loaded, target), target):
                first = next(iter(param.loaded_shards))
                raise ValueError(f"tensor {label} differs from shard {first!r}: the fused shards must share one {name}")
        elif mode == "per_shard":
            row = target[0]
            if loaded.numel() == row.numel():  # one shard's value(s); a whole-layer value goes to every row
                rows = [layer.shard_ids.index(shard_id)] if fused else list(range(target.shape[0]))
                for i in rows:
                    target[i].copy_(_like(loaded.reshape(row.shape), target))
                param.loaded_shards.add(shard_id)
                return
            if fused or loaded.numel() != target.numel():
                raise ValueError(f"tensor {label}: expected {row.numel()} value(s) per shard, found shape {tuple(loaded.shape)}")
            loaded = loaded.reshape(target.shape)
        copy_checked(label, target, loaded)
        param.loaded_shards.add(shard_id)

    return loader


def add_param(layer: nn.Module, name: str, param: nn.Parameter, dtypes: tuple[torch.dtype, ...], mode: str = "split",
              packed_size: Callable[[int], int] | None = None, hint: str = "") -> None:
    """Register ``param`` as ``layer.<name>`` with a checked loader."""
    param.weight_loader = make_loader(layer, name, dtypes, mode, packed_size, hint)
    param.loaded_shards = set()
    layer.register_parameter(name, param)


def is_loaded(layer: nn.Module, name: str) -> bool:
    """True when every shard of ``layer.<name>`` (or the whole tensor at once) was loaded."""
    p = getattr(layer, name, None)
    if p is None:
        return False
    got = p.loaded_shards
    return None in got or set(layer.shard_ids) <= got or (len(layer.output_sizes) == 1 and bool(got))


def require_loaded(layer: nn.Module, names: list[str]) -> None:
    """Raise naming each tensor (and missing shards) the checkpoint did not provide."""
    for name in names:
        if not is_loaded(layer, name):
            got = getattr(layer, name).loaded_shards
            missing = [s for s in layer.shard_ids if s not in got] if len(layer.output_sizes) > 1 else []
            raise ValueError(
                f"tensor {layer.prefix}.{name} is missing from the checkpoint"
                + (f" for shards {missing}" if missing and got else "")
                + f" (needed by {type(layer.quant_method).__name__}; is the quantization config right for these files?)"
            )


def drop_params(layer: nn.Module, names: list[str]) -> None:
    """Free checkpoint-layout parameters once they were converted for ``apply``."""
    for name in names:
        if name in layer._parameters:
            del layer._parameters[name]
