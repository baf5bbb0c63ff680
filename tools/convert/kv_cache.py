"""``quantize --kv-cache fp8``: calibrate static per-layer KV-cache scales and write them as llm-compressor does.

The scales are measured on the checkpoint just written, through lqe's engine: every attention layer's K (after
RoPE, and after the q/k norm of Qwen3) and V, exactly what the engine stores in its cache, over the calibration
windows. ``k_scale = max|k| / 448`` and ``v_scale = max|v| / 448`` (llm-compressor's static min-max observer for
an 8-bit float e4m3 scheme: the calibration's largest value lands on the format's largest). They are written in
the compressed-tensors layout: ``quantization_config.kv_cache_scheme`` in config.json and one float32 tensor per
layer, ``model.layers.N.self_attn.k_scale`` / ``.v_scale``, in ``kv_cache_scales.safetensors`` (listed in the
shard index when there is one). lqe and vLLM then run an fp8 e4m3 KV cache with them by default.
"""
from __future__ import annotations

import json
import logging
import os

import torch
from safetensors.torch import save_file

from tools.convert.writer import write_json

logger = logging.getLogger("lqe")

E4M3_MAX = 448.0
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "tensor",
                   "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
                   "observer_kwargs": {}}
SCALES_FILE = "kv_cache_scales.safetensors"


def measure_kv_absmax(model_dir: str, input_ids: torch.Tensor, device: str = "cpu") -> dict[str, tuple[float, float]]:
    """``{"model.layers.N.self_attn": (max|k|, max|v|)}`` over ``input_ids [num_samples, seq_len]`` through the
    engine (16-bit cache, so nothing is quantized on the way)."""
    from lqe import LLM, SamplingParams
    from lqe.forward_context import get_forward_context
    from lqe.layers.attention import Attention

    seq_len = int(input_ids.shape[1])
    llm = LLM(model_dir, device=device, kv_cache_dtype="auto", max_model_len=seq_len + 1,
              kv_cache_memory_bytes=None if device.startswith("cuda") else 256 << 20, enable_prefix_caching=False)
    model = llm.llm_engine.runner.model
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, Attention):
            def hook(mod, args, name=name):
                k, v = args[1], args[2]
                rows = get_forward_context().attn_metadata.slot_mapping[: k.shape[0]] >= 0  # padding excluded
                cur = torch.stack([k[rows].abs().amax(), v[rows].abs().amax()]).float()
                amax[name] = cur if name not in amax else torch.maximum(amax[name], cur)
            hooks.append(m.register_forward_pre_hook(hook))
    try:
        llm.generate([{"prompt_token_ids": row.tolist()} for row in input_ids],
                     SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
        llm.shutdown()
    # the engine's attention module sits at <layer>.self_attn.attn; checkpoints name the scales on self_attn
    return {name.removesuffix(".attn"): (float(a[0]), float(a[1])) for name, a in amax.items()}


def write_kv_scales(out_dir: str, absmax: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Add the scales (``absmax / 448``; 1.0 for an all-zero tensor) and ``kv_cache_scheme`` to ``out_dir``."""
    tensors: dict[str, torch.Tensor] = {}
    for prefix, (k, v) in sorted(absmax.items()):
        tensors[f"{prefix}.k_scale"] = torch.tensor([k / E4M3_MAX if k > 0 else 1.0], dtype=torch.float32)
        tensors[f"{prefix}.v_scale"] = torch.tensor([v / E4M3_MAX if v > 0 else 1.0], dtype=torch.float32)
    save_file(tensors, os.path.join(out_dir, SCALES_FILE), metadata={"format": "pt"})
    index = os.path.join(out_dir, "model.safetensors.index.json")
    if os.path.isfile(index):  # a sharded checkpoint: loaders that follow the index must see the new file
        with open(index, encoding="utf-8") as f:
            idx = json.load(f)
        idx.setdefault("weight_map", {}).update({name: SCALES_FILE for name in tensors})
        write_json(index, idx)
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    qc = cfg.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        raise ValueError("--kv-cache fp8 writes compressed-tensors' kv_cache_scheme: use --format w8a8 or w4a16-ct "
                         f"(this checkpoint's quantization_config is {qc.get('quant_method') if qc else None!r})")
    qc["kv_cache_scheme"] = dict(KV_CACHE_SCHEME)
    write_json(cfg_path, cfg)
    logger.info("KV-cache scales of %d layers written to %s (kv_cache_scheme fp8 e4m3, per tensor)",
                len(absmax), SCALES_FILE)
    return {name: float(t) for name, t in tensors.items()}


def add_kv_cache_scales(out_dir: str, input_ids: torch.Tensor, device: str = "cpu") -> dict[str, float]:
    """Calibrate on ``input_ids`` through the checkpoint in ``out_dir`` and write its KV-cache scales there."""
    return write_kv_scales(out_dir, measure_kv_absmax(out_dir, input_ids, device))
