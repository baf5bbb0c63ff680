"""lqe GEMM kernels: CUDA W4A16/W8A16 dequant-GEMM, W8A8 int8 GEMM, per-token quantization, FP8 wrappers.

Importing never fails without CUDA or nvcc; the extension is JIT-built on first use on a GPU machine
(:mod:`lqe.kernels.build`). Use :func:`available` / :func:`unavailable_reason` before calling kernels, or
:func:`select_w4a16_kernel`, which returns ``(None, reason)`` when the kernel cannot run.
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
from lqe.kernels.w8a8 import fp8_gemm, fp8_linear, quantize_per_token, w8a8_gemm, w8a8_linear

__all__ = [
    "LARGE_M_THRESHOLD", "PackedW8A8", "PackedWNA16", "available", "fp8_gemm", "fp8_linear", "quantize_per_token",
    "repack_w8a8", "repack_wna16", "select_w4a16_kernel", "unavailable_reason", "w4a16_gemm", "w8a8_gemm",
    "w8a8_linear", "wna16_dequantize", "wna16_gemm",
]
