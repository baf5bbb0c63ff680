// Host launcher of lqe-w4a16-mma (csrc/gemm/w4a16_mma.cu), the Marlin-class W4A16 / W8A16 tensor-core GEMM.
// Plain C++ (no torch); csrc/gemm/bindings.cpp validates tensors and calls it. Layout: lqe/kernels/repack_mma.py.
#pragma once
#include <cuda_runtime.h>

#include "gemm_launch.h"

namespace lqe {

constexpr int kMmaTileK = 64;    // K rows per cp.async pipeline stage
constexpr int kMmaTileN = 256;   // N columns per block tile (4 warps x 64)
constexpr int kMmaMaxRows = 64;  // rows of one launch; a larger M runs as several 64-row problems

// y[M,N] = x[M,K] @ W (+ bias). x / out / bias in the activation dtype, row-major; K % 8 == 0, N % 8 == 0.
// qweight: the repacked [k_pad x n_pad] codes; scales/zeros: [groups, n_pad] (zeros may be null = symmetric).
// ws: ws_elems >= mma_workspace_slots(n_pad / 256, k_pad / 64, sms) * kMmaMaxRows * n_pad floats (the partial
// sums of the pieces above k = 0 of each column tile, in L2); locks: >= n_pad / kMmaTileN ints, zero (the kernel
// leaves them zero). sms: blocks to stripe over (the SM count, or a multiple). warps_k: 1, or 2 for 8 warps per
// block splitting each k-tile's slabs where every k-tile lies in one scale group (group size a power of two >= 64,
// or channel-wise) and the device's shared memory holds the hand-over buffer; elsewhere 2 runs as 1.
// Stream-ordered: one launch at a time may use ws/locks.
const char* launch_w4a16_mma(DType dt, int bits, const void* x, const void* qweight, const void* scales,
                             const void* zeros, const void* bias, void* out, float* ws, size_t ws_elems, int* locks,
                             int M, int N, int K, int k_pad, int n_pad, int group_size, int groups, int sms,
                             int warps_k, cudaStream_t stream);

// The workspace slots a launch's stripe plan needs: the most pieces above k = 0 that one column tile has
// (lqe/kernels/mma_ref.py workspace_slots is the same function).
int mma_workspace_slots(int n_tiles, int k_tiles, int sms);

// W[K, N] (row-major, sorted-K order, padding dropped) = the dequantized weights, bit-identical to the GEMM's
// B fragments: the dequantize + cuBLAS path for large M.
const char* launch_w4a16_mma_dequant(DType dt, int bits, const void* qweight, const void* scales, const void* zeros,
                                     void* out, int N, int K, int k_pad, int n_pad, int group_size, int groups,
                                     cudaStream_t stream);

}  // namespace lqe
