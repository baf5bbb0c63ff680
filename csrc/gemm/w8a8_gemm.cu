// W8A8 int8 GEMM: int8 x int8 -> int32 on tensor cores (mma.sync m16n8k32 s8), fused epilogue
//   out = a_scale[m] * w_scale[n] * (acc - azp[m] * colsum[n]) + bias[n]  -> fp16 / bf16.
// Weight layout (lqe/kernels/repack.py::repack_w8a8): per 32(K) x 64(N) tile, lane (g8 = lane/4, t4 = lane%4)
// holds 16 words: word 2j+h = Wq[k = 4*t4 + 16*h + 0..3, n = j*8 + g8] (bytes in k order), i.e. the b0/b1
// registers of the m16n8k32 B fragment of n8 tile j; four 16-byte loads per lane per tile.
// Split-K partials are int32, so the reduction is exact.
#include "gemm_common.cuh"
#include "gemm_launch.h"

namespace lqe {
namespace {

constexpr int kUnroll8 = 2;  // 32-row slabs in flight (K % 64 == 0)

template <typename T, int MT>
__global__ void __launch_bounds__(kW8a8Threads) w8a8_gemm_kernel(
    const int8_t* __restrict__ A, const uint4* __restrict__ B, const float* __restrict__ a_scale,
    const int32_t* __restrict__ azp, const float* __restrict__ w_scale, const int32_t* __restrict__ colsum,
    const T* __restrict__ bias, T* __restrict__ C, int32_t* __restrict__ ws, int* __restrict__ counters, int M,
    int N, int K, int slabs_per_split) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g8 = lane >> 2, t4 = lane & 3;
  const int ntiles = N / 64;
  const int nt = blockIdx.x * (kW8a8BlockN / 64) + warp;
  const int m0 = blockIdx.y * MT * 16;
  const int ks0 = blockIdx.z * slabs_per_split;
  const int ks1 = min(K / 32, ks0 + slabs_per_split);

  int acc[MT][8][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0;

  if (nt < ntiles) {
    const uint4* bp = B + ((size_t)ks0 * ntiles + nt) * 32 * 4 + lane * 4;
    const size_t bstride = (size_t)ntiles * 32 * 4;
    for (int ks = ks0; ks < ks1; ks += kUnroll8) {
      uint32_t w[kUnroll8][16];
#pragma unroll
      for (int u = 0; u < kUnroll8; ++u)
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const uint4 r = ld_stream_v4(bp + (size_t)(ks - ks0 + u) * bstride + v);
          w[u][4 * v + 0] = r.x; w[u][4 * v + 1] = r.y; w[u][4 * v + 2] = r.z; w[u][4 * v + 3] = r.w;
        }
#pragma unroll
      for (int u = 0; u < kUnroll8; ++u) {
        const int k0 = (ks + u) * 32 + 4 * t4;
        uint32_t a[MT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          const int r0 = m0 + i * 16 + g8, r1 = r0 + 8;
          const int8_t* p0 = A + (size_t)r0 * K + k0;
          const int8_t* p1 = A + (size_t)r1 * K + k0;
          a[i][0] = r0 < M ? ld_u32(p0) : 0u;
          a[i][1] = r1 < M ? ld_u32(p1) : 0u;
          a[i][2] = r0 < M ? ld_u32(p0 + 16) : 0u;
          a[i][3] = r1 < M ? ld_u32(p1 + 16) : 0u;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int i = 0; i < MT; ++i) mma_s8(acc[i][j], a[i], w[u][2 * j], w[u][2 * j + 1]);
      }
    }
  }

  auto epilogue = [&](int row, int col, int v) -> float {
    if (azp) v -= azp[row] * colsum[col];
    float o = (float)v * a_scale[row] * w_scale[col];
    if (bias) o += to_f(bias[col]);
    return o;
  };
  if (gridDim.z == 1) {
    if (nt >= ntiles) return;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = m0 + i * 16 + g8 + 8 * h, col = nt * 64 + j * 8 + 2 * t4;
          if (row >= M) continue;
          const float v0 = epilogue(row, col, acc[i][j][2 * h]);
          const float v1 = epilogue(row, col + 1, acc[i][j][2 * h + 1]);
          *reinterpret_cast<uint32_t*>(C + (size_t)row * N + col) = pack_f2(T(), v0, v1);
        }
    return;
  }
  if (nt < ntiles) {
    int32_t* part = ws + (size_t)blockIdx.z * M * N;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = m0 + i * 16 + g8 + 8 * h, col = nt * 64 + j * 8 + 2 * t4;
          if (row < M) *reinterpret_cast<int2*>(part + (size_t)row * N + col) = make_int2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
        }
  }
  if (!splitk_arrive(counters)) return;
  const int n0 = blockIdx.x * kW8a8BlockN;
  const int rows = min(MT * 16, M - m0), cols = min(kW8a8BlockN, N - n0);
  for (int e = threadIdx.x; e < rows * cols; e += blockDim.x) {
    const int row = m0 + e / cols, col = n0 + e % cols;
    const int s = splitk_sum(ws + (size_t)row * N + col, (size_t)M * N, (int)gridDim.z);
    C[(size_t)row * N + col] = from_f<T>(epilogue(row, col, s));
  }
}

template <typename T, int MT>
void run(const int8_t* xq, const void* wq, const float* as, const int32_t* azp, const float* wsc, const int32_t* cs,
         const void* bias, void* out, int32_t* ws, int* counters, int M, int N, int K, int spp, cudaStream_t st) {
  const int splits = (K / 32 + spp - 1) / spp;
  dim3 grid((N + kW8a8BlockN - 1) / kW8a8BlockN, (M + MT * 16 - 1) / (MT * 16), splits);
  w8a8_gemm_kernel<T, MT><<<grid, kW8a8Threads, 0, st>>>(xq, (const uint4*)wq, as, azp, wsc, cs, (const T*)bias,
                                                          (T*)out, ws, counters, M, N, K, spp);
}

template <typename T>
void run_mt(const int8_t* xq, const void* wq, const float* as, const int32_t* azp, const float* wsc, const int32_t* cs,
            const void* bias, void* out, int32_t* ws, int* counters, int M, int N, int K, int spp, cudaStream_t st) {
  if (M <= 16) run<T, 1>(xq, wq, as, azp, wsc, cs, bias, out, ws, counters, M, N, K, spp, st);
  else if (M <= 32) run<T, 2>(xq, wq, as, azp, wsc, cs, bias, out, ws, counters, M, N, K, spp, st);
  else run<T, 4>(xq, wq, as, azp, wsc, cs, bias, out, ws, counters, M, N, K, spp, st);
}

}  // namespace

const char* launch_w8a8_gemm(DType dt, const int8_t* xq, const void* wq, const float* a_scale, const int32_t* azp,
                             const float* w_scale, const int32_t* colsum, const void* bias, void* out, int32_t* ws,
                             int* counters, int M, int N, int K, int spp, cudaStream_t st) {
  if (N % 64 != 0) return "N must be a multiple of 64";
  if (K % 64 != 0) return "K must be a multiple of 64";
  if (spp <= 0 || spp % kUnroll8 != 0) return "slabs_per_split must be a positive multiple of 2";
  if (azp && !colsum) return "asymmetric activations need the weight column sums";
  if (M <= 0) return nullptr;
  if (dt == DType::kHalf) run_mt<half>(xq, wq, a_scale, azp, w_scale, colsum, bias, out, ws, counters, M, N, K, spp, st);
  else run_mt<__nv_bfloat16>(xq, wq, a_scale, azp, w_scale, colsum, bias, out, ws, counters, M, N, K, spp, st);
  return nullptr;
}

}  // namespace lqe
