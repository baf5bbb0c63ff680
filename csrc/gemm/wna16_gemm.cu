// W4A16 / W8A16 dequant-GEMM for the memory-bound regime (M <= 64 per block row, any M via grid.y).
// Each warp streams one 64-column strip of the repacked weight once (one 16-byte load per lane per 16 rows
// of K for 4-bit, two for 8-bit), dequantizes in registers and feeds mma.sync m16n8k16 with fp32
// accumulation. Activations are read as mma A fragments straight from global/L1 (4 warps share them).
// Split-K over grid.z fills the SMs when there are few column tiles; see gemm_common.cuh for the layout.
#include <atomic>

#include "gemm_common.cuh"
#include "gemm_launch.h"

namespace lqe {
namespace {

constexpr int kUnroll = 4;  // K slabs of 16 per batch (K % 64 == 0)
// RING (M <= 16): each warp streams its weights through a cp.async ring in shared memory, kRingStages batches of
// kUnroll slabs (2 KB per warp for 4-bit; 8-bit: 2 stages of 4 KB, the same 32 KB per block). A SASS review
// (sm_90a, ptxas 13.0) found the register double buffer of the default path not working: every weight and
// activation load writes one scoreboard and ptxas waits for it to drain, so a batch's first use also waits for the
// batch just issued, and each warp has one 2 KB batch in flight (32 KB per SM against the ~36-55 KB a DRAM latency
// needs at the copy rate; predicted 35-52 % of the bandwidth, measured 35-45 % on the H200). The ring waits by
// commit-group count: 3 batches (6 KB) per warp stay in flight. Same arithmetic as the default path, bit-identical
// outputs. NOT MEASURED: the candidate kernel name "lqe-wna16-ring" (dispatch.WNA16_RING_TABLE).
constexpr int kRingStages = 4;
constexpr int kPdlPrefetchBytes = 8192;  // weights per warp pulled into L2 before a PDL launch's wait (M <= 16)

template <typename T, int BITS, int MT, bool HAS_ZP, bool RING>
__global__ void __launch_bounds__(kWna16Threads) wna16_gemm_kernel(
    const T* __restrict__ A, const uint4* __restrict__ B, const T* __restrict__ S, const T* __restrict__ Z,
    const T* __restrict__ bias, T* __restrict__ C, float* __restrict__ ws, int* __restrict__ counters, int M,
    int N, int K, int group_size, int slabs_per_split, int prefetch_slabs) {
  using D = Dq<T, BITS>;
  constexpr int V4 = BITS / 4;  // uint4 loads per lane per slab
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g8 = lane >> 2, t4 = lane & 3;
  const int ntiles = N / 64;
  const int nt = blockIdx.x * (kWna16BlockN / 64) + warp;
  const int m0 = blockIdx.y * MT * 16;
  const int ks0 = blockIdx.z * slabs_per_split;
  const int ks1 = min(K / 16, ks0 + slabs_per_split);

  float acc[MT][8][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

  // PDL (gemm_common.cuh): the weights of the first batches are requested before pdl_wait(); the activations, the
  // split-K workspace and counters, the bias and C only after it. Every thread waits, on every path (a block with no
  // tile too: below).
  auto pdl_ready = [] {
    pdl_wait();
    pdl_launch_dependents();
  };
  if (nt < ntiles) {
    const uint4* bp = B + ((size_t)ks0 * ntiles + nt) * 32 * V4 + lane * V4;
    const size_t bstride = (size_t)ntiles * 32 * V4;
    const int col_base = nt * 64 + g8 * 8;  // this lane's 8 stored scale columns
    typename D::P prm[8];
    int cur_g = -1;
    // PDL (M <= 16): before the wait, this warp's weight slabs [from, ks0 + prefetch_slabs) past those its first
    // loads already requested are pulled into L2 (each lane its own 16 bytes per slab: a warp's slab is 4 * V4
    // contiguous lines). A kernel launched early sits resident while the kernel before it runs (RMSNorm, SiLU-mul,
    // rotary, attention: a few blocks), so its DRAM stream starts there. 0 without PDL (the host sets it).
    auto prefetch_slabs_l2 = [&](int from) {
      const int to = min(ks1, ks0 + prefetch_slabs);
      for (int ks = from; ks < to; ++ks)
#pragma unroll
        for (int v = 0; v < V4; ++v) prefetch_l2(bp + (size_t)(ks - ks0) * bstride + v);
    };
    // The scales (+ zero points) of a new group were an __ldg issued only when compute reached the group, after the
    // weights had landed: one more DRAM round trip a warp waited through with nothing in flight (SASS: the scale
    // LDG.128 sits in the group-change branch right before the first HMMA). At M <= 16, load_w now prefetches the
    // lines of the groups of its first and last slab into L1 beside the weight loads (no registers: 4 blocks of the
    // 4-bit kernel fit an SM at <= 128, and it uses 128), so that __ldg hits L1. A batch spans at most 2 groups
    // unless group_size < 64.
    // (A batch is kUnroll whole slabs: K % 64 == 0, and ks0 and the split size are multiples of kUnroll.)
    auto prefetch_groups = [&](int ks) {
      const int g0 = ks * 16 / group_size, gl = ((ks + kUnroll) * 16 - 1) / group_size;
      prefetch_l1(S + (size_t)g0 * N + col_base);
      if (HAS_ZP) prefetch_l1(Z + (size_t)g0 * N + col_base);
      if (gl != g0) {
        prefetch_l1(S + (size_t)gl * N + col_base);
        if (HAS_ZP) prefetch_l1(Z + (size_t)gl * N + col_base);
      }
    };
    auto load_w = [&](uint32_t(&w)[kUnroll][4 * V4], int ks) {
      // (first: placed after the weight loads, it let ptxas wait on batch 0 before issuing batch 1 in the first
      // iteration; here every M <= 16 instantiation has both batches in flight before its first wait)
      if constexpr (MT == 1) prefetch_groups(ks);  // (at MT > 1 compute follows load_w at once)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int v = 0; v < V4; ++v) {
          const uint4 r = ld_stream_v4(bp + (size_t)(ks - ks0 + u) * bstride + v);
          w[u][4 * v + 0] = r.x; w[u][4 * v + 1] = r.y; w[u][4 * v + 2] = r.z; w[u][4 * v + 3] = r.w;
        }
    };
    auto compute = [&](const uint32_t(&w)[kUnroll][4 * V4], int ks) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int k0 = (ks + u) * 16;
        const int g = k0 / group_size;  // group sizes are multiples of 16: a slab never straddles groups
        if (g != cur_g) {
          cur_g = g;
          const uint4 sv = __ldg(reinterpret_cast<const uint4*>(S + (size_t)g * N + col_base));
          const T* s8 = reinterpret_cast<const T*>(&sv);
          if (HAS_ZP) {
            const uint4 zv = __ldg(reinterpret_cast<const uint4*>(Z + (size_t)g * N + col_base));
            const T* z8 = reinterpret_cast<const T*>(&zv);
#pragma unroll
            for (int j = 0; j < 8; ++j) prm[j] = D::prep(s8[j], z8[j]);
          } else {
            const T zc = from_f<T>((float)(1 << (BITS - 1)));
#pragma unroll
            for (int j = 0; j < 8; ++j) prm[j] = D::prep(s8[j], zc);
          }
        }
        uint32_t a[MT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          const int r0 = m0 + i * 16 + g8, r1 = r0 + 8;
          const T* p0 = A + (size_t)r0 * K + k0 + 2 * t4;
          const T* p1 = A + (size_t)r1 * K + k0 + 2 * t4;
          a[i][0] = r0 < M ? ld_u32(p0) : 0u;
          a[i][1] = r1 < M ? ld_u32(p1) : 0u;
          a[i][2] = r0 < M ? ld_u32(p0 + 8) : 0u;
          a[i][3] = r1 < M ? ld_u32(p1 + 8) : 0u;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          uint32_t b0, b1;
          D::tile(w[u], j, prm[j], b0, b1);
#pragma unroll
          for (int i = 0; i < MT; ++i) MmaF16<T>::run(acc[i][j], a[i], b0, b1);
        }
      }
    };
    if constexpr (MT == 1 && RING) {
      // Each lane copies its own 16 bytes per slab and reads them back itself, so cp.async.wait_group is the only
      // synchronization (no barrier). Batch b lives in slot b % NS; NS - 1 batches are in flight while one is
      // computed, and the slot refilled is the one the previous batch was read from (into registers) before.
      constexpr int NS = BITS == 4 ? kRingStages : kRingStages / 2;
      __shared__ __align__(16) uint4 ring[kWna16Threads / 32][NS][kUnroll * V4][32];
      const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(&ring[warp][0][0][lane]));
      const uint4* gp = bp;  // the next batch to issue
      int ks_issue = ks0;
      auto issue = [&](int st) {  // (an empty commit group past the split keeps the count)
        if (ks_issue < ks1) {
          prefetch_groups(ks_issue);
#pragma unroll
          for (int u = 0; u < kUnroll; ++u)
#pragma unroll
            for (int v = 0; v < V4; ++v)
              cp_async16_s(sbase + (uint32_t)(((st * kUnroll + u) * V4 + v) * 32 * 16), gp + (size_t)u * bstride + v);
          gp += (size_t)kUnroll * bstride;
        }
        ks_issue += kUnroll;
        cp_async_commit();
      };
#pragma unroll
      for (int st = 0; st < NS - 1; ++st) issue(st);
      prefetch_slabs_l2(ks0 + (NS - 1) * kUnroll);
      pdl_ready();  // (the first NS - 1 weight batches are in flight: they read no earlier kernel's output)
      uint32_t w[kUnroll][4 * V4];
      for (int ks = ks0; ks < ks1; ks += NS * kUnroll) {
#pragma unroll
        for (int st = 0; st < NS; ++st) {
          const int kb = ks + st * kUnroll;
          if (kb < ks1) {
            cp_async_wait<NS - 2>();  // batch kb (slot st) has landed
            issue((st + NS - 1) % NS);
#pragma unroll
            for (int u = 0; u < kUnroll; ++u)
#pragma unroll
              for (int v = 0; v < V4; ++v) {
                const uint4 r = ring[warp][st][u * V4 + v][lane];
                w[u][4 * v + 0] = r.x; w[u][4 * v + 1] = r.y; w[u][4 * v + 2] = r.z; w[u][4 * v + 3] = r.w;
              }
            compute(w, kb);
          }
        }
      }
      cp_async_wait<0>();
    } else if constexpr (MT == 1) {
      // Decode (M <= 16): the next kUnroll slabs are requested before this one's dequantize + mma, so a warp keeps
      // its weight loads in flight while it computes (the loads are volatile asm: the compiler keeps them where
      // they are written). At larger MT the second buffer would crowd the accumulators out of registers.
      uint32_t w0[kUnroll][4 * V4], w1[kUnroll][4 * V4];
      if (ks0 < ks1) load_w(w0, ks0);
      prefetch_slabs_l2(ks0 + kUnroll);
      pdl_ready();
      for (int ks = ks0; ks < ks1; ks += 2 * kUnroll) {
        if (ks + kUnroll < ks1) load_w(w1, ks + kUnroll);
        compute(w0, ks);
        if (ks + kUnroll >= ks1) break;
        if (ks + 2 * kUnroll < ks1) load_w(w0, ks + 2 * kUnroll);
        compute(w1, ks + kUnroll);
      }
    } else {
      pdl_ready();
      for (int ks = ks0; ks < ks1; ks += kUnroll) {
        uint32_t w[kUnroll][4 * V4];
        load_w(w, ks);
        compute(w, ks);
      }
    }
  } else {
    pdl_ready();
  }

  // Epilogue. Accumulator element c of (i, j): row m0 + i*16 + g8 + 8*(c/2), column nt*64 + j*8 + 2*t4 + c%2.
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
          float v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
          if (bias) { v0 += to_f(bias[col]); v1 += to_f(bias[col + 1]); }
          *reinterpret_cast<uint32_t*>(C + (size_t)row * N + col) = pack_f2(T(), v0, v1);
        }
    return;
  }
  if (nt < ntiles) {
    float* part = ws + (size_t)blockIdx.z * M * N;
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = m0 + i * 16 + g8 + 8 * h, col = nt * 64 + j * 8 + 2 * t4;
          if (row < M) *reinterpret_cast<float2*>(part + (size_t)row * N + col) = make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
        }
  }
  if (!(RING ? splitk_arrive_acq_rel(counters) : splitk_arrive(counters))) return;
  const int n0 = blockIdx.x * kWna16BlockN;
  // Column pairs (N % 64 == 0: a tile's columns pair up, 8-byte aligned in ws and 4-byte in C): at M = 1 the 256
  // columns are one pair per thread, so the tile's sum is one element's rounds, not two elements' one after another.
  const int rows = min(MT * 16, M - m0), pairs = min(kWna16BlockN, N - n0) / 2;
  for (int e = threadIdx.x; e < rows * pairs; e += blockDim.x) {
    const int row = m0 + e / pairs, col = n0 + 2 * (e % pairs);
    // RING: the bias is loaded before the sum's loads (not one more round trip after them), 32 of them in flight
    auto load_bias = [&] { return make_float2(to_f(bias[col]), to_f(bias[col + 1])); };
    float2 b = make_float2(0.f, 0.f);
    if (RING && bias) b = load_bias();
    float2 s = splitk_sum<float2, RING ? 32 : 16>(reinterpret_cast<const float2*>(ws + (size_t)row * N + col),
                                                  (size_t)M * N / 2, (int)gridDim.z);  // (M * N even: N % 64 == 0)
    if (bias) {
      if (!RING) b = load_bias();
      s.x += b.x;
      s.y += b.y;
    }
    *reinterpret_cast<uint32_t*>(C + (size_t)row * N + col) = pack_f2(T(), s.x, s.y);
  }
}

// One warp per (16-row slab, 64-column tile), kDqWarps per block: the same fragment decode as the GEMM, written out
// densely through the warp's shared-memory stage (gemm_common.cuh dequant_tile_store: whole 128-byte rows). Its
// direct 2-byte stores ran at ~5 % of the byte floor on the H200 at af342f8 (286 us for 4096 x 28672, row
// lqe-w4a16-dequant), as lqe-w4a16-mma's dequantize did before the same change (89 us for 4096 x 6144; after it,
// its dequantize + cuBLAS ran 0.59x cuBLAS bf16 at M = 256 against the Triton dequantize's 0.50x). NOT MEASURED.
constexpr int kDqWarps = 8;

template <typename T, int BITS, bool HAS_ZP>
__global__ void __launch_bounds__(kDqWarps * 32) wna16_dequant_kernel(
    const uint4* __restrict__ B, const T* __restrict__ S, const T* __restrict__ Z, T* __restrict__ W, int N, int K,
    int group_size, bool vec) {
  using D = Dq<T, BITS>;
  constexpr int V4 = BITS / 4;
  __shared__ __align__(16) T stage[kDqWarps][16 * kDqRow];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, g8 = lane >> 2;
  const int ntiles = N / 64;
  const int tile = blockIdx.x * kDqWarps + wib;
  if (tile >= (K / 16) * ntiles) return;  // (a whole warp: nothing below synchronizes more than one warp)
  const int ks = tile / ntiles, nt = tile % ntiles;
  uint32_t w[4 * V4];
#pragma unroll
  for (int v = 0; v < V4; ++v) {
    const uint4 r = ld_stream_v4(B + ((size_t)tile * 32 + lane) * V4 + v);
    w[4 * v + 0] = r.x; w[4 * v + 1] = r.y; w[4 * v + 2] = r.z; w[4 * v + 3] = r.w;
  }
  const int g = ks * 16 / group_size;
  const size_t sidx = (size_t)g * N + nt * 64 + g8 * 8;
  const T zc = from_f<T>((float)(1 << (BITS - 1)));
  typename D::P p[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) p[j] = D::prep(S[sidx + j], HAS_ZP ? Z[sidx + j] : zc);
  dequant_tile_store<T, BITS>(w, p, stage[wib], W, N, K, ks * 16, nt * 64, vec);
}

// One GEMM call's operands, passed down the template dispatch (dtype, bits, zero points, M tile) as they are.
struct GemmCall {
  const void *x, *qw, *s, *z, *bias;
  void* out;
  float* ws;
  int* counters;
  int M, N, K, gs, spp;
  bool ring, pdl;
  cudaStream_t st;
};

template <typename T, int BITS, int MT, bool ZP, bool RING = false>
void run_gemm(const GemmCall& c) {
  const int splits = (c.K / 16 + c.spp - 1) / c.spp;
  dim3 grid((c.N + kWna16BlockN - 1) / kWna16BlockN, (c.M + MT * 16 - 1) / (MT * 16), splits);
  auto* kernel = wna16_gemm_kernel<T, BITS, MT, ZP, RING>;
  // pdl only where the kernel waits (gemm_common.cuh), asked on the first PDL launch only: a launch without PDL (the
  // default) never queries the function's attributes, also not inside a CUDA-graph capture
  static std::atomic<int> has_wait{-1};
  if (c.pdl && has_wait.load(std::memory_order_relaxed) < 0) has_wait.store(kernel_has_pdl_wait(kernel) ? 1 : 0);
  const bool pdl = c.pdl && has_wait.load(std::memory_order_relaxed) == 1;
  // the L2 prefetch before the wait: kPdlPrefetchBytes per warp (at 16 warps per SM x 132 SMs, 17 MB: within L2)
  const int prefetch_slabs = pdl && MT == 1 ? kPdlPrefetchBytes / (512 * (BITS / 4)) : 0;
  launch_pdl(kernel, grid, dim3(kWna16Threads), c.st, pdl, (const T*)c.x, (const uint4*)c.qw, (const T*)c.s,
             (const T*)c.z, (const T*)c.bias, (T*)c.out, c.ws, c.counters, c.M, c.N, c.K, c.gs, c.spp,
             prefetch_slabs);
}

template <typename T, int BITS, bool ZP>
void run_gemm_mt(const GemmCall& c) {
  if (c.M <= 16 && c.ring) run_gemm<T, BITS, 1, ZP, true>(c);
  else if (c.M <= 16) run_gemm<T, BITS, 1, ZP>(c);
  else if (c.M <= 32) run_gemm<T, BITS, 2, ZP>(c);
  else run_gemm<T, BITS, 4, ZP>(c);
}

template <typename T, int BITS>
void run_typed(const GemmCall& c) {
  if (c.z) run_gemm_mt<T, BITS, true>(c);
  else run_gemm_mt<T, BITS, false>(c);
}

template <typename T, int BITS>
void run_dequant(const void* qw, const void* s, const void* z, void* out, int N, int K, int gs, cudaStream_t st) {
  const int tiles = (K / 16) * (N / 64);
  const dim3 grid((tiles + kDqWarps - 1) / kDqWarps);
  const bool vec = reinterpret_cast<uintptr_t>(out) % 16 == 0;  // (N % 64 == 0: every 8-column chunk is whole)
  if (z)
    wna16_dequant_kernel<T, BITS, true><<<grid, kDqWarps * 32, 0, st>>>((const uint4*)qw, (const T*)s, (const T*)z,
                                                                         (T*)out, N, K, gs, vec);
  else
    wna16_dequant_kernel<T, BITS, false><<<grid, kDqWarps * 32, 0, st>>>((const uint4*)qw, (const T*)s, nullptr,
                                                                          (T*)out, N, K, gs, vec);
}

const char* check_shape(int bits, int N, int K, int gs) {
  if (bits != 4 && bits != 8) return "bits must be 4 or 8";
  if (N % 64 != 0) return "N must be a multiple of 64";
  if (K % 64 != 0) return "K must be a multiple of 64";
  if (gs <= 0 || gs % 16 != 0) return "group_size must be a positive multiple of 16 (K for per-channel)";
  return nullptr;
}

}  // namespace

const char* launch_wna16_gemm(DType dt, int bits, const void* x, const void* qweight, const void* scales,
                              const void* zeros, const void* bias, void* out, float* ws, int* counters, int M,
                              int N, int K, int group_size, int spp, bool ring, bool pdl, cudaStream_t st) {
  if (const char* e = check_shape(bits, N, K, group_size)) return e;
  if (spp <= 0 || spp % kUnroll != 0) return "slabs_per_split must be a positive multiple of 4";
  if (M <= 0) return nullptr;
  const GemmCall c{x, qweight, scales, zeros, bias, out, ws, counters, M, N, K, group_size, spp, ring, pdl, st};
  if (dt == DType::kHalf) {
    if (bits == 4) run_typed<half, 4>(c);
    else run_typed<half, 8>(c);
  } else {
    if (bits == 4) run_typed<__nv_bfloat16, 4>(c);
    else run_typed<__nv_bfloat16, 8>(c);
  }
  return nullptr;
}

const char* launch_wna16_dequant(DType dt, int bits, const void* qweight, const void* scales, const void* zeros,
                                 void* out, int N, int K, int group_size, cudaStream_t st) {
  if (const char* e = check_shape(bits, N, K, group_size)) return e;
  if (dt == DType::kHalf) {
    if (bits == 4) run_dequant<half, 4>(qweight, scales, zeros, out, N, K, group_size, st);
    else run_dequant<half, 8>(qweight, scales, zeros, out, N, K, group_size, st);
  } else {
    if (bits == 4) run_dequant<__nv_bfloat16, 4>(qweight, scales, zeros, out, N, K, group_size, st);
    else run_dequant<__nv_bfloat16, 8>(qweight, scales, zeros, out, N, K, group_size, st);
  }
  return nullptr;
}

}  // namespace lqe
