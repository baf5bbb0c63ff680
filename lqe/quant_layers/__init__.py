"""Quantized linear methods and checkpoint detection.

``QUANT_METHODS`` maps a method name to its :class:`QuantConfig`; :func:`resolve_quant_config` finds the
checkpoint's quantization config and checks it against what the user asked for.
"""
from lqe.quant_layers.awq import AWQConfig
from lqe.quant_layers.base import LinearMethod, QuantConfig
from lqe.kernels.canonical import CanonicalWeight
from lqe.quant_layers.compressed_tensors import CompressedTensorsConfig
from lqe.quant_layers.gptq import GPTQConfig
from lqe.quant_layers.resolve import QUANT_METHODS, find_quant_config, resolve_quant_config
from lqe.quant_layers.unquantized import UnquantizedLinearMethod
from lqe.quant_layers.weight_only import QuantWarning
from lqe.quant_layers.wna16_kernels import select_w4a16_kernel

__all__ = [
    "AWQConfig", "CanonicalWeight", "CompressedTensorsConfig", "GPTQConfig", "LinearMethod", "QUANT_METHODS", "QuantConfig",
    "QuantWarning", "UnquantizedLinearMethod", "find_quant_config", "resolve_quant_config", "select_w4a16_kernel",
]
