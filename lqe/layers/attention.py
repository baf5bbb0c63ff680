"""Attention over the paged KV cache.

The model calls ``Attention(q, k, v)`` with the step's flattened tokens; the layer hands them, with its
layer's KV cache and the step's metadata from the forward context, to its backend, which stores K/V and
computes the output. Backends (torch reference, triton, flash_attn) and their selection live in
:mod:`lqe.kernels.attention_backends`; the model runner assigns one to every layer after building the model.

fp8 KV cache (``kv_cache_dtype``): every layer owns ``k_scale`` / ``v_scale``, float32 device tensors of one
element (the cache holds ``k / k_scale``). They come from the checkpoint (:func:`kv_scale_targets` maps its
names) or, when it has none, from the first prefill (:meth:`Attention.calc_kv_scales`, vLLM's rule); they are
updated in place, so CUDA graphs captured before the first prefill read the final values.

Key rotation (``kv_cache_key_rotation``, on by default with an fp8 cache): before a step's keys are stored, every
head's query and key are multiplied by one randomized Hadamard matrix ``M`` (entries +-1, ``M M^T = D I``):
``q' = q M`` in the model dtype (exact: +-1 entries, fp32 accumulation) and ``k' = k M / D`` in float32, so
``q' . k' = q . k`` and attention computes the same function. Keys carry a few outlier channels (RoPE's slow
dimensions, attention sinks) whose products with the query dominate a score, and fp8's 3-bit mantissa error on
them goes straight into the logits; the rotation spreads every channel over all ``D``, so the error of a score
averages over ``D`` products instead. SmolLM2 WikiText-2: e4m3 +1.08 % ppl without, +0.60 % with (README).
``|k'|max <= |k|max``, so a checkpoint's ``k_scale`` (calibrated on unrotated keys) never saturates; scales from the
first prefill are computed on ``k'``. Values are not rotated: their fp8 error is small and rotation made it
larger (measured).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from lqe.forward_context import get_forward_context
from lqe.kernels.attention_backends import AttentionBackend, TorchAttentionBackend
from lqe.kernels.hadamard import signed_hadamard

# vLLM's calculate_kv_scales divisors (envs K_SCALE_CONSTANT / V_SCALE_CONSTANT): scale = absmax / range, so the
# first prefill's largest |k| lands on 200 and |v| on 100, leaving headroom below e4m3's 448 for later tokens
K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, layer_idx: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.layer_idx = layer_idx
        self.backend: AttentionBackend = TorchAttentionBackend()
        # KV-cache quantization scales (used only when the cache is fp8); not part of the state dict
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.kv_scales_loaded: set[str] = set()  # "k_scale" / "v_scale" the checkpoint gave this layer
        self.calculate_kv_scales = False  # set by the model runner for the first prefill of an fp8 cache
        # key rotation of an fp8 cache (see the module doc): q' = q @ rot_q, k' = k.float() @ rot_k; None = off. Plain
        # attributes, not buffers: one pair shared by every layer, built on the cache's device (key_rotation)
        self.rot_q: torch.Tensor | None = None
        self.rot_k: torch.Tensor | None = None

    def set_key_rotation(self, rotation: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Rotate queries and keys with ``rotation`` = :func:`key_rotation`'s ``(rot_q, rot_k)`` from now on (None:
        stop); call it before the cache holds any key of this layer (it would mix rotated and unrotated ones)."""
        if rotation is not None and rotation[0].shape != (self.head_dim, self.head_dim):
            raise ValueError(f"key rotation of shape {tuple(rotation[0].shape)} for head_dim={self.head_dim}")
        self.rot_q, self.rot_k = rotation if rotation is not None else (None, None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        if ctx.split_attention is not None:  # piecewise-graph capture: the cut point (lqe.engine.piecewise)
            return ctx.split_attention(self, q, k, v)
        return self.attend(q, k, v, ctx.attn_metadata, ctx.kv_caches[self.layer_idx])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, cache: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Store ``k``/``v`` and attend with ``meta`` over this layer's ``cache``: ``[T, heads * head_dim]`` (in
        ``out`` when given: the piecewise-graph replay, which calls it between two captured pieces with the step's
        real metadata, passes the static buffer the next piece reads)."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.rot_q is not None:
            q, k = torch.matmul(q, self.rot_q), torch.matmul(k.float(), self.rot_k)
        if self.calculate_kv_scales:
            self.calc_kv_scales(k, v, meta.slot_mapping)
        scales = (self.k_scale, self.v_scale) if cache.element_size() == 1 else ()
        dst = None if out is None else out.view(t, self.num_heads, self.head_dim)
        res = self.backend.forward(q, k, v, cache, meta, self.scale, *scales, out=dst)
        return res.reshape(t, self.num_heads * self.head_dim)

    @torch.no_grad()
    def calc_kv_scales(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """vLLM's ``calc_kv_scales``: ``k_scale = max|k| / 200``, ``v_scale = max|v| / 100`` over the tokens this
        step stores (padding rows excluded; ``k`` rotated when the layer rotates keys), once; a zero absmax keeps
        the scale at 1. A scale the checkpoint gave (``kv_scales_loaded``: some give only one of the two) is kept."""
        rows = slot_mapping[: k.shape[0]] >= 0
        if not bool(rows.any()):
            return
        for x, name, rng in ((k, "k_scale", K_SCALE_RANGE), (v, "v_scale", V_SCALE_RANGE)):
            if name in self.kv_scales_loaded:
                continue
            dst = getattr(self, name)
            amax = x[rows].abs().amax().float()
            dst.copy_(torch.where(amax > 0, amax / rng, torch.ones_like(amax)).reshape(1))
        self.calculate_kv_scales = False

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"


def key_rotation(head_dim: int, query_dtype: torch.dtype, device: torch.device | str,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rot_q, rot_k)`` of the fp8 cache's key rotation: a randomized Hadamard matrix ``M`` of order ``head_dim``
    in the query dtype (entries +-1, exact) and ``M / head_dim`` in float32; None when no Hadamard matrix of that
    order is known."""
    h = signed_hadamard(head_dim, seed)
    if h is None:
        return None
    return h.to(device=device, dtype=query_dtype), (h / head_dim).to(device=device, dtype=torch.float32)


# checkpoint names of KV-cache scales -> the Attention buffers they fill (relative to the layer's self_attn)
_KV_SCALE_NAMES = (
    (re.compile(r"^(.*\.self_attn)\.k_scale$"), ("k_scale",)),  # compressed-tensors / llm-compressor
    (re.compile(r"^(.*\.self_attn)\.v_scale$"), ("v_scale",)),
    (re.compile(r"^(.*\.self_attn)\.k_proj\.output_scale$"), ("k_scale",)),  # older llm-compressor / AutoFP8
    (re.compile(r"^(.*\.self_attn)\.v_proj\.output_scale$"), ("v_scale",)),
    (re.compile(r"^(.*\.self_attn)\.kv_scale$"), ("k_scale", "v_scale")),  # FP8 checkpoints: one scale for both
)


def kv_scale_targets(name: str) -> list[str] | None:
    """The Attention buffers (``model.layers.3.self_attn.attn.k_scale``, ...) a checkpoint tensor named ``name``
    holds a KV-cache scale for, or ``None`` when it is not one."""
    for pattern, buffers in _KV_SCALE_NAMES:
        m = pattern.match(name)
        if m:
            return [f"{m.group(1)}.attn.{b}" for b in buffers]
    return None


def load_kv_scale(module: Attention, buffer: str, name: str, tensor: torch.Tensor) -> None:
    """Copy a per-tensor checkpoint scale into ``module.<buffer>``; per-head scales are refused clearly."""
    if tensor.numel() != 1:
        raise ValueError(f"{name}: KV-cache scale of shape {tuple(tensor.shape)}; lqe reads one scale per layer "
                         "(kv_cache_scheme strategy 'tensor'), not per head. Re-export with strategy 'tensor'.")
    value = tensor.reshape(1).float()
    if not bool(torch.isfinite(value).all()) or float(value) <= 0:
        raise ValueError(f"{name}: KV-cache scale {float(value)} is not a positive finite number; the checkpoint is "
                         "corrupt (re-export it) or drop the scale tensors to compute them from the first prefill")
    getattr(module, buffer).copy_(value.to(getattr(module, buffer).device))
    module.kv_scales_loaded.add(buffer)


KV_CACHE_TORCH_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def checkpoint_kv_cache_scheme(raw_config: dict) -> dict | None:
    """The compressed-tensors ``kv_cache_scheme`` of a config.json (``quantization_config`` or the legacy
    ``compression_config``), or ``None``."""
    for key in ("quantization_config", "compression_config"):
        qc = raw_config.get(key)
        if isinstance(qc, dict) and isinstance(qc.get("kv_cache_scheme"), dict):
            return qc["kv_cache_scheme"]
    return None


def resolve_kv_cache_dtype(kv_cache_dtype: str, raw_config: dict, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype: the model's for ``"auto"`` unless the checkpoint declares an fp8
    ``kv_cache_scheme`` (then fp8 e4m3, as vLLM does); float8_e4m3fn / float8_e5m2 for the fp8 names."""
    scheme = checkpoint_kv_cache_scheme(raw_config)
    if scheme is not None:
        bits, kind = scheme.get("num_bits", 8), scheme.get("type", "int")
        strategy = scheme.get("strategy") or "tensor"
        if bits != 8 or kind != "float" or strategy != "tensor" or scheme.get("dynamic"):
            raise ValueError(
                f"kv_cache_scheme {scheme} is not supported: lqe reads static per-tensor 8-bit float KV-cache scales "
                "(num_bits 8, type 'float', strategy 'tensor', dynamic false). Re-export with that scheme, or remove "
                "kv_cache_scheme from config.json to run with a 16-bit cache")
        if kv_cache_dtype == "auto":
            return torch.float8_e4m3fn
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_TORCH_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; choose auto, "
                         f"{', '.join(KV_CACHE_TORCH_DTYPES)}")
    return KV_CACHE_TORCH_DTYPES[kv_cache_dtype]
