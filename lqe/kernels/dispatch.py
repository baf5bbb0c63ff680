"""Which kernel runs for which format, dtype and token count M: the one table a reader looks at.

Each format has a list of ``(max_m, kernel)`` rows, walked in order: the first row whose ``max_m`` is at least
the layer call's M wins (``None`` = no upper bound). The quant layers ask :func:`pick` at call time (on the
host, from shapes only, so a CUDA-graph capture fixes the choice per batch bucket). The rows are set by
measurement on the GPU named in each section (``benchmarks/kernels.py``); a kernel that cannot take a layer
(shape, dtype, build) is skipped with its reason by the selection code of that format.
"""
from __future__ import annotations

# ------------------------------------------------------------------------------------------------ W4A16 / W8A16
# (owned by the W4A16 kernel work: lqe/kernels/gemm.py and friends)
# Kernels: "lqe-wna16-fused" (CUDA, csrc/gemm/wna16_gemm.cu), "triton-wna16" (lqe/kernels/triton_wna16.py,
# tensor cores, configs per M in its CONFIG_TABLE), "triton-dequant+cublas" (Triton dequantize at memory speed,
# then cuBLAS), "dequant+cublas" (the CUDA dequantize, then cuBLAS). All read the same packed weights. A kernel
# that is unavailable (no triton, extension not built) is replaced by its counterpart (lqe/kernels/gemm.py).
# Rows set from one H100 run of benchmarks/kernels.py (2026-11-22, lqe f1c96af): every W4A16 path is still
# slower than bf16 from M = 16 on (issue 14); the Triton configs have not been swept yet (--wna16-sweep).
WNA16_TABLE: list[tuple[int | None, str]] = [  # H100, benchmarks/results/kernels-nvidia-h100-80gb-hbm3.json
    (16, "lqe-wna16-fused"),  # geo-mean over the 4 Llama-3-8B shapes vs cuBLAS bf16: 1.8x (M=1), 1.1x (8), 0.78x (16)
    (64, "triton-wna16"),  # 0.92x (M=32), 0.64x (64)
    (None, "triton-dequant+cublas"),  # 0.55x (128), 0.58x (256), 0.76x (1024)
]

# ------------------------------------------------------------------------------------------------ W8A8 int8 / FP8
# (owned by the W8A8 kernel work: lqe/kernels/w8a8.py and friends)
# Kernels: "triton-w8a8" (lqe/kernels/triton_w8a8.py: int8 tensor-core GEMM + fused epilogue on the checkpoint's
# int8 [N, K]; split-K weight streaming for small M; tile configs per M bucket in triton_w8a8.CONFIGS),
# "int-mm+epilogue" (torch._int_mm = cuBLASLt int8, M > 16 only, then a Triton epilogue; same weight tensor),
# "lqe-w8a8" (csrc/gemm/w8a8_gemm.cu; needs its own fragment-packed copy of the weights: naming it here keeps a
# second copy of every W8A8 weight in memory). Not yet set by measurement: guessed from the H100 numbers of
# issue 15 (cuBLASLt int8 1.5x bf16 at M=32-64, about 1.0x from M=256; lqe-w8a8 1.1-1.5x at M=1 only).
W8A8_TABLE: list[tuple[int | None, str]] = [
    (16, "triton-w8a8"),
    (128, "int-mm+epilogue"),
    (None, "triton-w8a8"),
]


def pick(table: list[tuple[int | None, str]], m: int) -> str:
    """The kernel name of the first row of ``table`` that covers ``m`` tokens."""
    for max_m, name in table:
        if max_m is None or m <= max_m:
            return name
    raise ValueError(f"kernel table has no row for M={m}: its last row must have max_m=None")
