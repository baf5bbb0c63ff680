// Host launchers of the lqe GEMM kernels. Plain C++ (no torch), so the .cu files compile fast and alone;
// csrc/gemm/bindings.cpp validates torch tensors and calls these. Each returns nullptr on success or a
// static string naming why the launch was refused (the caller turns it into an exception).
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace lqe {

enum class DType : int { kHalf = 0, kBFloat16 = 1 };

constexpr int kWna16Threads = 128;    // 4 warps, each owns one 64-column tile
constexpr int kWna16BlockN = 256;     // columns per block
constexpr int kW8a8Threads = 128;
constexpr int kW8a8BlockN = 256;

// y[M,N] = x[M,K] @ W, W in the repacked 4/8-bit layout. When splits > 1, ws holds splits*M*N floats and
// counters >= gridDim.x*gridDim.y ints that are zero (the kernel leaves them zero).
// slabs_per_split: K/16 slabs per split, a multiple of 4; splits = ceil((K/16) / slabs_per_split). ring: at M <= 16
// the weights stream through a per-warp cp.async ring (the "lqe-wna16-ring" candidate; same results). pdl:
// launched with programmatic dependent launch (sm_90+ only): its first weight batches are requested, and at M <= 16
// its next 8 KB per warp pulled into L2, while the kernel before it on the stream finishes (gemm_common.cuh
// pdl_wait; same results).
const char* launch_wna16_gemm(DType dt, int bits, const void* x, const void* qweight, const void* scales,
                              const void* zeros, const void* bias, void* out, float* ws, int* counters, int M,
                              int N, int K, int group_size, int slabs_per_split, bool ring, bool pdl,
                              cudaStream_t stream);

// W[K,N] (row-major, in the repacked K order) = dequantized weights, for the dequantize + cuBLAS path.
const char* launch_wna16_dequant(DType dt, int bits, const void* qweight, const void* scales, const void* zeros,
                                 void* out, int N, int K, int group_size, cudaStream_t stream);

// out[M,N] = a_scale[m] * w_scale[n] * (xq @ Wq - azp[m] * colsum[n]) + bias[n]; azp/colsum/bias optional.
// slabs_per_split counts K/32 slabs, a multiple of 2.
const char* launch_w8a8_gemm(DType dt, const int8_t* xq, const void* wq, const float* a_scale,
                             const int32_t* azp, const float* w_scale, const int32_t* colsum, const void* bias,
                             void* out, int32_t* ws, int* counters, int M, int N, int K, int slabs_per_split,
                             cudaStream_t stream);

// Per-token dynamic int8 quantization of x[M,K]: sym (azp == nullptr) or asym.
const char* launch_quantize_per_token(DType dt, const void* x, int8_t* q, float* scale, int32_t* azp, int M,
                                      int K, cudaStream_t stream);

}  // namespace lqe
