// lqe-w4a16-mma: a Marlin-class W4A16 / W8A16 tensor-core GEMM (issue 24). Design, in the order data flows:
//
// * Partitioning. The work is n_tiles x k_tiles block-iterations (256 columns x 64 rows of K each), walked
//   k fastest and cut into equal contiguous stripes, one per block (`sms` blocks: one or more per SM). A stripe
//   runs down K of one column tile and on into the next, so few column tiles at small M still fill every SM.
//   The pieces of a column tile other than its k = 0 piece store their fp32 partial sums, each in a workspace
//   slot of its own that stays in L2, and count themselves in on the tile's counter (one release add); the
//   k = 0 piece waits for that count once, adds the slots to its own sums in slot order (deterministic: the
//   order is fixed by the stripe plan), adds the bias, rounds once, writes the output and resets the counter.
//   The H200 measured the earlier chain (each piece waiting for the one above it, then a read-modify-write of
//   the running sum one L2 round trip after another) at ~17 of the 32 us of a 4096 x 4096 M=1 call.
// * Memory pipeline. A cp.async ring (Smem::kStages deep: 8 for the memory-bound M <= 16 4-bit kernel with one
//   scale group per k-tile, else 4): per stage the block copies one contiguous 8 KB (4-bit) or 16 KB (8-bit) run of
//   repacked weights with an L2 evict-first policy (read once; evict-normal in all but the last 64-row problem of
//   an M > 64 call, which re-read them), the 64-column slab of the activation rows (zero-filled past M and K) into
//   XOR-swizzled shared memory, and the scale / zero-point rows of the groups the stage touches (G64: the k-tile's
//   one group). A warp then takes its A fragments with ldmatrix.x4 (conflict-free: chunk c of row r lives at chunk
//   c ^ (r & 7)) and its B words with one ld.shared.v4 per 16 x 64 tile.
// * Dequantization in registers (gemm_common.cuh Dq<T, BITS>): lop3 / magic-number halves (fp16 0x6400,
//   bf16 0x4300 with the >> 4 two-nibble variant, 8-bit __byte_perm), the magic bias and the zero point removed
//   in one exact sub / fma, the scale applied in one mul; no shared-memory round trip. mma.sync m16n8k16 with
//   fp32 accumulation, MB m16 tiles (16..64 rows) per launch.
// Layout contract: lqe/kernels/repack_mma.py; CPU emulation: lqe/kernels/mma_ref.py.
#include <atomic>

#include "gemm_common.cuh"
#include "w4a16_mma.h"

namespace lqe {
namespace {

constexpr int kThreads = 128;  // 4 warps, warp w owns columns [64w, 64w + 64) of the block tile

// KW (warps_k): 1, or 2 for a G64 weight: 8 warps, warp w on columns [64 (w & 3), + 64) and slabs 2 (w >> 2), + 1
// of every k-tile (16 rows each); at a piece's end the upper four warps hand their sums to the lower four through
// shared memory, which finish the piece; a tile's k = 0 piece first adds the other pieces' slots, the first half of
// them in the lower warps and the rest in the upper ones (twice the L2 loads in flight; a fixed order, so
// deterministic, but not KW = 1's bits). Why: the H200 rows of af342f8 ran the one-warp-per-SM-sub-partition kernel
// at 22-46 % of the byte floor at M = 1, latency-bound (one warp's static schedule per k-tile, 641 cycles, is over
// the ~500 a k-tile may take at the copy rate, before any stall): two blocks per SM ("-2cta", sms = 2 x SMs) ran the
// 4096 x 28672 shape 17 % faster (25.9 against 31.3 us) but the small shapes slower (twice the pieces to reduce
// through L2). Two warps per sub-partition with the same stripes, ring depth and pieces is the in-block form of that:
// predicted 4096 x 28672 at ~26 us at M = 1 (and below its 57.6 us at M = 64, where one warp's k-tile schedule is
// 1128 cycles) with no loss on 4096 x 4096 (9.1 us at M = 1). The hand-over buffer is MB x 16 KB, so where the
// device's opt-in shared memory does not hold it (k2_fits) the 4-warp kernel runs. NEEDS MEASUREMENT (table name
// lqe-w4a16-mma-k2, benchmarks/kernels_w4a16.py).
template <int KW>
constexpr int threads_of() { return kThreads * KW; }

// G64: every k-tile (64 rows of K) lies in one scale group: the group size is a power of two >= 64, or the weight
// has one group (channel-wise). One group row per stage, fetched and prepared once per k-tile, with no per-slab
// group test: a SASS review (sm_90a, ptxas 13.0, bf16 4-bit) counted the 3 mid-k-tile branches each draining the
// HMMA latency (NOP + BRA, ~85 stall cycles per k-tile) and ~30 instructions of group bookkeeping; with the piece
// loop and the hoisted activation addresses below, one warp's static schedule per k-tile went 922 -> 641 cycles
// at MB = 1 and 1560 -> 1128 at MB = 4 (not measured). Other group sizes (32, or not a power of two) keep the
// per-slab path.
// Stages: the cp.async ring depth. 8 for the 4-bit MB = 1 (M <= 16) G64 kernel, the memory-bound one: 7 stages of
// 8 KB of weights in flight per block (3 at 4 stages covered ~1.2k cycles of loaded DRAM latency at the byte
// floor's rate); 88 KB of shared memory, within every sm_80+ GPU's opt-in (99 KB on sm_86 / sm_89). 4 elsewhere
// (MB = 4 is bound by the tensor cores). NEEDS MEASUREMENT.
template <int BITS, int MB, bool G64, int KW = 1>
struct Smem {
  static constexpr int kStages = BITS == 4 && MB == 1 && G64 ? 8 : 4;
  static_assert((kStages & (kStages - 1)) == 0, "the ring slot of stage i is i & (kStages - 1)");
  static constexpr int kB = kMmaTileK * kMmaTileN * BITS / 8;  // weight bytes per stage
  static constexpr int kA = MB * 16 * kMmaTileK * 2;           // activation bytes per stage
  static constexpr int kS = (G64 ? 1 : 4) * kMmaTileN * 2;     // slab slots (G64: slot 0 only) x 256 scales (16-bit)
  static constexpr int kStage = kB + kA + 2 * kS;              // + as many zero points
  static constexpr int kRing = kStages * kStage;
  // KW = 2: the upper warps' fp32 sums (MB x 8 x 4 per thread), [value][thread] so a warp's stores hit 32 banks
  static constexpr int kRed = KW > 1 ? MB * 8 * 4 * kThreads * 4 : 0;
  static constexpr int kTotal = kRing + kRed;
};

struct MmaArgs {
  const void* A;
  const uint4* B;
  const void* S;
  const void* Z;
  const void* bias;
  void* C;
  float* ws;     // slot s (the s-th piece of a tile above its k = 0 piece) at ws + s * kMmaMaxRows * n_pad
  int* locks;    // per column tile: pieces that have stored their slot (the k = 0 piece resets it)
  int M, N, K, k_tiles, n_tiles, n_pad, group_size, groups, per;
  int gs_shift;  // log2(group_size) when it is a power of two, else -1 (a division per group lookup)
  int last_rows;  // the last (or only) <= 64-row problem of the call: its weight reads may leave L2
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint64_t evict_normal_policy() {
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ void cp16_l2_hint(uint32_t dst, const void* src, uint64_t pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "l"(pol));
}
__device__ __forceinline__ void cp16_zfill(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;  // src-size 0: 16 zero bytes land in shared memory
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.global.acquire.gpu.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

template <typename T, int BITS, int MB, bool G64, int KW>
__global__ void __launch_bounds__(threads_of<KW>(), 1) w4a16_mma_kernel(const MmaArgs a) {
  static_assert(KW == 1 || (KW == 2 && G64), "warps_k = 2: a G64 weight only (one scale row per k-tile, slot 0)");
  using D = Dq<T, BITS>;
  using SM = Smem<BITS, MB, G64, KW>;
  constexpr int kStages = SM::kStages;
  constexpr int kT = threads_of<KW>();
  constexpr int V = BITS / 4;  // 16-byte vectors per lane per 16 x 64 tile
  constexpr int kSl = 4 / KW;  // slabs of a k-tile per warp
  extern __shared__ __align__(16) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, g8 = lane >> 2, t4 = lane & 3;
  // column quarter and slab half (KW = 2); KW = 1 keeps them compile-time (warp = tid >> 5, no half)
  const int warp = KW == 1 ? tid >> 5 : (tid >> 5) & 3, kh = KW == 1 ? 0 : tid >> 7;
  const bool owner = KW == 1 || kh == 0;  // finishes the piece (KW = 2: after the upper warps' hand-over)
  const int total = a.n_tiles * a.k_tiles;
  // Block b runs stripe grid - 1 - b: a stripe waits only on stripes above it (see finish_piece), which then run in
  // blocks with a LOWER index, dispatched before this one, so no block ever spins on one that is not resident yet
  // (whatever else shares the SMs, and for any sms). mma_ref.stripe_of_block / dispatch_completes check it.
  const int stripe = (int)gridDim.x - 1 - (int)blockIdx.x;
  const int it0 = stripe * a.per, it1 = min(total, it0 + a.per);
  if (it0 >= it1) return;
  // Weights are read once per problem: evict-first, except when a later 64-row problem of the same call
  // (M > 64) reads them again; then a normal policy lets the layers that fit in L2 be re-read from there.
  const uint64_t pol = a.last_rows ? evict_first_policy() : evict_normal_policy();
  const T* A = static_cast<const T*>(a.A);
  const T* S = static_cast<const T*>(a.S);
  const T* Z = static_cast<const T*>(a.Z);
  const bool has_zp = Z != nullptr;
  // group_of(k0 + 16 s) for the four slabs s = 0..3 (16 rows of K each) from row k0, the power-of-two test made
  // once for the four. A slab starts a new scale group iff its group differs from the slab above it.
  auto slab_groups = [&](int k0, int (&g)[4]) {
    if (a.gs_shift >= 0) {
#pragma unroll
      for (int s = 0; s < 4; ++s) g[s] = min((k0 + 16 * s) >> a.gs_shift, a.groups - 1);
    } else {
#pragma unroll
      for (int s = 0; s < 4; ++s) g[s] = min((k0 + 16 * s) / a.group_size, a.groups - 1);
    }
  };

  // The (column tile, k-tile) of work item it0. The loader state below and the main loop's (nt, kt) each advance
  // one k-tile per stage from it (no division per stage).
  const int nt0 = it0 / a.k_tiles, kt0 = it0 - nt0 * a.k_tiles;
  // Loader state: the k-tile of the next stage, the global byte address of this thread's first weight vector in it
  // (B holds [k_tiles][n_tiles] runs of kB bytes) and that of its scale / zero-point chunk in group row 0 (below).
  // Addresses are unsigned integers: the step back to k-tile 0 of the next column tile is an add modulo 2^64, and
  // no 64-bit multiply is left per stage.
  int load_kt = kt0;
  uint64_t load_b = reinterpret_cast<uint64_t>(a.B) + ((uint64_t)kt0 * a.n_tiles + nt0) * SM::kB + tid * 16;
  const uint64_t b_step = (uint64_t)a.n_tiles * SM::kB;                // (kt, nt) -> (kt + 1, nt)
  const uint64_t b_wrap = SM::kB - (uint64_t)(a.k_tiles - 1) * b_step;  // (k_tiles - 1, nt) -> (0, nt + 1)
  const uint32_t smem0 = smem_u32(smem);
  // The shared-memory address of this thread's first weight chunk in the slot the next load_stage fills. It is kept
  // as one per-thread value (the select below, a no-op as M > 0, included) on purpose: given smem0 + slot * kStage +
  // tid * 16, ptxas 13.0 folds the uniform part into the cache-hinted cp.async (SASS LDGSTS [R+UR0], desc[UR1])
  // and reads UR0 / UR1:UR2 without ever writing them: "illegal instruction" on the H200 (compute-sanitizer,
  // stop 38). .ci/sass_check.py fails the build on any such read.
  const uint32_t w_first = smem0 + tid * 16, w_last = w_first + (kStages - 1) * SM::kStage;
  uint32_t w_wr = a.M > 0 ? w_first : w_last;
  // Scale / zero-point copies, warp-uniform roles: warp 0 copies the scale rows of slots 0 and 2, warp 1 their
  // zero-point rows, warps 2 and 3 the same for slots 1 and 3; lane l the 16 bytes of columns [8 l, 8 l + 8).
  const int sc_slot = tid >> 6, sc_lane = tid & 31;
  const bool sc_zp = (tid & 63) >= 32;
  const uint32_t sc_row = sizeof(T) * a.n_pad;  // bytes per group row (< 2^32: n_pad < 2^31)
  // (a zero-point address is formed but never used when Z is null; + g * sc_row is one IMAD.WIDE.U32)
  uint64_t sc_src = reinterpret_cast<uint64_t>(sc_zp ? Z : S) + ((uint64_t)nt0 * kMmaTileN + sc_lane * 8) * sizeof(T);
  const uint32_t sc_dst = SM::kB + SM::kA + (sc_zp ? SM::kS : 0) + sc_slot * 512 + sc_lane * 16;
  // Activation chunks: thread tid copies chunk a_ch of rows a_r0 + 16 i (i < MB) of each stage's 64-column slab; its
  // source address advances one slab per stage (back to slab 0 at a column tile's end), the row test is made once.
  const int a_r0 = tid >> 3, a_ch = tid & 7;
  const uint32_t a_off0 = SM::kB + a_r0 * 128 + ((a_ch ^ (a_r0 & 7)) << 4);  // (row + 16 i keeps r & 7)
  uint64_t a_src =
      reinterpret_cast<uint64_t>(A) + ((uint64_t)a_r0 * a.K + (uint64_t)kt0 * kMmaTileK + a_ch * 8) * sizeof(T);
  const uint64_t a_rowstep = (uint64_t)16 * a.K * sizeof(T);
  uint32_t a_rows_ok = 0;
#pragma unroll
  for (int i = 0; i < MB; ++i) a_rows_ok |= (a_r0 + 16 * i < a.M ? 1u : 0u) << i;
  auto load_stage = [&](int slot) {
    const int kt = load_kt;
    const uint64_t src = load_b, sc_base = sc_src, a_cur = a_src;
    if (++load_kt == a.k_tiles) {
      load_kt = 0;
      load_b += b_wrap;
      sc_src += kMmaTileN * sizeof(T);
      a_src -= (uint64_t)(a.k_tiles - 1) * (kMmaTileK * sizeof(T));
    } else {
      load_b += b_step;
      a_src += kMmaTileK * sizeof(T);
    }
    const uint32_t dst = smem0 + slot * SM::kStage;
#pragma unroll
    for (int i = 0; i < SM::kB / 16 / kT; ++i)  // chunk c = i * kT + tid (w_wr: slot's chunk tid)
      cp16_l2_hint(w_wr + i * kT * 16, reinterpret_cast<const void*>(src + i * kT * 16), pol);
    w_wr = w_wr == w_last ? w_first : w_wr + SM::kStage;  // stages are loaded in slot order 0, 1, .., kStages - 1, 0
    const uint32_t adst = dst + a_off0;
    const bool kok = kt * kMmaTileK + a_ch * 8 < a.K;
    // MB*16 rows x 8 chunks of 16 bytes: rows a_r0 + 16 i, 2048 bytes apart (KW = 2: by the lower 128 threads)
#pragma unroll
    for (int i = 0; i < (owner ? MB : 0); ++i) {
      const bool ok = kok && ((a_rows_ok >> i) & 1);
      cp16_zfill(adst + i * 2048, ok ? reinterpret_cast<const void*>(a_cur + i * a_rowstep) : (const void*)A, ok);
    }
    if (G64) {  // slot 0: the k-tile's one group row (warp 0 the scales, warp 1 the zero points)
      if (sc_slot == 0 && (!sc_zp || has_zp)) {
        const int g0 = min((kt * kMmaTileK) >> a.gs_shift, a.groups - 1);
        cp16(dst + sc_dst, reinterpret_cast<const void*>(sc_base + (uint64_t)(uint32_t)g0 * sc_row));
      }
      return;
    }
    // Slot s gets its group's row only where slab s opens a new group (slot 0 always): the reader keeps its
    // registers otherwise. g[] = the groups of slabs sc_slot - 1 .. sc_slot + 2 (g[0] unused when sc_slot = 0;
    // g[1], g[3] >= 0).
    if (!sc_zp || has_zp) {
      int g[4];
      slab_groups(kt * kMmaTileK + 16 * (sc_slot - 1), g);
      if (sc_slot == 0 || g[1] != g[0])
        cp16(dst + sc_dst, reinterpret_cast<const void*>(sc_base + (uint64_t)(uint32_t)g[1] * sc_row));
      if (g[3] != g[2])
        cp16(dst + sc_dst + 2 * 512, reinterpret_cast<const void*>(sc_base + (uint64_t)(uint32_t)g[3] * sc_row));
    }
  };

  float acc[MB][8][4];
#pragma unroll
  for (int i = 0; i < MB; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;

  // One piece (this block's K range of one column tile) is done. A piece above k = 0 stores its partial sums in its
  // slot and counts itself in; the k = 0 piece (the tile's lowest stripe `first`: every other piece of the tile runs
  // in a higher stripe, i.e. a lower block, dispatched before this one) waits for the count once, then adds the
  // slots in order. No piece but the k = 0 one ever waits, so the wait lasts until the tile's slowest piece is in,
  // never a chain of them. mma_ref.stripe_pieces / dispatch_completes / stripe_critical_path model it.
  // this thread's accumulator pair (i, j, h): problem row frag_row(i, h), output columns frag_col(nt, j) and + 1
  auto frag_row = [&](int i, int h) { return i * 16 + g8 + 8 * h; };
  auto frag_col = [&](int nt, int j) { return nt * kMmaTileN + warp * 64 + j * 8 + 2 * t4; };
  // KW = 2: the upper warps' sums into the lower warps' (the same fragment rows and columns: tid & 127). The lower
  // warps read the buffer before the next k-tile's barrier, which the upper warps pass before they write it again
  // (every piece has a k-tile). Block-uniform: every thread calls it.
  auto hand_over = [&]() {
    if (KW == 1) return;
    float* red = reinterpret_cast<float*>(smem + SM::kRing) + (tid & (kThreads - 1));
    if (!owner) {
#pragma unroll
      for (int i = 0; i < MB; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c) red[((i * 8 + j) * 4 + c) * kThreads] = acc[i][j][c];
    }
    __syncthreads();
    if (owner) {
#pragma unroll
      for (int i = 0; i < MB; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[i][j][c] += red[((i * 8 + j) * 4 + c) * kThreads];
    }
  };
  auto finish_piece = [&](int nt, int k_lo) {
    const int first = (nt * a.k_tiles) / a.per, others = (nt * a.k_tiles + a.k_tiles - 1) / a.per - first;
    int* count = a.locks + nt;
    if (k_lo != 0) {
      hand_over();
      float* slot = a.ws + (size_t)(stripe - first - 1) * kMmaMaxRows * a.n_pad;
#pragma unroll
      for (int i = 0; i < MB; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = frag_row(i, h), col = frag_col(nt, j);
            if (owner && row < a.M)
              __stcg(reinterpret_cast<float2*>(slot + (size_t)row * a.n_pad + col),
                     make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]));
          }
      __syncthreads();  // every thread's stores precede the release below (cumulative at gpu scope)
      if (tid == 0) red_release_add(count, 1);
      return;
    }
    if (others > 0) {
      if (tid == 0)
        while (ld_acquire(count) != others) __nanosleep(32);  // (spares L2 the polling of a long wait)
      __syncthreads();
      // KW = 2: the lower warps add slots [0, o_mid), the upper ones [o_mid, others) into their own sums before the
      // hand-over (twice the loads in flight: at 64 rows a slot is 64 KB, read from L2 by this one block)
      const int o_mid = KW == 1 ? others : (others + 1) >> 1;
      for (int o = owner ? 0 : o_mid; o < (owner ? o_mid : others); ++o) {
        const float* slot = a.ws + (size_t)o * kMmaMaxRows * a.n_pad;
#pragma unroll
        for (int i = 0; i < MB; ++i) {
          float2 part[8][2];  // every load of a row tile issued before the first add: one L2 round trip
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int row = frag_row(i, h), col = frag_col(nt, j);
              part[j][h] = row < a.M ? __ldcg(reinterpret_cast<const float2*>(slot + (size_t)row * a.n_pad + col))
                                     : make_float2(0.f, 0.f);
            }
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              acc[i][j][2 * h] += part[j][h].x;
              acc[i][j][2 * h + 1] += part[j][h].y;
            }
        }
      }
    }
    hand_over();
    T* C = static_cast<T*>(a.C);
    const T* bias = static_cast<const T*>(a.bias);
#pragma unroll
    for (int i = 0; i < MB; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = frag_row(i, h), col = frag_col(nt, j);
          if (!owner || row >= a.M || col >= a.N) continue;
          float v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
          if (bias) {
            v0 += to_f(bias[col]);
            v1 += to_f(bias[col + 1]);
          }
          *reinterpret_cast<uint32_t*>(C + (size_t)row * a.N + col) = pack_f2(T(), v0, v1);
        }
    if (others > 0 && tid == 0) *count = 0;  // every other piece of this tile is in: ready for the next launch
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (it0 + s < it1) load_stage(s);
    cp_commit();
  }
  typename D::P prm[8];
  int cur_g = -1;
  const T zc = from_f<T>((float)(1 << (BITS - 1)));
  // MB <= 2: the whole k-tile's weight words and A fragments (4 register buffers) and slab 0's scales are read from
  // shared memory right after the barrier, before the next stage's cp.async issue, so no dequantize waits on a
  // shared-memory load. MB = 4 (kPre = 0): each slab is read at its turn, one buffer (more would push the
  // accumulators out of registers).
  constexpr int kPre = MB <= 2 ? kSl : 0, kBuf = kPre > 0 ? kPre : 1;
  const int s0 = kh * kSl;  // this warp's first slab of every k-tile
  struct Frag {
    uint32_t w[4 * V];
    uint32_t af[MB][4];
  };
  // Per-thread byte offsets inside a stage: weight vector v of slab s at w_rd + (4 s V + v) * 512; the A fragment
  // of slab s, m16 tile mi at (a_rd ^ (s << 5)) + mi * 2048, a_rd = kB + r * 128 + ((ch ^ (r & 7)) << 4) for
  // r = lane & 15, ch = lane >> 4 (chunk 2 s + ch = (2 s) ^ ch: its swizzled offset is a_rd's bits 4..6 xor 2 s,
  // and kB + r * 128 has none of those bits; row + 16 mi keeps r & 7); the 8 scales of slab s at s_rd + s * 512
  // (zero points kS further).
  const uint32_t w_rd = (warp * V * 32 + lane) * 16;
  const uint32_t a_rd = SM::kB + (lane & 15) * 128 + (((lane >> 4) ^ (lane & 7)) << 4);
  const uint32_t s_rd = SM::kB + SM::kA + (warp * 64 + g8 * 8) * sizeof(T);
  int nt = nt0, kt = kt0;  // this iteration's tile, advanced at its end
  const int k_lo0 = kt;  // the first piece starts mid-tile; every later one at k = 0
  const int n_it = it1 - it0;  // iteration i is work item it0 + i
  // Pieces (a column tile's k-tiles in this stripe) in the outer loop, their k-tiles in the inner one: the piece-end
  // test and the (kt, nt) update leave the k-tile loop.
  for (int i = 0; i < n_it; kt = 0, ++nt) {
    const int i_end = min(n_it, i + a.k_tiles - kt);
    for (; i < i_end; ++i, ++kt) {
      cp_wait<kStages - 2>();
      __syncthreads();  // stage i landed for every thread; slot (i - 1) % kStages is free
      const uint8_t* st = smem + (i & (kStages - 1)) * SM::kStage;
      const uint32_t st32 = smem_u32(st);
      auto fetch = [&](Frag& f, int s) {
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const uint4 r = *reinterpret_cast<const uint4*>(st + w_rd + (s * 4 * V + v) * 512);
          f.w[4 * v + 0] = r.x;
          f.w[4 * v + 1] = r.y;
          f.w[4 * v + 2] = r.z;
          f.w[4 * v + 3] = r.w;
        }
#pragma unroll
        for (int mi = 0; mi < MB; ++mi) ldmatrix_x4(f.af[mi], st32 + (a_rd ^ (s << 5)) + mi * 2048);
      };
      uint4 sv, zv;  // the scale (+ zero-point) vector of a slab that opens a group
      auto fetch_scales = [&](int s) {
        sv = *reinterpret_cast<const uint4*>(st + s_rd + s * 512);
        if (has_zp) zv = *reinterpret_cast<const uint4*>(st + s_rd + SM::kS + s * 512);
      };
      auto prep = [&]() {
        const T* s8 = reinterpret_cast<const T*>(&sv);
        if (has_zp) {
          const T* z8 = reinterpret_cast<const T*>(&zv);
#pragma unroll
          for (int j = 0; j < 8; ++j) prm[j] = D::prep(s8[j], z8[j]);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) prm[j] = D::prep(s8[j], zc);
        }
      };
      auto compute = [&](const Frag& f) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          uint32_t b0, b1;
          D::tile(f.w, j, prm[j], b0, b1);
#pragma unroll
          for (int mi = 0; mi < MB; ++mi) MmaF16<T>::run(acc[mi][j], f.af[mi], b0, b1);
        }
      };
      Frag f[kBuf];  // this warp's slab s0 + u in f[u % kBuf]
#pragma unroll
      for (int u = 0; u < kPre; ++u) fetch(f[u], s0 + u);  // slot i is read, slot (i + kStages - 1) % kStages below
      int g[4];
      if (G64) {  // one group for the four slabs: fresh[1..3] are false at compile time
        g[0] = g[1] = g[2] = g[3] = min((kt * kMmaTileK) >> a.gs_shift, a.groups - 1);
      } else {
        slab_groups(kt * kMmaTileK, g);
      }
      // slab s opens a new group (or a new piece: cur_g = -1): 8 scales (+ zero points) from slot s (G64: slot 0,
      // the k-tile's one group row, whichever slabs this warp takes; KW = 2 is G64 only)
      bool fresh[4];
      fresh[0] = g[0] != cur_g;
#pragma unroll
      for (int s = 1; s < 4; ++s) fresh[s] = g[s] != g[s - 1];
      cur_g = g[3];
      if (kPre > 0 && fresh[0]) fetch_scales(0);
      if (i + kStages - 1 < n_it) load_stage((i + kStages - 1) & (kStages - 1));
      cp_commit();
#pragma unroll
      for (int u = 0; u < kSl; ++u) {
        const int s = s0 + u;  // (KW = 1: s = u, known at compile time)
        if (u >= kPre) fetch(f[u % kBuf], s);
        if (fresh[u]) {
          if (u > 0 || kPre == 0) fetch_scales(G64 ? 0 : s);  // (G64: the one row, in slot 0)
          prep();
        }
        compute(f[u % kBuf]);
      }
    }
    finish_piece(nt, it0 > nt * a.k_tiles ? k_lo0 : 0);
#pragma unroll
    for (int mi = 0; mi < MB; ++mi)
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[mi][j][c] = 0.f;
    cur_g = -1;
  }
  cp_wait<0>();
}

constexpr int kMaxDevices = 64;  // devices whose per-device launch state below is kept (others ask every time)

// The dynamic shared-memory opt-in is a per-device function attribute: set once per device and instantiation, not
// on every launch (a decode step makes ~200 of them).
template <typename T, int BITS, int MB, bool G64, int KW = 1>
cudaError_t run(const MmaArgs& a, int grid, cudaStream_t st) {
  constexpr int smem = Smem<BITS, MB, G64, KW>::kTotal;
  static std::atomic<bool> opted_in[kMaxDevices];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev >= kMaxDevices || !opted_in[dev].load(std::memory_order_acquire)) {
    e = cudaFuncSetAttribute(w4a16_mma_kernel<T, BITS, MB, G64, KW>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             smem);
    if (e != cudaSuccess) return e;
    if (dev < kMaxDevices) opted_in[dev].store(true, std::memory_order_release);
  }
  w4a16_mma_kernel<T, BITS, MB, G64, KW><<<grid, threads_of<KW>(), smem, st>>>(a);
  return cudaGetLastError();
}

// The current device's opt-in shared memory per block in bytes (0 when the runtime cannot say), asked once per
// device: the launcher reads it on every call.
int optin_smem() {
  static std::atomic<int> known[kMaxDevices];  // 0: not asked yet
  int dev = 0, optin = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (dev < kMaxDevices && (optin = known[dev].load(std::memory_order_relaxed)) > 0) return optin;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) return 0;
  if (dev < kMaxDevices) known[dev].store(optin, std::memory_order_relaxed);
  return optin;
}

// Whether the device's opt-in shared memory per block holds the 8-warp kernel's ring and hand-over buffer (4-bit
// M <= 16: 104 KB, more than sm_86 / sm_89 give; 8-bit 64 rows: 164 KB, more than an A100's 163); where it does not,
// the 4-warp kernel runs.
template <int BITS, int MB>
bool k2_fits() {
  return Smem<BITS, MB, true, 2>::kTotal <= optin_smem();
}

// MB m16 tiles; k2: the 8-warp k-split kernel where it applies (G64, and its shared memory fits)
template <typename T, int BITS, int MB, bool G64>
cudaError_t run_kw(const MmaArgs& a, int grid, bool k2, cudaStream_t st) {
  if constexpr (G64) {
    if (k2 && k2_fits<BITS, MB>()) return run<T, BITS, MB, true, 2>(a, grid, st);
  }
  return run<T, BITS, MB, G64>(a, grid, st);
}

// m16 tiles per launch: the fewest that cover a.M, capped at mb_max (what the device's shared memory holds).
template <typename T, int BITS, bool G64>
cudaError_t run_rows(const MmaArgs& a, int grid, int mb_max, bool k2, cudaStream_t st) {
  if (a.M <= 16 || mb_max == 1) return run_kw<T, BITS, 1, G64>(a, grid, k2, st);
  if (a.M <= 32 || mb_max == 2) return run_kw<T, BITS, 2, G64>(a, grid, k2, st);
  return run_kw<T, BITS, 4, G64>(a, grid, k2, st);
}

template <typename T, int BITS>
cudaError_t run_rows(const MmaArgs& a, int grid, int mb_max, bool g64, bool k2, cudaStream_t st) {
  return g64 ? run_rows<T, BITS, true>(a, grid, mb_max, k2, st) : run_rows<T, BITS, false>(a, grid, mb_max, k2, st);
}

// The largest m16-tile count (4, 2 or 1) whose kStages-deep ring fits the device's opt-in shared memory per block:
// 8-bit weights with 64 rows need 112 KB, more than sm_86 / sm_89 give (99 KB); they run 32-row problems there.
template <int BITS>
int max_row_tiles() {
  const int optin = optin_smem();  // (0 when unknown: 1)
  // (the per-slab kernels' rings are the larger: what fits for them fits for G64; G64 at MB = 1 takes <= 88 KB)
  static_assert(Smem<BITS, 4, true>::kTotal <= Smem<BITS, 4, false>::kTotal &&
                Smem<BITS, 2, true>::kTotal <= Smem<BITS, 2, false>::kTotal && Smem<BITS, 1, true>::kTotal <= 88 * 1024,
                "row-tile choice");
  if (Smem<BITS, 4, false>::kTotal <= optin) return 4;
  return Smem<BITS, 2, false>::kTotal <= optin ? 2 : 1;
}

// Dense W[K, N] (sorted-K order) from the repack_mma layout, one warp per 16 x 64 warp tile, decoded and written by
// gemm_common.cuh's dequant_tile_store (bit-identical to the B fragments the GEMM feeds): the dequantize + cuBLAS
// path above the crossover, and a direct GPU check of the layout against lqe/kernels/mma_ref.py.
constexpr int kDqWarps = 8;  // warps (tiles) per block

template <typename T, int BITS>
__global__ void __launch_bounds__(kDqWarps * 32) w4a16_mma_dequant_kernel(
    const uint4* __restrict__ B, const T* __restrict__ S, const T* __restrict__ Z, T* __restrict__ W, int N, int K,
    int n_tiles, int n_pad, int tiles, int group_size, int groups, bool vec) {
  using D = Dq<T, BITS>;
  constexpr int V = BITS / 4;
  __shared__ __align__(16) T stage[kDqWarps][16 * kDqRow];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5, g8 = lane >> 2;
  const int t = blockIdx.x * kDqWarps + wib;
  if (t >= tiles) return;  // (a whole warp: nothing below synchronizes more than one warp)
  const int wq = t & 3, s = (t >> 2) & 3, nt = (t >> 4) % n_tiles, kt = (t >> 4) / n_tiles;
  uint32_t w[4 * V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const uint4 r = ld_stream_v4(B + ((size_t)t * V + v) * 32 + lane);
    w[4 * v + 0] = r.x;
    w[4 * v + 1] = r.y;
    w[4 * v + 2] = r.z;
    w[4 * v + 3] = r.w;
  }
  const int k0 = kt * kMmaTileK + s * 16, col0 = nt * kMmaTileN + wq * 64;
  const size_t sidx = (size_t)min(k0 / group_size, groups - 1) * n_pad + col0 + g8 * 8;
  const T zc = from_f<T>((float)(1 << (BITS - 1)));
  typename D::P p[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) p[j] = D::prep(S[sidx + j], Z ? Z[sidx + j] : zc);
  dequant_tile_store<T, BITS>(w, p, stage[wib], W, N, K, k0, col0, vec);
}

template <typename T, int BITS>
cudaError_t run_dequant(const void* qw, const void* s, const void* z, void* out, int N, int K, int k_pad, int n_pad,
                        int gs, int groups, cudaStream_t st) {
  const int tiles = (k_pad / 16) * (n_pad / 64);
  const bool vec = N % 8 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  w4a16_mma_dequant_kernel<T, BITS><<<(tiles + kDqWarps - 1) / kDqWarps, kDqWarps * 32, 0, st>>>(
      static_cast<const uint4*>(qw), static_cast<const T*>(s), static_cast<const T*>(z), static_cast<T*>(out), N, K,
      n_pad / kMmaTileN, n_pad, tiles, gs, groups, vec);
  return cudaGetLastError();
}

}  // namespace

int mma_workspace_slots(int n_tiles, int k_tiles, int sms) {
  const int total = n_tiles * k_tiles, per = (total + min(sms, total) - 1) / min(sms, total);
  int slots = 0;
  for (int nt = 0; nt < n_tiles; ++nt)
    slots = max(slots, (nt * k_tiles + k_tiles - 1) / per - (nt * k_tiles) / per);
  return slots;
}

const char* launch_w4a16_mma(DType dt, int bits, const void* x, const void* qweight, const void* scales,
                             const void* zeros, const void* bias, void* out, float* ws, size_t ws_elems, int* locks,
                             int M, int N, int K, int k_pad, int n_pad, int group_size, int groups, int sms,
                             int warps_k, cudaStream_t stream) {
  if (bits != 4 && bits != 8) return "bits must be 4 or 8";
  if (warps_k != 1 && warps_k != 2) return "warps_k must be 1 or 2";
  if (K <= 0 || N <= 0 || K % 8 != 0 || N % 8 != 0) return "K and N must be positive multiples of 8";
  if (k_pad % kMmaTileK != 0 || k_pad < K || k_pad - K >= kMmaTileK) return "k_pad must be K rounded up to 64";
  if (n_pad % kMmaTileN != 0 || n_pad < N || n_pad - N >= kMmaTileN) return "n_pad must be N rounded up to 256";
  if (group_size <= 0 || (group_size % 16 != 0 && groups != 1)) return "group_size must be a multiple of 16";
  if (groups <= 0 || sms <= 0) return "groups and sms must be positive";
  if (M <= 0) return nullptr;
  const int n_tiles = n_pad / kMmaTileN, k_tiles = k_pad / kMmaTileK, total = n_tiles * k_tiles;
  const int per = (total + min(sms, total) - 1) / min(sms, total);
  const int grid = (total + per - 1) / per;
  if (ws_elems < (size_t)mma_workspace_slots(n_tiles, k_tiles, sms) * kMmaMaxRows * n_pad)
    return "ws is smaller than this stripe plan's slots x 64 x n_pad floats (lqe.kernels.gemm_mma.reserve_workspace "
           "with this layer's k_pad and sms)";
  int gs_shift = -1;
  for (int b = 0; b < 31; ++b)
    if (group_size == (1 << b)) gs_shift = b;
  // one scale group per k-tile (see G64): a power-of-two group of >= 64 rows, or a single group (shift 30: every
  // k-tile's (kt * 64) >> 30 is 0, kt < 2^24)
  const bool g64 = groups == 1 || gs_shift >= 6;
  if (groups == 1) gs_shift = 30;
  const size_t esz = 2;  // fp16 / bf16
  const int mb_max = bits == 4 ? max_row_tiles<4>() : max_row_tiles<8>(), rows = 16 * mb_max;
  const bool k2 = warps_k == 2 && g64;
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0) return "x must be 16-byte aligned (cp.async copies 16 bytes)";
  for (int m0 = 0; m0 < M; m0 += rows) {  // each problem of <= 64 rows reuses ws / locks (stream order)
    MmaArgs a{static_cast<const char*>(x) + (size_t)m0 * K * esz, static_cast<const uint4*>(qweight), scales, zeros,
              bias, static_cast<char*>(out) + (size_t)m0 * N * esz, ws, locks, min(rows, M - m0), N, K,
              k_tiles, n_tiles, n_pad, group_size, groups, per, gs_shift, m0 + rows >= M};
    cudaError_t e;
    if (dt == DType::kHalf)
      e = bits == 4 ? run_rows<half, 4>(a, grid, mb_max, g64, k2, stream)
                    : run_rows<half, 8>(a, grid, mb_max, g64, k2, stream);
    else
      e = bits == 4 ? run_rows<__nv_bfloat16, 4>(a, grid, mb_max, g64, k2, stream)
                    : run_rows<__nv_bfloat16, 8>(a, grid, mb_max, g64, k2, stream);
    if (e != cudaSuccess) return cudaGetErrorString(e);
  }
  return nullptr;
}

const char* launch_w4a16_mma_dequant(DType dt, int bits, const void* qweight, const void* scales, const void* zeros,
                                     void* out, int N, int K, int k_pad, int n_pad, int group_size, int groups,
                                     cudaStream_t stream) {
  if (bits != 4 && bits != 8) return "bits must be 4 or 8";
  if (k_pad % kMmaTileK != 0 || k_pad < K || n_pad % kMmaTileN != 0 || n_pad < N) return "k_pad / n_pad do not cover K / N";
  if (group_size <= 0 || groups <= 0) return "group_size and groups must be positive";
  cudaError_t e;
  if (dt == DType::kHalf)
    e = bits == 4 ? run_dequant<half, 4>(qweight, scales, zeros, out, N, K, k_pad, n_pad, group_size, groups, stream)
                  : run_dequant<half, 8>(qweight, scales, zeros, out, N, K, k_pad, n_pad, group_size, groups, stream);
  else
    e = bits == 4 ? run_dequant<__nv_bfloat16, 4>(qweight, scales, zeros, out, N, K, k_pad, n_pad, group_size, groups, stream)
                  : run_dequant<__nv_bfloat16, 8>(qweight, scales, zeros, out, N, K, k_pad, n_pad, group_size, groups, stream);
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace lqe
