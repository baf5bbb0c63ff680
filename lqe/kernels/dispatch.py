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
# H100, 2026-11-22: benchmarks/results/kernels-nvidia-h100-80gb-hbm3.json (Llama-3-8B layer shapes) and
# e2e-nvidia-h100-80gb-hbm3.json. The layer benchmark favours the CUDA kernel up to M=16 (geo-mean 1.1x bf16 at
# M=8, 0.78x at 16, Triton 0.62x at 16); but with that table the e2e decode at batch 16 fell from 7585 to 3621
# tok/s (smollm2 shape, K=576) and from 4889 to 2642 (qwen2.5-0.5b shape), so the Triton GEMM keeps M=5..128.
# Every W4A16 path is still slower than bf16 from M=16 on for N <= 6144 (issue 14); the Triton configs have not
# been swept yet (benchmarks/kernels.py --wna16-sweep).
# H200, 0ebe3f7, graph-timed (benchmarks/results/kernels-graph-nvidia-h200.json, geo-mean over the 4 shapes): the
# CUDA kernel 1.40x at M=1, 1.05x at M=4 (triton-wna16 1.07x); triton-wna16 0.88x at M=16, 0.62x at M=64;
# dequant + cuBLAS 0.51x at M=256 (triton-wna16 0.46x), 0.81x at M=1024 (2 shapes): the rows below hold. The CUDA
# kernel streamed its weights at 0.4-0.9 TB/s of 4.25 (its loads now run ahead of its compute: not measured yet).
WNA16_TABLE: list[tuple[int | None, str]] = [
    (4, "lqe-wna16-fused"),  # 1.5-2.1x cuBLAS bf16 at M=1 (H100, eager)
    (128, "triton-wna16"),  # 0.2-1.5x: good on wide N (gate_up 1.5x), poor on N=4096-6144 at M<=16 (0.2-0.3x)
    (None, "triton-dequant+cublas"),  # 0.5-0.8x: the dequantize runs at 85 % of copy bandwidth, then cuBLAS
]
# "triton-wna16-swap" (lqe/kernels/triton_wna16.py, swap_ab; its configs per M in SWAP_CONFIG_TABLE): the same Triton
# GEMM on the same packed weights computing out^T = W^T x^T, so on Hopper the dequantized weights are wgmma's register
# operand (never stored to shared memory) and the tokens are wgmma's N (M = 16 is not padded to 64 rows). NOT
# MEASURED YET: benchmarks/kernels.py times it as the row "triton-wna16-swap" beside "triton-wna16"; a model runs it
# on WNA16_SWAP_TABLE with LQE_WNA16_TABLE=swap (e2e_gpu.py's variant w4a16-swap), the hypothesis to measure: the
# swapped GEMM in place of triton-wna16, and above it while its 128-token tiles beat dequantize + cuBLAS.
# "triton-dequant-l2+cublas" (triton_wna16.dequant_matmul with l2_chunk_cols): dequantize + cuBLAS in column chunks
# that fit in half the L2, each chunk's GEMM right after its dequantize. NOT MEASURED YET: benchmarks/kernels.py times
# it beside "triton-dequant+cublas"; the hypothesis is that cuBLAS reads each chunk from L2, so at large M (where
# dequantize + cuBLAS is ~0.75x bf16: the dense weights' round trip through HBM) it nears cuBLAS bf16 itself.
WNA16_SWAP_TABLE: list[tuple[int | None, str]] = [
    (4, "lqe-wna16-fused"),
    (256, "triton-wna16-swap"),  # guessed crossover
    (None, "triton-dequant+cublas"),
]
# "lqe-wna16-ring" (csrc/gemm/wna16_gemm.cu, RING): the CUDA GEMV with its weights streamed through a per-warp
# cp.async ring (3 batches of 2 KB in flight per warp, counted waits) instead of the register double buffer, which a
# SASS review found waiting on every batch issued (one shared scoreboard: ~2 KB in flight per warp, predicted 35-52 %
# of the copy bandwidth; measured 0.4-0.9 TB/s of 4.25 at 0ebe3f7); its split-K tail takes one release-acquire atomic
# instead of two fences per thread and loads the bias before the sums. Same results, bit for bit. NOT MEASURED: the row
# "lqe-w4a16-fused-ring" (benchmarks/kernels.py), LQE_WNA16_TABLE=ring (e2e variant w4a16-ring); the crossover to
# triton-wna16 is a guess.
WNA16_RING_TABLE: list[tuple[int | None, str]] = [
    (16, "lqe-wna16-ring"),
    (128, "triton-wna16"),
    (None, "triton-dequant+cublas"),
]
# "lqe-w4a16-mma" (issue 24; csrc/gemm/w4a16_mma.cu): the Marlin-class tensor-core GEMM (persistent stripes,
# 4-stage cp.async, in-L2 reduction; 64-row problems), on its own weight layout (lqe/kernels/repack_mma.py), with
# "lqe-w4a16-mma-dequant+cublas" (its dequantize, then cuBLAS) above the crossover. NOT MEASURED YET, so it is
# not the default: benchmarks/kernels.py times it as the candidate (rows "lqe-w4a16-mma*") and prints the table
# its measurement implies (kernels.py --w4a16). To run it in a model before that: LQE_WNA16_TABLE=mma, or put
# its rows here. A table naming lqe-w4a16-mma repacks layers into the mma layout, which serves only these two
# names (a wna16-layout row resolves to its mma counterpart: one copy of the weights per layer).
# Measured on the H200 at 0ebe3f7 (graph-timed): 0.51 / 0.44 / 0.20x cuBLAS bf16 at M = 1 / 16 / 64, about 10x its
# byte floor: a serialized in-L2 reduction (7 handoffs per column tile, each a chain of L2 round trips) and a main
# loop bound by instruction issue. Above M = 64 each 64-row problem is a launch of its own (M=256: 0.08x), so the
# crossover is 64 until one launch serves them. Since then (not measured): the reduction is one slot per piece; a
# k-tile's one scale group fetched once (group sizes 2^n >= 64, channel-wise), the piece loop and hoisted addresses
# (one warp's static schedule per k-tile 922 -> 641 cycles at M <= 16, 1560 -> 1128 at 64; a single warp per SM
# sub-partition, so latency-bound: the "-2cta" row runs two blocks per SM); an 8-stage ring at M <= 16.
WNA16_MMA_TABLE: list[tuple[int | None, str]] = [
    (64, "lqe-w4a16-mma"),
    (None, "lqe-w4a16-mma-dequant+cublas"),
]

# ------------------------------------------------------------------------------------------------ W8A8 int8 / FP8
# (owned by the W8A8 kernel work: lqe/kernels/w8a8.py and friends)
# Kernels: "triton-gemv" (lqe/kernels/triton_gemv_w8a8.py: M <= 16 only; weight streaming over many CTAs,
# deterministic split-K, fused per-token x per-channel epilogue), "triton-w8a8" (lqe/kernels/triton_w8a8.py:
# int8 tensor-core GEMM + fused epilogue on the checkpoint's int8 [N, K]; split-K weight streaming for small M; tile
# configs per M bucket in triton_w8a8.CONFIGS), "int-mm+epilogue" (torch._int_mm = cuBLASLt int8, M > 16 only, then
# a Triton epilogue; same weight tensor), "lqe-w8a8" (csrc/gemm/w8a8_gemm.cu; needs its own fragment-packed copy of
# the weights: naming it here keeps a second copy of every W8A8 weight in memory).
# Measured on the H200 at 0ebe3f7 (2026-11-27; graph-timed, benchmarks/results/kernels-graph-nvidia-h200.json, geo-mean
# over the Llama-3-8B shapes, x cuBLAS bf16): triton-gemv 1.27x at M=1 (lqe-w8a8 1.42x, but it keeps a second copy
# of the weights), 1.46x at M=16 (M = 2..8 ran a CUDA-core config then, 0.24x at M=4: triton_gemv_w8a8.CONFIGS now
# gives them the M=16 one); int-mm+epilogue 1.11x at M=64 (triton-w8a8 0.66x); triton-w8a8 1.05x at M=256
# (int-mm+epilogue 0.84x) and 1.66x at M=1024 (2 shapes). M = 128 is not measured. The eager H200 run of 3382fc4
# (kernels-eager-nvidia-h200.json) timed Python launches at small M, not the kernels: see benchmarks/kernels.py.
# Re-measured at 257cdec (graph-timed, kernels-nvidia-h200.json, 4096x6144 and 4096^2 only): with the M=16 config at
# M=2..16 the GEMV runs 1.21x at M=4 (0.28x before) and 1.30x at M=16; with the integer int8->fp32 conversion 1.49x
# at M=1 (1.21x on the same two shapes before); the layer path (lqe-w8a8-layer) 1.33 / 1.09 / 1.15x at M=1 / 4 / 16.
W8A8_TABLE: list[tuple[int | None, str]] = [
    (16, "triton-gemv"),
    (128, "int-mm+epilogue"),
    (None, "triton-w8a8"),
]

# FP8 e4m3 W8A8 (per-tensor / per-channel weight scales, per-token or static activation scales):
# "triton-gemv" (the GEMV above, fp8 x fp8, M <= 16), "scaled-mm" (torch._scaled_mm, row-wise scales, any M),
# "triton-fp8" (lqe/kernels/triton_fp8.py: tiled fp8 GEMM with the per-token x per-channel epilogue fused).
# Measured on the H200 at 0ebe3f7 (as above): M=1 triton-gemv 1.64x (triton-fp8 1.36x, scaled-mm 0.92x); M=16
# triton-fp8 1.55x (gemv 1.45x); M=64 triton-fp8 1.19x (scaled-mm 1.04x); M=256 scaled-mm 1.40x (triton-fp8 1.35x);
# M=1024 1.80x / 1.86x (2 shapes). `benchmarks/kernels.py --fp8-sweep` prints the FP8_TABLE and configs a run implies.
FP8_TABLE: list[tuple[int | None, str]] = [
    (1, "triton-gemv"),
    (64, "triton-fp8"),
    (None, "scaled-mm"),
]

# FP8 block-scaled (128x128 weight blocks, 1x128 activation groups: DeepSeek-V3 / llm-compressor FP8 block): one
# Triton kernel for every M (lqe/kernels/triton_fp8.py, split-K for small M; its tiles per M in BLOCK_CONFIGS). No
# library alternative in torch. Read by lqe/kernels/w8a8.fp8_block_apply_quantized (which refuses a name it has no
# kernel for) and reserve_fp8_workspaces.
FP8_BLOCK_TABLE: list[tuple[int | None, str]] = [
    (None, "triton-fp8-block"),
]


def pick(table: list[tuple[int | None, str]], m: int) -> str:
    """The kernel name of the first row of ``table`` that covers ``m`` tokens."""
    for max_m, name in table:
        if max_m is None or m <= max_m:
            return name
    raise ValueError(f"kernel table has no row for M={m}: its last row must have max_m=None")
