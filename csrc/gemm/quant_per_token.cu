// Fused per-token (per-row) dynamic int8 quantization of activations, one block per row.
//   sym : scale = absmax/127, q = sat_s8(rint(x * (127/absmax)))                 (absmax == 0 -> 0, 0)
//   asym: lo = min(min x, 0), hi = max(max x, 0), scale = (hi-lo)/255,
//         azp = rint(-128 - lo/scale), q = sat_s8(rint(x/scale) + azp)           (scale == 0 -> q = azp = 0)
// rint is round-half-even (cvt.rni); every fp32 op is IEEE-rounded so the torch twin
// (lqe/kernels/gemm_ref.py::quantize_per_token_ref) reproduces it bit for bit.
#include "gemm_common.cuh"
#include "gemm_launch.h"

namespace lqe {
namespace {

constexpr int kQThreads = 256;

__device__ __forceinline__ float block_reduce(float v, bool is_max, float* sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, other) : fminf(v, other);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  v = sh[0];
  for (int w = 1; w < kQThreads / 32; ++w) v = is_max ? fmaxf(v, sh[w]) : fminf(v, sh[w]);
  return v;
}

__device__ __forceinline__ int8_t sat_s8(int v) { return (int8_t)max(-128, min(127, v)); }

template <typename T, bool ASYM>
__global__ void __launch_bounds__(kQThreads) quant_per_token_kernel(const T* __restrict__ x, int8_t* __restrict__ q,
                                                                  float* __restrict__ scale, int32_t* __restrict__ azp,
                                                                  int K) {
  __shared__ float sh[kQThreads / 32];
  const T* xr = x + (size_t)blockIdx.x * K;
  int8_t* qr = q + (size_t)blockIdx.x * K;
  float hi = 0.f, lo = 0.f;  // both include 0 (sym uses hi as absmax)
  for (int k = threadIdx.x; k < K; k += kQThreads) {
    const float v = to_f(xr[k]);
    if (ASYM) { hi = fmaxf(hi, v); lo = fminf(lo, v); }
    else hi = fmaxf(hi, fabsf(v));
  }
  hi = block_reduce(hi, true, sh);
  if (ASYM) lo = block_reduce(lo, false, sh);
  if (!ASYM) {
    const float inv = hi > 0.f ? __fdiv_rn(127.f, hi) : 0.f;
    if (threadIdx.x == 0) scale[blockIdx.x] = __fdiv_rn(hi, 127.f);
    for (int k = threadIdx.x; k < K; k += kQThreads) qr[k] = sat_s8(__float2int_rn(__fmul_rn(to_f(xr[k]), inv)));
  } else {
    const float s = __fdiv_rn(__fsub_rn(hi, lo), 255.f);
    const int zp = s > 0.f ? __float2int_rn(__fsub_rn(-128.f, __fdiv_rn(lo, s))) : 0;
    if (threadIdx.x == 0) { scale[blockIdx.x] = s; azp[blockIdx.x] = zp; }
    for (int k = threadIdx.x; k < K; k += kQThreads)
      qr[k] = s > 0.f ? sat_s8(__float2int_rn(__fdiv_rn(to_f(xr[k]), s)) + zp) : (int8_t)0;
  }
}

template <typename T>
void run(const void* x, int8_t* q, float* scale, int32_t* azp, int M, int K, cudaStream_t st) {
  if (azp) quant_per_token_kernel<T, true><<<M, kQThreads, 0, st>>>((const T*)x, q, scale, azp, K);
  else quant_per_token_kernel<T, false><<<M, kQThreads, 0, st>>>((const T*)x, q, scale, nullptr, K);
}

}  // namespace

const char* launch_quantize_per_token(DType dt, const void* x, int8_t* q, float* scale, int32_t* azp, int M, int K,
                                      cudaStream_t st) {
  if (M <= 0) return nullptr;
  if (dt == DType::kHalf) run<half>(x, q, scale, azp, M, K, st);
  else run<__nv_bfloat16>(x, q, scale, azp, M, K, st);
  return nullptr;
}

}  // namespace lqe
