"""Reading checkpoint tensors and loading them into a model's parameters.

HF names are mapped to lqe's fused parameters through the model's ``stacked_params_mapping``
(``q_proj.qweight`` -> ``qkv_proj.qweight`` shard ``q``); each parameter's loader places the shard.
With tensor parallelism (``lazy=True``) safetensors tensors arrive as :class:`LazySlice` views: a layer narrows
them to its rank's part and only that part is read from the file.
"""
from __future__ import annotations

import glob
import logging
import os
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from lqe.layers.attention import Attention, kv_scale_targets, load_kv_scale
from lqe.layers.embedding import VocabEmbedding
from lqe.layers.linear import LinearBase, copy_checked

logger = logging.getLogger("lqe")

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def checkpoint_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        return files
    bins = sorted(glob.glob(os.path.join(model_dir, "pytorch_model*.bin")))
    if bins:
        return bins
    raise FileNotFoundError(f"{model_dir} holds no *.safetensors (or pytorch_model*.bin) weights")


class LazySlice:
    """A safetensors tensor not read yet: ``narrow`` composes views, ``materialize`` reads just that part."""

    def __init__(self, handle, name: str, shape: list[int] | None = None, index: tuple[slice, ...] | None = None) -> None:
        self.handle, self.name = handle, name
        self.shape = tuple(shape if shape is not None else handle.get_slice(name).get_shape())
        self.index = index if index is not None else tuple(slice(0, s) for s in self.shape)

    def narrow(self, dim: int, start: int, length: int) -> "LazySlice":
        index = list(self.index)
        index[dim] = slice(index[dim].start + start, index[dim].start + start + length)
        shape = list(self.shape)
        shape[dim] = length
        return LazySlice(self.handle, self.name, shape, tuple(index))

    def materialize(self) -> torch.Tensor:
        if not self.shape:
            return self.handle.get_tensor(self.name)
        return self.handle.get_slice(self.name)[self.index].contiguous()


def iterate_weights(model_dir: str, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        if path.endswith(".bin"):
            state = torch.load(path, map_location="cpu", weights_only=True)
            yield from state.items()
            continue
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, (LazySlice(f, name) if lazy else f.get_tensor(name))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read {path}: {e}. The file is corrupt or truncated; re-download or re-export it.") from e


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    owners: dict[str, tuple[LinearBase, str]] = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, LinearBase):
            for pname, _ in module.named_parameters(recurse=False):
                owners[f"{mod_name}.{pname}"] = (module, pname)
    embeddings = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, VocabEmbedding)}
    attentions = {n: m for n, m in model.named_modules() if isinstance(m, Attention)}  # KV-cache scales
    mapping = getattr(model, "stacked_params_mapping", [])
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        kv_targets = kv_scale_targets(name)
        if kv_targets is not None and all(t.rsplit(".", 1)[0] in attentions for t in kv_targets):
            value = tensor if isinstance(tensor, torch.Tensor) else tensor.materialize()
            for t in kv_targets:
                mod, buf = t.rsplit(".", 1)
                load_kv_scale(attentions[mod], buf, name, value)
            continue
        target, shard = name, None
        for fused, single, shard_id in mapping:
            if single + "." in name:
                target, shard = name.replace(single + ".", fused + "."), shard_id
                break
        if target not in params:
            unexpected.append(name)
            continue
        if target in owners:
            layer, pname = owners[target]
            layer.load_weight(pname, params[target], tensor, shard)
        elif target in embeddings:
            embeddings[target].load_weight(tensor)
        else:
            copy_checked(target, params[target].data, tensor if isinstance(tensor, torch.Tensor) else tensor.materialize())
        loaded.add(f"{target}#{shard}")
    if unexpected:
        logger.warning("checkpoint tensors not used by the model (%d): %s", len(unexpected), ", ".join(unexpected[:8]))
    _check_complete(model, params, owners, loaded)


def _check_complete(model, params, owners, loaded: set[str]) -> None:
    missing = []
    tied = {id(p) for n, p in params.items() if n == "lm_head.weight" and getattr(model, "tied", False)}
    for name, param in params.items():
        if id(param) in tied:
            continue
        if (name in owners and len(owners[name][0].output_sizes) > 1 and getattr(param, "output_dim", None) is not None
                and not getattr(param, "optional", False)):
            for sid in owners[name][0].shard_ids:
                if f"{name}#{sid}" not in loaded:
                    missing.append(f"{name} (shard {sid})")
        elif not any(key.startswith(name + "#") for key in loaded) and not getattr(param, "optional", False):
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) the model needs: {shown}")
