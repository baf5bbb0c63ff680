"""Find a checkpoint's quantization config and match it with the method the user asked for (FORMATS.md §6.1).

Discovery order: ``config.json`` ``quantization_config``, its legacy key ``compression_config``,
``text_config.quantization_config`` (VLMs), then ``quantize_config.json`` / ``quant_config.json`` in the model
directory. Known string values are lower-cased (AutoAWQ writes ``"GEMM"``).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from lqe.quant_layers.awq import AWQConfig
from lqe.quant_layers.base import QuantConfig
from lqe.quant_layers.compressed_tensors import CompressedTensorsConfig
from lqe.quant_layers.fp8_checkpoint import Fp8Config, OnlineQuantConfig, log_online
from lqe.quant_layers.gptq import GPTQConfig

logger = logging.getLogger("lqe")

QUANT_METHODS: dict[str, type[QuantConfig]] = {
    "gptq": GPTQConfig,
    "awq": AWQConfig,
    "compressed-tensors": CompressedTensorsConfig,
    "fp8": Fp8Config,
}
# requested name -> (checkpoint methods it accepts, compressed-tensors scheme kinds it accepts or None for any)
ALIASES: dict[str, tuple[tuple[str, ...], tuple[str, ...] | None]] = {
    "gptq": (("gptq",), None),
    "awq": (("awq",), None),
    "compressed-tensors": (("compressed-tensors",), None),
    "compressed_tensors": (("compressed-tensors",), None),
    "w8a8": (("compressed-tensors",), ("w8a8_int8", "fp8")),
    "fp8": (("fp8", "compressed-tensors"), ("fp8",)),
    "int8": (("compressed-tensors",), ("w8a8_int8",)),
    # vLLM's names for its Marlin kernels: lqe runs these checkpoints with its own W4A16 kernels
    "gptq_marlin": (("gptq",), None),
    "awq_marlin": (("awq",), None),
    "marlin": (("gptq",), None),
}
VLLM_KERNEL_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "marlin": "gptq"}
# requested names that quantize an unquantized checkpoint at load time
ONLINE = {"fp8": "fp8", "int8": "int8"}
CONFIG_FILES = ("quantize_config.json", "quant_config.json")
LOWER_KEYS = ("quant_method", "method", "version", "format", "checkpoint_format", "quantization_status", "pack_dtype")


def _lower(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.lower() if k in LOWER_KEYS and isinstance(v, str) else v) for k, v in cfg.items()}


def find_quant_config(model_dir: str | None, hf_config: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """``(quantization config, where it was found)`` or ``None`` for an unquantized checkpoint."""
    for key in ("quantization_config", "compression_config"):
        if isinstance(hf_config.get(key), dict):
            return _lower(hf_config[key]), f"config.json {key}"
    text = hf_config.get("text_config")
    if isinstance(text, dict) and isinstance(text.get("quantization_config"), dict):
        return _lower(text["quantization_config"]), "config.json text_config.quantization_config"
    for name in CONFIG_FILES:
        path = os.path.join(model_dir or "", name)
        if model_dir and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return _lower(json.load(f)), name
    return None


def detect_method(cfg: dict[str, Any], where: str) -> str:
    """``quant_method`` (or GPTQModel's ``method``); legacy files without it are recognised by their keys."""
    method = cfg.get("quant_method") or cfg.get("method")
    if method:
        return str(method)
    if "w_bit" in cfg or "q_group_size" in cfg or where == "quant_config.json":
        return "awq"
    if "bits" in cfg and ("desc_act" in cfg or "sym" in cfg or where == "quantize_config.json"):
        return "gptq"
    raise ValueError(f"cannot tell the quantization method of the checkpoint: {where} has no 'quant_method' key")


def resolve_quant_config(model_dir: str | None, hf_config: dict[str, Any], requested: str | None) -> QuantConfig | None:
    """The parsed QuantConfig of the checkpoint, or ``None`` for an unquantized model when nothing was requested.

    ``requested`` (the user's ``quantization=``) must agree with the checkpoint: asking for "gptq" on an AWQ or
    an unquantized checkpoint is a ``ValueError`` saying what was found."""
    want = None
    if requested is not None:
        key = requested.strip().lower()
        if key not in ALIASES:
            raise ValueError(f"unknown quantization method {requested!r}; supported: {sorted(ALIASES)}")
        want = ALIASES[key]
        if key in VLLM_KERNEL_ALIASES:
            logger.info("quantization=%r is vLLM's name for %s checkpoints run by its Marlin kernel; lqe loads them as "
                        "%r and runs them on its own W4A16 kernels (the per-layer kernel is in the load summary)",
                        requested, VLLM_KERNEL_ALIASES[key].upper(), VLLM_KERNEL_ALIASES[key])
    found = find_quant_config(model_dir, hf_config)
    if found is None:
        if want is None:
            return None
        if key in ONLINE:
            log_online(ONLINE[key])
            return OnlineQuantConfig(ONLINE[key])
        raise ValueError(
            f"quantization={requested!r} was requested, but the checkpoint in {model_dir!r} has no quantization config "
            f"(looked in config.json quantization_config / compression_config / text_config, and {', '.join(CONFIG_FILES)}): "
            "it is unquantized. Omit quantization= to run it unquantized, or point model= at the quantized checkpoint.")
    cfg, where = found
    method = detect_method(cfg, where)
    if method not in QUANT_METHODS:
        raise ValueError(f"the checkpoint's quantization method {method!r} (from {where}) is not supported; "
                         f"lqe supports {sorted(QUANT_METHODS)}")
    if want is not None and method not in want[0]:
        raise ValueError(f"quantization={requested!r} was requested, but the checkpoint is quantized with {method!r} "
                         f"(from {where}). Pass quantization={method!r} or omit it to auto-detect.")
    try:
        config = QUANT_METHODS[method].from_hf_config({**cfg, "quant_method": method})
    except ValueError as e:  # name the file the bad value came from
        msg = str(e)
        raise ValueError(msg.replace("quantization_config: ", f"{where}: ", 1) if msg.startswith("quantization_config: ")
                         else f"{msg} (in {where})") from e
    if want is not None and want[1] is not None and isinstance(config, CompressedTensorsConfig):
        kinds = {s.kind for s in config.schemes}  # type: ignore[attr-defined]
        if not kinds <= set(want[1]):
            raise ValueError(f"quantization={requested!r} was requested, but this compressed-tensors checkpoint holds "
                             f"schemes {sorted(kinds)}; pass quantization='compressed-tensors' or omit it.")
    return config
