"""The ``quantization_config`` (config.json) and ``quantize_config.json`` each format's loaders read
(FORMATS.md §1.1, §2.1, §3.1)."""
from __future__ import annotations

from typing import Any

from tools.convert.spec import ExportSpec

QUANTIZER = "lqe-convert:0.1.0"


def gptq_config(spec: ExportSpec) -> dict[str, Any]:
    fmt = spec.fmt
    return {
        "quant_method": "gptq", "bits": spec.bits, "group_size": spec.group_size, "desc_act": spec.desc_act,
        "sym": spec.sym, "checkpoint_format": fmt, "format": fmt, "pack_dtype": "int32", "lm_head": spec.quantize_lm_head,
        "true_sequential": spec.true_sequential, "damp_percent": spec.damp_percent, "static_groups": spec.static_groups, "mse": spec.mse,
        "model_name_or_path": None, "model_file_base_name": None,
        "meta": {"quantizer": [QUANTIZER], "method": spec.method,
                 **({"drift_alpha": spec.drift_alpha} if spec.drift_alpha else {})},
    }


def awq_config(spec: ExportSpec, not_converted: list[str]) -> dict[str, Any]:
    return {
        "quant_method": "awq", "bits": spec.bits, "w_bit": spec.bits, "group_size": spec.group_size,
        "q_group_size": spec.group_size, "zero_point": not spec.sym, "version": "gemm",
        "modules_to_not_convert": not_converted or None,
    }


def _qargs(bits: int, strategy: str, group_size: int | None, symmetric: bool, dynamic: bool = False,
           actorder: str | None = None) -> dict[str, Any]:
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, "group_size": group_size, "strategy": strategy,
            "dynamic": dynamic, "actorder": actorder, "block_structure": None, "observer": None if dynamic else "minmax",
            "observer_kwargs": {}}


def ct_config(spec: ExportSpec, ignore: list[str]) -> dict[str, Any]:
    if spec.fmt == "w8a8":
        weights = _qargs(8, "channel", None, True)
        acts: dict[str, Any] | None = _qargs(8, "token", None, True, dynamic=True)
        fmt = "int-quantized"
    else:
        grouped = spec.group_size != -1
        weights = _qargs(spec.bits, "group" if grouped else "channel", spec.group_size if grouped else None, spec.sym,
                         # static groups: act-order only chose the quantization order, no g_idx is stored ("weight")
                         actorder=("weight" if spec.static_groups else "group") if spec.desc_act else None)
        acts, fmt = None, "pack-quantized"
    return {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                      "output_activations": None, "format": fmt}},
        "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None, "version": "0.12.0",
    }


def quantization_config(spec: ExportSpec, float_linears: list[str]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(config.json quantization_config, quantize_config.json contents or None)``.

    ``float_linears``: linear layers left in float (lm_head unless quantized)."""
    if spec.fmt in ("gptq", "gptq_v2"):
        cfg = gptq_config(spec)
        return cfg, dict(cfg)
    if spec.fmt == "awq":
        return awq_config(spec, float_linears), None
    return ct_config(spec, float_linears), None
