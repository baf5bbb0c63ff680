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
# dequant + cuBLAS 0.51x at M=256 (triton-wna16 0.46x), 0.81x at M=1024 (2 shapes).
# H200, af342f8 (2026-11-27), graph-timed, the whole M sweep on the 4 Llama-3-8B shapes
# (benchmarks/results/kernels-w4a16-nvidia-h200.json; geo-mean / worst shape, x cuBLAS bf16 of the same run), which
# set the rows below:
#   M                        1          2          4          8          16         32         64         128        256
#   lqe-wna16-fused + PDL    1.69/1.58  1.62/1.49  1.41/1.25  1.09/0.90  0.78/0.57
#   lqe-wna16-fused          1.54/1.42  1.49/1.35  1.32/1.12  (the layer path of the old table: row "lqe-w4a16")
#   triton-wna16-swap        1.57/1.33  1.61/1.37  1.60/1.36  1.49/1.26  1.32/1.05  1.24/1.00  1.01/0.74  0.48/0.35
#   triton-wna16             1.08/0.92  1.11/0.94  1.11/0.94  1.04/0.88  0.96/0.84  0.90/0.78  0.67/0.58  0.65/0.47
#   triton-dequant+cublas    (the old table's layer path above M = 128)                                     0.50/0.47
# and at M=1024 triton-dequant+cublas 0.79x (triton-wna16 0.50x). (The CUDA dequantize of "dequant+cublas", at ~5 % of
# the byte floor then, writes whole rows through shared memory since stop 47, as the mma layout's does: 0.60x at
# M = 256 at 50fb9ce, below.) The swapped-operand GEMM takes M = 3..64 (the old
# table's 1.32 / 1.04 / 0.96 / 0.90 / 0.67x at M = 4 / 8 / 16 / 32 / 64 become 1.60 / 1.49 / 1.32 / 1.24 / 1.01x);
# the CUDA GEMV keeps M <= 2 with PDL (on by default on sm_90+: device_info.pdl_enabled), level with the swap GEMM at
# M = 2 but 9 % better on the worst shape. The mma layout (WNA16_MMA_TABLE) beats this table at M = 8 / 16 (1.51 /
# 1.44x) and 256 / 1024 (its dequantize + cuBLAS 0.59 / 0.84x), loses at M = 1 / 32 / 64 / 128 (1.57 / 1.13 / 0.63 /
# 0.50x): one layout per layer, so this one stays.
# H200, 50fb9ce (2026-11-28, stop 56), graph-timed: the M sweep at M = 1 / 16 / 64 / 256 on the 4 shapes
# (kernels-w4a16-nvidia-h200.json) and the triton-wna16 tile-config sweep at M = 128 / 256 / 1024 on 4096x6144 and
# 14336x4096 (kernels-wna16-sweep-nvidia-h200.json). The rows up to M = 64 hold (fused 1.69x at M = 1; swap 1.32 /
# 0.92x at 16 / 64). Two rows changed:
#   - M = 65..128: the swapped-operand GEMM with its 64-token config (m64n128k64, 8 warps; SWAP_CONFIG_TABLE's last
#     row since then) 0.69x at M = 128 (0.62 / 0.78x per shape), against 0.51x for triton-wna16 (the old row).
#   - above: the CUDA dequantize + cuBLAS ("dequant+cublas"), 0.60x at M = 256 (0.55-0.63x per shape) against the
#     Triton dequantize's 0.51x; its dequantize is faster on every shape at every M measured (1 / 16 / 64 / 256), and
#     the cuBLAS GEMM after it is the same, so it keeps M = 1024 (the Triton one 0.79x there; the CUDA one not timed).
#   At M = 256 the swap GEMM's 64-token config ran 0.62x on the two swept shapes (0.55 / 0.70x), against 0.58x for
#   dequant+cublas on the same two; not timed on the other two shapes, so M = 129..256 stays with dequant+cublas until
#   a sweep with all four does (the candidate WNA16_SWAP_TABLE below runs the swap GEMM to 256 in a model).
# The smollm2-shape e2e rows of 50fb9ce (e2e-nvidia-h200.json) ran the table before this change: w4a16 932 / 9,754
# tok/s at batch 1 / 16 (af342f8's table: 920 / 8,428, both with PDL).
WNA16_TABLE: list[tuple[int | None, str]] = [
    (2, "lqe-wna16-fused"),  # 1.69 / 1.62x cuBLAS bf16 at M = 1 / 2 with PDL (H200, af342f8; 1.69x at M=1, 50fb9ce)
    (128, "triton-wna16-swap"),  # 1.60 / 1.49 / 1.32 / 1.24 / 1.01x at M = 4..64 (af342f8); 0.69x at 128 (50fb9ce)
    (None, "dequant+cublas"),  # 0.60x at M=256 (50fb9ce; the Triton dequantize 0.51x), the same cuBLAS GEMM after it
]
# "triton-wna16-swap" (lqe/kernels/triton_wna16.py, swap_ab; its configs per M in SWAP_CONFIG_TABLE): the same Triton
# GEMM on the same packed weights computing out^T = W^T x^T, so on Hopper the dequantized weights are wgmma's register
# operand (never stored to shared memory) and the tokens are wgmma's N (M = 16 is not padded to 64 rows). In
# WNA16_TABLE since af342f8's H200 sweep (above); this candidate table (LQE_WNA16_TABLE=swap, e2e variant w4a16-swap)
# runs it from M = 5 to 256 instead, the guess it was written with.
# "triton-dequant-l2+cublas" (triton_wna16.dequant_matmul with l2_chunk_cols): dequantize + cuBLAS in column chunks
# that fit in half the L2, each chunk's GEMM right after its dequantize. Measured on the H200 at af342f8: 0.38 / 0.43 /
# 0.73x at M = 128 / 256 / 1024, below the whole dequantize + cuBLAS (0.50x at 256, 0.79x at 1024): not in a table.
WNA16_SWAP_TABLE: list[tuple[int | None, str]] = [
    (4, "lqe-wna16-fused"),
    (256, "triton-wna16-swap"),  # 0.62x at M = 256 on 2 of the 4 shapes (50fb9ce), against dequant+cublas's 0.58x there
    (None, "dequant+cublas"),
]
# "lqe-wna16-ring" (csrc/gemm/wna16_gemm.cu, RING): the CUDA GEMV with its weights streamed through a per-warp
# cp.async ring (3 batches of 2 KB in flight per warp, counted waits) instead of the register double buffer, which a
# SASS review found waiting on every batch issued (one shared scoreboard: ~2 KB in flight per warp, predicted 35-52 %
# of the copy bandwidth; measured 0.4-0.9 TB/s of 4.25 at 0ebe3f7); its split-K tail takes one release-acquire atomic
# instead of two fences per thread and loads the bias before the sums. Same results, bit for bit. Measured on the H200
# at af342f8 (kernels-w4a16-nvidia-h200.json, row "lqe-w4a16-fused-ring"): 1.28 / 1.24 / 1.11 / 0.88 / 0.66x cuBLAS
# bf16 at M = 1 / 2 / 4 / 8 / 16, against the register double buffer's 1.54 / 1.49 / 1.32 / 1.04 / 0.96x; with PDL
# 1.37 / 1.18x at M = 1 / 4 against 1.69 / 1.41x. The ring loses at every M, so this table stays a candidate
# (LQE_WNA16_TABLE=ring, e2e variant w4a16-ring).
WNA16_RING_TABLE: list[tuple[int | None, str]] = [
    (16, "lqe-wna16-ring"),
    (128, "triton-wna16"),
    (None, "triton-dequant+cublas"),
]
# "lqe-w4a16-mma" (issue 24; csrc/gemm/w4a16_mma.cu): the Marlin-class tensor-core GEMM (persistent stripes,
# 4-stage cp.async, in-L2 reduction; 64-row problems), on its own weight layout (lqe/kernels/repack_mma.py), with
# "lqe-w4a16-mma-dequant+cublas" (its dequantize, then cuBLAS) above the crossover. Not the default (the comparison
# with WNA16_TABLE is above it): benchmarks/kernels.py times it as the candidate (rows "lqe-w4a16-mma*") and prints the
# table its measurement implies (kernels.py --w4a16). To run it in a model: LQE_WNA16_TABLE=mma, or put its rows
# here. A table naming lqe-w4a16-mma repacks layers into the mma layout, which serves only these two
# names (a wna16-layout row resolves to its mma counterpart: one copy of the weights per layer).
# Measured on the H200 at 0ebe3f7 (graph-timed): 0.51 / 0.44 / 0.20x cuBLAS bf16 at M = 1 / 16 / 64, about 10x its
# byte floor: a serialized in-L2 reduction (7 handoffs per column tile, each a chain of L2 round trips) and a main
# loop bound by instruction issue. Above M = 64 each 64-row problem is a launch of its own (M=256: 0.08x), so the
# crossover is 64 until one launch serves them. Since then (not measured): the reduction is one slot per piece; a
# k-tile's one scale group fetched once (group sizes 2^n >= 64, channel-wise), the piece loop and hoisted addresses
# (one warp's static schedule per k-tile 922 -> 641 cycles at M <= 16, 1560 -> 1128 at 64; a single warp per SM
# sub-partition, so latency-bound: the "-2cta" row runs two blocks per SM); an 8-stage ring at M <= 16.
# Measured on the H200 at af342f8 (kernels-w4a16-nvidia-h200.json, 4 shapes): 1.57 / 1.58 / 1.51 / 1.44 / 1.13 / 0.63 /
# 0.38x at M = 1 / 4 / 8 / 16 / 32 / 64 / 128 (three times 0ebe3f7's at M = 1 and 16); "-2cta" 1.59 / 1.31 / 0.42x
# at M = 1 / 16 / 64; its dequantize + cuBLAS 0.59 / 0.84x at M = 256 / 1024 (the rows it implied: mma to 64).
# Candidate since stop 47 (measured at 50fb9ce, below): "lqe-w4a16-mma-k2" (gemm_mma.MMA_K2_KERNEL), the same GEMM
# with 8 warps per block splitting each k-tile (g a power of two >= 64, or channel-wise), the in-block form of
# "-2cta" (which won on the 4096 x 28672 shape and lost on the small ones), whose k = 0 pieces read the other pieces'
# slots with both warp groups (the reduction below); benchmarks/kernels_w4a16.py times it at every M beside
# lqe-w4a16-mma, and a table row may name it. Seen in the same rows, left for later: per 64-row problem the mma GEMM
# takes ~30 us on 4096 x 4096 at any M > 32 (M = 64 / 128 / 1024: 30.5 / 61.0 / 488.9 us, 16 problems), ~7x one warp's
# static k-tile schedule (1128 cycles x 7.75 k-tiles per block), while 4096 x 28672 (~2 pieces per column tile) runs at
# ~2x it: the k = 0 piece's block reading the 7 other pieces' 64 x 256 fp32 slots from L2 (448 KB, one block, 4 round
# trips per slot) is the likely cost at 8 pieces per tile.
# Measured on the H200 at 50fb9ce (kernels-w4a16-nvidia-h200.json, 4 shapes, M = 1 / 16 / 64 / 256): the k-split GEMM
# "lqe-w4a16-mma-k2" 1.55 / 1.41 / 0.72 / 0.28x, lqe-w4a16-mma 1.58 / 1.44 / 0.62 / 0.24x: k2 wins at M = 64 on every
# shape (0.86 / 1.03 / 0.48 / 0.62x against 0.75 / 1.03 / 0.37 / 0.51x), loses at 1 and 16, and on 4096 x 28672 at
# M = 1 it ran 32.8 us, not the ~26 predicted ("-2cta" 25.9 us, mma 31.4). The rows below are what the run implies
# (M = 32 not timed: k2 from 17 on). Against WNA16_TABLE this layout loses at M = 1 and 64 (1.58 / 0.72 against
# 1.69 / 0.92x), ties at 256 (dequantize + cuBLAS both, 0.60x) and wins only at 16 (1.44 against 1.32x): one layout
# per layer, so WNA16_TABLE stays the default.
WNA16_MMA_TABLE: list[tuple[int | None, str]] = [
    (16, "lqe-w4a16-mma"),  # 1.58 / 1.44x at M = 1 / 16 (50fb9ce)
    (64, "lqe-w4a16-mma-k2"),  # 0.72x at M = 64 (mma 0.62x)
    (None, "lqe-w4a16-mma-dequant+cublas"),  # 0.60x at M = 256
]
# The k-split GEMM at every M up to 64 (candidate): LQE_WNA16_TABLE=mma-k2, e2e variant w4a16-mma-k2.
WNA16_MMA_K2_TABLE: list[tuple[int | None, str]] = [
    (64, "lqe-w4a16-mma-k2"),
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
# Re-measured at af342f8 on the 4 shapes (kernels-nvidia-h200.json, graph-timed, PDL on; geo-mean / worst shape) at
# M = 1 / 16 / 64 / 256 / 1024: triton-gemv 1.84 / 1.57x; int-mm+epilogue 1.10x at 64 (triton-w8a8 0.70x), 0.84x at
# 256 (triton-w8a8 1.03x), 1.03x at 1024 (triton-w8a8 1.54x): the rows below hold. The layer a model runs
# (lqe-w8a8-layer: the activation quantization in its producer, then this table) 1.49 / 1.34 / 1.01 / 0.98 / 1.40x,
# against issue 25's 1.7 / 1.6 / 1.5 / 1.5 / 1.6.
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
# Re-measured at af342f8 on the 4 shapes (as W8A8 above): M=1 triton-gemv 1.67x (triton-fp8 1.43x); M=16 triton-fp8
# 1.57x (gemv 1.54x); M=64 triton-fp8 1.15x (scaled-mm 1.05x); M=256 scaled-mm 1.41x (triton-fp8 1.34x); M=1024
# triton-fp8 1.71x, scaled-mm 1.66x (worst shape 1.59 / 1.60x: no row changed for it). The layer (lqe-fp8-layer)
# 1.34 / 1.28 / 1.00 / 1.29 / 1.51x at M = 1 / 16 / 64 / 256 / 1024.
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
