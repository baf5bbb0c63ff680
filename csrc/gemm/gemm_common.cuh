// Shared device helpers for the lqe GEMM kernels: mma.sync wrappers, streaming loads, fast int->half/bf16
// dequantization in the repacked ("interleaved") nibble/byte order, and the split-K fix-up.
//
// Layout contract (mirrored exactly by lqe/kernels/repack.py and emulated by lqe/kernels/gemm_ref.py):
//   lane = threadIdx.x % 32, g8 = lane / 4, t4 = lane % 4.
//   For a 16(K) x 64(N) tile, lane owns columns n = j*8 + g8 (j = 0..7, one mma n8 tile each) and rows
//   k = {2*t4, 2*t4+1, 2*t4+8, 2*t4+9} (the m16n8k16 B fragment: b0 = rows 2t4,2t4+1; b1 = rows +8).
//   4-bit: 4 words per lane; word w holds tiles 2w and 2w+1, logical values
//          v = [tile 2w: k0,k1,k8,k9 | tile 2w+1: k0,k1,k8,k9] at nibble positions [0,4,1,5,2,6,3,7],
//          i.e. position p holds v[{0,2,4,6,1,3,5,7}[p]], so nibbles (p, p+4) form one half2.
//   8-bit: 8 words per lane; word j holds tile j, values [k0,k1,k8,k9] at byte positions [0,2,1,3].
//   Scales/zeros [G, N]: inside every 64-column block, stored column g8*8 + j holds logical column j*8 + g8,
//   so one 16-byte load gives a lane the 8 scales of its 8 columns.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace lqe {

// Ask for the line at p in L1 now, without a register or a wait (a later __ldg of it then hits L1 rather than
// waiting a DRAM round trip). volatile: kept where it is written, beside the loads it travels with.
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }

// Ask for the line at p in L2 (no register, no wait): a PDL kernel's weights, pulled in while the kernel before it
// still runs.
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__device__ __forceinline__ uint4 ld_stream_v4(const uint4* p) {
  // Weights are read exactly once: bypass L1 and do not keep them in it.
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ uint32_t ld_u32(const void* p) { return __ldg(reinterpret_cast<const uint32_t*>(p)); }
// cp.async of 16 bytes to a shared-memory address, commit / wait by commit-group count (not a scoreboard shared with
// other loads)
__device__ __forceinline__ void cp_async16_s(uint32_t s, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(g));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Programmatic dependent launch (PDL, sm_90+). A kernel launched with launch_pdl (below) may start while the kernel
// before it on the stream still runs: before pdl_wait() it may read only what no recent kernel wrote (weights, scales
// and zero points, written once at load, many kernels earlier), and write nothing. pdl_wait() returns once the grid
// before it has completed and its writes are visible. Every thread of every block of a PDL kernel calls it (an early
// exit too) before it exits, so the ordering stays transitive: a grid that skipped the wait could complete before its
// own predecessor, and the grid after it would then run beside that predecessor (two split-K GEMVs on one workspace).
// pdl_launch_dependents() lets the next kernel's blocks be scheduled once every block here has called it (they then
// wait in pdl_wait()). Both are no-ops in a kernel launched without the attribute, and compiled out below sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether `kernel`, as loaded for the current device, was compiled with its pdl_wait(): from PTX of sm_90 or later
// (a kernel JIT-compiled from an older PTX, e.g. a compute_80 fallback, has it compiled out, and launching that one
// with the attribute would let it race the kernel before it). Callers keep the answer in a static per kernel.
template <typename... KArgs>
bool kernel_has_pdl_wait(void (*kernel)(KArgs...)) {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(kernel)) == cudaSuccess && a.ptxVersion >= 90;
}

// Launch kernel<<<grid, block, 0, st>>>(args...), with the programmatic-stream-serialization attribute when pdl
// (the caller asks only on sm_90+, lqe.kernels.device_info.pdl_enabled, and for a kernel_has_pdl_wait kernel).
// Captured into a CUDA graph as a programmatic edge. A launch error is the runtime's last error, which the
// bindings' C10_CUDA_KERNEL_LAUNCH_CHECK raises, as after <<<>>>.
template <typename... KArgs, typename... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, cudaStream_t st, bool pdl, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
}

template <int LUT>
__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(LUT));  // pure: schedulable
  return d;
}

template <typename T> struct MmaF16;
template <> struct MmaF16<half> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct MmaF16<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

__device__ __forceinline__ void mma_s8(int* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<half>(half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ half from_f<half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ uint32_t pack_f2(half, float lo, float hi) {
  half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack_f2(__nv_bfloat16, float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Dequantizer: Dq<T, BITS>::prep(scale, zero) once per group and column; tile(words, j, p, b0, b1) gives the
// two B registers of n8 tile j, each element (code - zero) * scale rounded once to T.
template <typename T, int BITS> struct Dq;

template <> struct Dq<half, 4> {
  struct P { half2 s, zlo, zhi; };
  static __device__ __forceinline__ P prep(half s, half z) {
    P p;
    p.s = __half2half2(s);
    p.zlo = __half2half2(__hadd(__float2half_rn(1024.f), z));  // magic 0x6400 = 1024: h = 1024 + code
    p.zhi = __half2half2(__hadd(__float2half_rn(64.f), z));    // high nibble: h = 1024 + 16*code
    return p;
  }
  static __device__ __forceinline__ void tile(const uint32_t* w, int j, const P& p, uint32_t& b0, uint32_t& b1) {
    const uint32_t q = w[j >> 1] >> ((j & 1) * 8);
    const uint32_t lo = lop3<0xEA>(q, 0x000f000fu, 0x64006400u);  // (q & mask) | magic
    const uint32_t hi = lop3<0xEA>(q, 0x00f000f0u, 0x64006400u);
    half2 l = __hmul2(__hsub2(*reinterpret_cast<const half2*>(&lo), p.zlo), p.s);
    half2 h = __hmul2(__hfma2(*reinterpret_cast<const half2*>(&hi), __float2half2_rn(0.0625f), __hneg2(p.zhi)), p.s);
    b0 = *reinterpret_cast<uint32_t*>(&l);
    b1 = *reinterpret_cast<uint32_t*>(&h);
  }
};

template <> struct Dq<__nv_bfloat16, 4> {
  // bf16 has 7 mantissa bits: magic 0x4300 = 128 takes one nibble at bits 0..3 only, so shift by 4.
  struct P { __nv_bfloat162 s, z; };
  static __device__ __forceinline__ P prep(__nv_bfloat16 s, __nv_bfloat16 z) {
    P p;
    p.s = __bfloat162bfloat162(s);
    p.z = __bfloat162bfloat162(__hadd(__float2bfloat16_rn(128.f), z));
    return p;
  }
  static __device__ __forceinline__ void tile(const uint32_t* w, int j, const P& p, uint32_t& b0, uint32_t& b1) {
    const uint32_t q = w[j >> 1] >> ((j & 1) * 8);
    const uint32_t lo = lop3<0xEA>(q, 0x000f000fu, 0x43004300u);
    const uint32_t hi = lop3<0xEA>(q >> 4, 0x000f000fu, 0x43004300u);
    __nv_bfloat162 l = __hmul2(__hsub2(*reinterpret_cast<const __nv_bfloat162*>(&lo), p.z), p.s);
    __nv_bfloat162 h = __hmul2(__hsub2(*reinterpret_cast<const __nv_bfloat162*>(&hi), p.z), p.s);
    b0 = *reinterpret_cast<uint32_t*>(&l);
    b1 = *reinterpret_cast<uint32_t*>(&h);
  }
};

template <> struct Dq<half, 8> {
  struct P { half2 s, z; };
  static __device__ __forceinline__ P prep(half s, half z) {
    P p;
    p.s = __half2half2(s);
    p.z = __half2half2(__hadd(__float2half_rn(1024.f), z));
    return p;
  }
  static __device__ __forceinline__ void tile(const uint32_t* w, int j, const P& p, uint32_t& b0, uint32_t& b1) {
    const uint32_t lo = __byte_perm(w[j], 0x64646464u, 0x4240);  // bytes 0,2 -> (k0, k1)
    const uint32_t hi = __byte_perm(w[j], 0x64646464u, 0x4341);  // bytes 1,3 -> (k8, k9)
    half2 l = __hmul2(__hsub2(*reinterpret_cast<const half2*>(&lo), p.z), p.s);
    half2 h = __hmul2(__hsub2(*reinterpret_cast<const half2*>(&hi), p.z), p.s);
    b0 = *reinterpret_cast<uint32_t*>(&l);
    b1 = *reinterpret_cast<uint32_t*>(&h);
  }
};

template <> struct Dq<__nv_bfloat16, 8> {
  // 8-bit codes do not fit a bf16 magic number exactly: go through fp32 (magic 2^23), round once.
  struct P { float s, z; };
  static __device__ __forceinline__ P prep(__nv_bfloat16 s, __nv_bfloat16 z) {
    return P{__bfloat162float(s), 8388608.f + __bfloat162float(z)};
  }
  static __device__ __forceinline__ float f(uint32_t w, uint32_t sel, const P& p) {
    return __fmul_rn(__fsub_rn(__uint_as_float(__byte_perm(w, 0x4B000000u, sel)), p.z), p.s);
  }
  static __device__ __forceinline__ void tile(const uint32_t* w, int j, const P& p, uint32_t& b0, uint32_t& b1) {
    const uint32_t q = w[j];
    b0 = pack_f2(__nv_bfloat16(), f(q, 0x7540, p), f(q, 0x7542, p));
    b1 = pack_f2(__nv_bfloat16(), f(q, 0x7541, p), f(q, 0x7543, p));
  }
};

// The dequantize kernels (dequantize + cuBLAS above the GEMMs' crossover): one warp decodes one 16 x 64 tile with the
// GEMMs' registers and Dq<T, BITS> (bit-identical to the B fragments they feed) and writes it to the dense W[K, N].
// A lane's fragment holds 4 rows of one column, so direct stores wrote 2-byte pieces 4 rows apart (16-byte runs per
// row per instruction: the H200 ran lqe-w4a16-mma's dequantize so at 0.15-0.2 TB/s of writes, 89 us for
// 4096 x 6144 against 27 us for the Triton dequantize of the same bytes). The warp stages its tile in shared memory
// and writes it back as whole 128-byte rows, 16 bytes per lane.
constexpr int kDqRow = 64 + 8;  // staged row stride in elements (144 bytes): the 4 rows one store instruction of a
                                // warp touches (2 t4, t4 = 0..3) start 8 banks apart, so the stores do not conflict

// words: this lane's 4 * BITS / 4 fragment words of the tile; p[j]: Dq::prep of the scale (and zero point) of its
// column j * 8 + g8; st: the warp's 16 * kDqRow stage; the tile's rows k0.. and columns col0.. of W[K, N] (rows past
// K and columns past N are not written); vec: N % 8 == 0 and W 16-byte aligned.
template <typename T, int BITS>
__device__ __forceinline__ void dequant_tile_store(const uint32_t* words, const typename Dq<T, BITS>::P (&p)[8],
                                                   T* st, T* __restrict__ W, int N, int K, int k0, int col0,
                                                   bool vec) {
  const int lane = threadIdx.x & 31, g8 = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    uint32_t b[2];
    Dq<T, BITS>::tile(words, j, p[j], b[0], b[1]);
    const T* e = reinterpret_cast<const T*>(b);  // tile rows 2t4, 2t4+1, 2t4+8, 2t4+9 of tile column 8 j + g8
    T* c = st + 2 * t4 * kDqRow + j * 8 + g8;
    c[0] = e[0];
    c[kDqRow] = e[1];
    c[8 * kDqRow] = e[2];
    c[9 * kDqRow] = e[3];
  }
  __syncwarp();
  // 16 rows x 8 chunks of 8 columns: lane l moves chunks l, l + 32, l + 64, l + 96 (8 lanes per row)
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int q = i * 32 + lane, r = q >> 3, c = (q & 7) * 8, k = k0 + r, col = col0 + c;
    if (k >= K || col >= N) continue;
    const T* src = st + r * kDqRow + c;
    T* dst = W + (size_t)k * N + col;
    if (vec) {  // the chunk is whole and aligned
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
#pragma unroll
      for (int u = 0; u < 8; ++u)
        if (col + u < N) dst[u] = src[u];
    }
  }
}

// Split-K fix-up (threadFenceReduction pattern): every split stores its fp32/int32 partial tile into
// ws[split][M][N]; the last block to arrive on a tile (counted in counters[tile], reset to 0 by it) sums
// the splits and applies the epilogue. Deterministic: the sum runs in split order.
__device__ __forceinline__ bool splitk_arrive(int* counters) {
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int tile = blockIdx.y * gridDim.x + blockIdx.x;
    const int prev = atomicAdd(&counters[tile], 1);
    last = prev == (int)gridDim.z - 1;
    if (last) counters[tile] = 0;
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// splitk_arrive with one release-acquire atomic in thread 0 after the barrier (the pattern of lqe-w4a16-mma's
// finish_piece; release is cumulative at gpu scope over the block's stores the barrier ordered before it): no
// MEMBAR.SC.GPU + L1 invalidation in every thread and no second fence in the last block, whose partial loads are
// __ldcg (L2) after the acquire and the barrier. A SASS review counted the fences at 2 of the tail's 5-6 dependent L2
// round trips (~45 % of a 4096 x 4096 M = 1 call). Used by the lqe-wna16-ring candidate only. NOT MEASURED.
__device__ __forceinline__ bool splitk_arrive_acq_rel(int* counters) {
  __shared__ int last;
  __syncthreads();  // every thread's partial stores precede thread 0's release
  if (threadIdx.x == 0) {
    const int tile = blockIdx.y * gridDim.x + blockIdx.x;
    int prev;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(prev) : "l"(counters + tile) : "memory");
    last = prev == (int)gridDim.z - 1;
    if (last) counters[tile] = 0;
  }
  __syncthreads();
  return last;
}

// One split's partial added to a running sum: scalars, and the float2 of two adjacent fp32 elements.
template <typename A>
__device__ __forceinline__ void splitk_add(A& s, const A& v) { s += v; }
__device__ __forceinline__ void splitk_add(float2& s, const float2& v) {
  s.x += v.x;
  s.y += v.y;
}

// The splits' partials of one output element (or a float2 of two adjacent ones) summed in split order
// (deterministic), 16 loads in flight: the last block of a tile sums ~22-32 splits per element at M = 1 (the decode
// shapes at 4 blocks per SM), and each dependent L2 round trip is a serial step of the call's tail. The remainder past
// the last whole 16 is one more round of predicated loads (it was up to 7 rounds of one load each at 22 splits); loads
// past `splits` add nothing, so every component is the same sequence of adds. `p` points at split 0's element; splits
// are `stride` elements of A apart.
// (W: loads in flight per round; 32 covers the M = 1 decode shapes' splits in one round)
template <typename A, int W = 16>
__device__ __forceinline__ A splitk_sum(const A* p, size_t stride, int splits) {
  A s{};
  int z = 0;
  for (; z + W <= splits; z += W) {
    A part[W];
#pragma unroll
    for (int u = 0; u < W; ++u) part[u] = __ldcg(p + (size_t)(z + u) * stride);
#pragma unroll
    for (int u = 0; u < W; ++u) splitk_add(s, part[u]);
  }
  if (z < splits) {
    A part[W];
#pragma unroll
    for (int u = 0; u < W; ++u) part[u] = z + u < splits ? __ldcg(p + (size_t)(z + u) * stride) : A{};
#pragma unroll
    for (int u = 0; u < W; ++u)
      if (z + u < splits) splitk_add(s, part[u]);
  }
  return s;
}

}  // namespace lqe
