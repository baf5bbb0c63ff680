"""User-supplied quantization parameters -> CanonicalWeight.

The parameter file (``.safetensors``, or a ``torch.save``d dict in ``.pt``/``.bin``) holds, for every quantized
linear ``<prefix>`` (e.g. ``model.layers.0.self_attn.q_proj``), in the GPTQ math orientation ``W [K, N]``:

* ``<prefix>.scales``  float ``[G, N]``, ``G = ceil(K / group_size)`` (1 for ``--group-size -1``);
* ``<prefix>.zeros``   integer ``[G, N]`` true zero points in ``[0, 2^bits)`` (omit for symmetric: zero = 2^(bits-1));
* ``<prefix>.g_idx``   int ``[K]`` group of each input channel (optional; act-order), **or**
* ``<prefix>.perm``    int ``[K]`` act-order permutation: position ``i`` holds input channel ``perm[i]``, groups are
  formed in permuted order, i.e. ``g_idx[perm[i]] = i // group_size``.

Codes are ``clamp(round(W / scale) + zero, 0, 2^bits - 1)``. A layer listed with only ``g_idx``/``perm`` (no
scales) has its scales recovered from fake-quantized weights (see :mod:`.fakequant`).
"""
from __future__ import annotations

import os

import torch

from lqe.kernels.canonical import CanonicalWeight, build_canonical
from lqe.quant_layers.reference import num_groups
from tools.convert.spec import ConvertError

SUFFIXES = ("scales", "zeros", "g_idx", "perm")


def load_params(path: str) -> dict[str, dict[str, torch.Tensor]]:
    """``{prefix: {"scales": ..., "zeros": ..., "g_idx": ...}}``; unknown suffixes are an error."""
    if not os.path.isfile(path):
        raise ConvertError(f"parameter file {path!r} does not exist")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        flat = load_file(path)
    else:
        flat = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(flat, dict):
            raise ConvertError(f"{path}: expected a dict of tensors, found {type(flat).__name__}")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        prefix, _, leaf = key.rpartition(".")
        if leaf not in SUFFIXES or not prefix:
            raise ConvertError(f"{path}: key {key!r} is not '<layer prefix>.{{{','.join(SUFFIXES)}}}'")
        out.setdefault(prefix, {})[leaf] = t
    return out


def group_index_from(p: dict[str, torch.Tensor], name: str, k: int, group_size: int) -> torch.Tensor | None:
    """g_idx from ``g_idx`` or ``perm`` (validated), or None for the trivial ``k // g``."""
    if "g_idx" in p and "perm" in p:
        raise ConvertError(f"{name}: give either g_idx or perm, not both")
    if "perm" in p:
        perm = p["perm"].long().reshape(-1)
        if perm.numel() != k or not torch.equal(perm.sort().values, torch.arange(k)):
            raise ConvertError(f"{name}.perm: expected a permutation of 0..{k - 1} (shape [{k}]), found shape {tuple(perm.shape)}")
        g = k if group_size == -1 else group_size
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
        return g_idx
    if "g_idx" in p:
        g_idx = p["g_idx"].reshape(-1)
        if g_idx.numel() != k:
            raise ConvertError(f"{name}.g_idx: expected shape [{k}] (K), found {tuple(p['g_idx'].shape)}")
        gmax = num_groups(k, group_size)
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= gmax:
            raise ConvertError(f"{name}.g_idx: group ids must lie in [0, {gmax}) for K={k}, group size {group_size}")
        counts = torch.bincount(g_idx.long(), minlength=gmax)
        g = k if group_size == -1 else group_size
        if int(counts.max()) > g:
            raise ConvertError(f"{name}.g_idx: a group holds {int(counts.max())} channels, more than the group size {g}")
        return g_idx.to(torch.int32)
    return None


def canonical_from_params(name: str, weight: torch.Tensor, p: dict[str, torch.Tensor], bits: int, group_size: int,
                          sym: bool) -> CanonicalWeight:
    """Quantize the float torch-layout ``weight [N, K]`` with the given scales/zeros."""
    n, k = weight.shape
    g = num_groups(k, group_size)
    g_idx = group_index_from(p, name, k, group_size)
    if "scales" not in p:
        raise ConvertError(f"{name}: the parameter file has no {name}.scales")
    scales = p["scales"].float()
    if tuple(scales.shape) != (g, n):
        hint = " (it looks transposed: the file must use the GPTQ orientation [G, N])" if tuple(scales.shape) == (n, g) else ""
        raise ConvertError(f"{name}.scales: expected shape [{g}, {n}] = [ceil(K/g), N] for weight [N={n}, K={k}] "
                           f"and group size {group_size}, found {list(scales.shape)}{hint}")
    if not bool((scales > 0).all()) or not bool(torch.isfinite(scales).all()):
        raise ConvertError(f"{name}.scales: all scales must be positive and finite")
    maxq = (1 << bits) - 1
    zeros = None
    if "zeros" in p:
        z = p["zeros"]
        if tuple(z.shape) != (g, n):
            raise ConvertError(f"{name}.zeros: expected shape [{g}, {n}] like scales, found {list(z.shape)}")
        zf = z.double()
        if not bool((zf == zf.round()).all()) or float(zf.min()) < 0 or float(zf.max()) > maxq:
            raise ConvertError(f"{name}.zeros: zero points must be integers in [0, {maxq}] for {bits} bits")
        if sym:
            if not bool((zf == (1 << (bits - 1))).all()):
                raise ConvertError(f"{name}.zeros: --sym needs every zero point = {1 << (bits - 1)}; export with --asym")
        else:
            zeros = zf.to(torch.uint8)
    elif not sym:
        raise ConvertError(f"{name}: --asym needs {name}.zeros in the parameter file")
    cw = build_canonical(torch.zeros(k, n, dtype=torch.uint8), scales, zeros, g_idx, bits, group_size)
    gi = cw.group_index()
    codes = torch.round(weight.detach().double().t() / scales.double()[gi]) + cw.zero_points().double()[gi]
    cw.codes = codes.clamp(0, maxq).to(torch.uint8)
    return cw
