"""lqe GEMM kernels: CUDA W4A16/W8A16 dequant-GEMM, W8A8 int8 GEMM, per-token quantization, FP8 wrappers.

Importing never fails without CUDA or nvcc; the extension is JIT-built on first use on a GPU machine
(:mod:`lqe.kernels.build`). Use :func:`available` / :func:`unavailable_reason` before calling kernels, or
:func:`select_w4a16_kernel` / :func:`select_w8a8_kernel` / :func:`fp8_rowwise_reason`, which give the reason when
a kernel cannot run (the quant layers in :mod:`lqe.quant_layers` then use their torch paths).
"""
from lqe.kernels.gemm import (
    LARGE_M_THRESHOLD,
    available,
    select_w4a16_kernel,
    unavailable_reason,
    w4a16_gemm,
    wna16_dequantize,
    wna16_gemm,
)
from lqe.kernels.repack import PackedW8A8, PackedWNA16, repack_w8a8, repack_wna16
from lqe.kernels.w8a8 import (
    fp8_gemm,
    fp8_linear,
    fp8_rowwise_reason,
    quantize_per_token,
    select_w8a8_kernel,
    w8a8_gemm,
    w8a8_linear,
    w8a8_linear_static,
)

__all__ = [
    "LARGE_M_THRESHOLD", "PackedW8A8", "PackedWNA16", "available", "fp8_gemm", "fp8_linear", "fp8_rowwise_reason",
    "quantize_per_token", "repack_w8a8", "repack_wna16", "select_w4a16_kernel", "select_w8a8_kernel",
    "unavailable_reason", "w4a16_gemm", "w8a8_gemm", "w8a8_linear", "w8a8_linear_static", "wna16_dequantize",
    "wna16_gemm",
]
