// Fused per-token (per-row) dynamic int8 quantization of activations, one block per row.
//
// The contract is lqe/quant_layers/reference/w8a8.py::per_token_quant_int8 evaluated with IEEE fp32 ops (as torch
// does on CPU). Every fp32 operation below is one correctly rounded IEEE op written as an intrinsic, so nvcc cannot
// contract it into an fma or replace a division by a reciprocal multiply:
//   sym : absmax = max_k |x[k]|                      (exact: fp16/bf16 -> fp32 is exact, max is exact)
//         scale  = __fdiv_rn(absmax, 127)            (reference: absmax / 127.0, a true division)
//         inv    = absmax > 0 ? __fdiv_rn(127, absmax) : 0
//         q[k]   = sat_s8(rint(__fmul_rn(x[k], inv)))
//   asym: lo = min_k x[k], hi = max_k x[k]           (NOT widened to include 0: the reference uses the row's own
//                                                     min and max, like vLLM's dynamic_scaled_int8_azp_quant)
//         scale  = __fdiv_rn(__fsub_rn(hi, lo), 255)
//         azp    = scale > 0 ? rint(__fsub_rn(-128, __fdiv_rn(lo, scale))) : 0
//         q[k]   = scale > 0 ? sat_s8(rint(__fdiv_rn(x[k], scale)) + azp) : 0
//                  (the reference adds round(x/s) + azp in fp32: both are integers < 2^24, so exact either way)
// rint is round-half-even (cvt.rni), as torch.round.
//
// Why tests/gpu/test_gemm_w8a8.py used to see last-bit scale differences: it evaluated the torch twin ON THE GPU,
// and torch's CUDA `tensor / python_scalar` computes `tensor * (1 / scalar)` (ATen BinaryDivTrueKernel.cu: "if the
// second operand is a CPU scalar, compute a * reciprocal(b) ... may lose one bit"), so `absmax / 127.0` on CUDA is
// not the IEEE quotient this kernel (and torch on CPU) computes; about 4% of fp16 absmax values differ for /127 and
// about 70% for /255. The test now compares with the reference evaluated on CPU.
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
  // sym: hi = absmax (starts at 0); asym: the row's own max / min (start at -inf / +inf, K >= 1)
  float hi = ASYM ? -INFINITY : 0.f, lo = INFINITY;
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
