// torch bindings for the lqe GEMM kernels: validate tensors (dtype, device, shape, contiguity) and launch on
// the current stream. Allocation policy (split counts, counters) is decided in lqe/kernels/gemm.py.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "gemm_launch.h"
#include "w4a16_mma.h"

namespace {

lqe::DType act_dtype(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
              "lqe gemm: activations must be float16 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kHalf ? lqe::DType::kHalf : lqe::DType::kBFloat16;
}

void check(const at::Tensor& t, const char* name, const at::Tensor& ref) {
  TORCH_CHECK(t.is_cuda() && t.device() == ref.device(), "lqe gemm: ", name, " must be on ", ref.device());
  TORCH_CHECK(t.is_contiguous(), "lqe gemm: ", name, " must be contiguous");
}

const void* opt_ptr(const c10::optional<at::Tensor>& t, const char* name, const at::Tensor& ref) {
  if (!t.has_value()) return nullptr;
  check(*t, name, ref);
  return t->data_ptr();
}

void raise_if(const char* err) {
  TORCH_CHECK(err == nullptr, "lqe gemm: ", err ? err : "");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// out = x @ W (+ bias); splits/slabs_per_split chosen by the caller; ws/counters only used when splits > 1.
at::Tensor wna16_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& bias, at::Tensor out,
                      int64_t bits, int64_t group_size, int64_t slabs_per_split, const at::Tensor& counters,
                      bool ring, bool pdl) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto dt = act_dtype(x);
  check(x, "x", x); check(qweight, "qweight", x); check(scales, "scales", x); check(out, "out", x);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "lqe gemm: x and out must be 2-D");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(out.size(0) == M && out.scalar_type() == x.scalar_type(), "lqe gemm: out must be [M, N] in x's dtype");
  TORCH_CHECK(scales.scalar_type() == x.scalar_type() && scales.size(1) == N, "lqe gemm: scales must be [G, N] in x's dtype");
  TORCH_CHECK(qweight.numel() * 32 == K * N * bits, "lqe gemm: qweight holds ", qweight.numel(), " words, expected K*N*bits/32");
  const int64_t splits = (K / 16 + slabs_per_split - 1) / slabs_per_split;
  at::Tensor ws;
  if (splits > 1) {
    check(counters, "counters", x);
    const int64_t tiles = ((N + lqe::kWna16BlockN - 1) / lqe::kWna16BlockN) * ((M + 15) / 16);
    TORCH_CHECK(counters.scalar_type() == at::kInt && counters.numel() >= tiles, "lqe gemm: counters too small");
    ws = at::empty({splits, M, N}, x.options().dtype(at::kFloat));
  }
  raise_if(lqe::launch_wna16_gemm(dt, (int)bits, x.data_ptr(), qweight.data_ptr(), scales.data_ptr(),
                                  opt_ptr(zeros, "zeros", x), opt_ptr(bias, "bias", x), out.data_ptr(),
                                  splits > 1 ? ws.data_ptr<float>() : nullptr,
                                  splits > 1 ? counters.data_ptr<int>() : nullptr, (int)M, (int)N, (int)K,
                                  (int)group_size, (int)slabs_per_split, ring, pdl,
                                  c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor wna16_dequant(const at::Tensor& qweight, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                         at::Tensor out, int64_t bits, int64_t group_size) {
  const c10::cuda::CUDAGuard guard(out.device());
  const auto dt = act_dtype(out);
  check(qweight, "qweight", out); check(scales, "scales", out); check(out, "out", out);
  const int64_t K = out.size(0), N = out.size(1);
  TORCH_CHECK(qweight.numel() * 32 == K * N * bits, "lqe dequant: qweight size does not match out [K, N]");
  raise_if(lqe::launch_wna16_dequant(dt, (int)bits, qweight.data_ptr(), scales.data_ptr(), opt_ptr(zeros, "zeros", out),
                                     out.data_ptr(), (int)N, (int)K, (int)group_size,
                                     c10::cuda::getCurrentCUDAStream()));
  return out;
}

// lqe-w4a16-mma (csrc/gemm/w4a16_mma.cu): out = x @ W (+ bias) on the repack_mma layout. ws (fp32, the stripe
// plan's slots x 64 x n_pad: checked by the launcher) and locks (int32, >= n_pad / 256, zero; a launch that failed
// midway may leave them non-zero: reserve new ones) are preallocated by the caller (lqe.kernels.gemm_mma
// reserve_workspace, at load), so a call allocates nothing and can be captured in a CUDA graph.
at::Tensor w4a16_mma_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& bias,
                          at::Tensor out, const at::Tensor& ws, const at::Tensor& locks, int64_t bits,
                          int64_t group_size, int64_t k_pad, int64_t n_pad, int64_t sms, int64_t warps_k) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto dt = act_dtype(x);
  check(x, "x", x); check(qweight, "qweight", x); check(scales, "scales", x); check(out, "out", x);
  check(ws, "ws", x); check(locks, "locks", x);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "lqe w4a16-mma: x and out must be 2-D");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(out.size(0) == M && out.scalar_type() == x.scalar_type(), "lqe w4a16-mma: out must be [M, N] in x's dtype");
  TORCH_CHECK(scales.scalar_type() == x.scalar_type() && scales.dim() == 2 && scales.size(1) == n_pad,
              "lqe w4a16-mma: scales must be [G, n_pad] in x's dtype");
  if (zeros.has_value()) TORCH_CHECK(zeros->scalar_type() == x.scalar_type() && zeros->sizes() == scales.sizes(),
                                     "lqe w4a16-mma: zeros must be shaped and typed like scales");
  if (bias.has_value()) TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->numel() == N,
                                    "lqe w4a16-mma: bias must be [N] in x's dtype");
  TORCH_CHECK(qweight.numel() * 32 == k_pad * n_pad * bits, "lqe w4a16-mma: qweight holds ", qweight.numel(),
              " words, expected k_pad*n_pad*bits/32");
  TORCH_CHECK(ws.scalar_type() == at::kFloat && ws.numel() >= lqe::kMmaMaxRows * n_pad,
              "lqe w4a16-mma: ws must be float32 with >= 64 * n_pad elements (the stripe plan's slots x 64 x n_pad: "
              "lqe.kernels.gemm_mma.reserve_workspace)");
  TORCH_CHECK(locks.scalar_type() == at::kInt && locks.numel() >= n_pad / lqe::kMmaTileN,
              "lqe w4a16-mma: locks must be int32 with >= n_pad / 256 elements");
  TORCH_CHECK(group_size > 0 && scales.size(0) >= (K + group_size - 1) / group_size,
              "lqe w4a16-mma: scales has ", scales.size(0), " groups, K=", K, " needs ceil(K / group_size=",
              group_size, ")");
  // cp.async copies 16 bytes from qweight / scales / zeros, the epilogue stores two outputs as one 32-bit word
  const auto misaligned = [](const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n != 0; };
  TORCH_CHECK(!misaligned(qweight.data_ptr(), 16) && !misaligned(scales.data_ptr(), 16) &&
                  !(zeros.has_value() && misaligned(zeros->data_ptr(), 16)) && !misaligned(out.data_ptr(), 4) &&
                  !misaligned(ws.data_ptr(), 8),
              "lqe w4a16-mma: qweight / scales / zeros must be 16-byte aligned, out 4-byte and ws 8-byte aligned "
              "(a view at an odd offset: pass a copy)");
  raise_if(lqe::launch_w4a16_mma(dt, (int)bits, x.data_ptr(), qweight.data_ptr(), scales.data_ptr(),
                                 opt_ptr(zeros, "zeros", x), opt_ptr(bias, "bias", x), out.data_ptr(),
                                 ws.data_ptr<float>(), (size_t)ws.numel(), locks.data_ptr<int>(), (int)M, (int)N,
                                 (int)K, (int)k_pad,
                                 (int)n_pad, (int)group_size, (int)scales.size(0), (int)sms, (int)warps_k,
                                 c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor w4a16_mma_dequant(const at::Tensor& qweight, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& zeros, at::Tensor out, int64_t bits, int64_t group_size,
                             int64_t k_pad, int64_t n_pad) {
  const c10::cuda::CUDAGuard guard(out.device());
  const auto dt = act_dtype(out);
  check(qweight, "qweight", out); check(scales, "scales", out); check(out, "out", out);
  TORCH_CHECK(out.dim() == 2 && scales.scalar_type() == out.scalar_type() && scales.size(1) == n_pad,
              "lqe w4a16-mma dequant: out must be [K, N] and scales [G, n_pad] in one dtype");
  if (zeros.has_value()) TORCH_CHECK(zeros->sizes() == scales.sizes() && zeros->scalar_type() == scales.scalar_type(),
                                     "lqe w4a16-mma dequant: zeros must be shaped and typed like scales");
  TORCH_CHECK(qweight.numel() * 32 == k_pad * n_pad * bits, "lqe w4a16-mma dequant: qweight size does not match k_pad*n_pad");
  raise_if(lqe::launch_w4a16_mma_dequant(dt, (int)bits, qweight.data_ptr(), scales.data_ptr(),
                                         opt_ptr(zeros, "zeros", out), out.data_ptr(), (int)out.size(1),
                                         (int)out.size(0), (int)k_pad, (int)n_pad, (int)group_size,
                                         (int)scales.size(0), c10::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor w8a8_gemm(const at::Tensor& xq, const at::Tensor& a_scale, const c10::optional<at::Tensor>& azp,
                     const at::Tensor& wq, const at::Tensor& w_scale, const c10::optional<at::Tensor>& colsum,
                     const c10::optional<at::Tensor>& bias, at::Tensor out, int64_t slabs_per_split,
                     const at::Tensor& counters) {
  const c10::cuda::CUDAGuard guard(xq.device());
  const auto dt = act_dtype(out);
  check(xq, "xq", xq); check(a_scale, "a_scale", xq); check(wq, "wq", xq); check(w_scale, "w_scale", xq);
  check(out, "out", xq);
  TORCH_CHECK(xq.scalar_type() == at::kChar && xq.dim() == 2, "lqe w8a8: xq must be int8 [M, K]");
  const int64_t M = xq.size(0), K = xq.size(1), N = out.size(1);
  TORCH_CHECK(a_scale.scalar_type() == at::kFloat && a_scale.numel() == M, "lqe w8a8: a_scale must be float32 [M]");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == N, "lqe w8a8: w_scale must be float32 [N]");
  TORCH_CHECK(wq.numel() * 4 == K * N, "lqe w8a8: packed weight size does not match K*N");
  if (azp.has_value()) TORCH_CHECK(azp->scalar_type() == at::kInt && azp->numel() == M, "lqe w8a8: azp must be int32 [M]");
  if (colsum.has_value()) TORCH_CHECK(colsum->scalar_type() == at::kInt && colsum->numel() == N, "lqe w8a8: colsum must be int32 [N]");
  if (bias.has_value()) TORCH_CHECK(bias->scalar_type() == out.scalar_type() && bias->numel() == N, "lqe w8a8: bias must be [N] in out's dtype");
  const int64_t splits = (K / 32 + slabs_per_split - 1) / slabs_per_split;
  at::Tensor ws;
  if (splits > 1) {
    check(counters, "counters", xq);
    const int64_t tiles = ((N + lqe::kW8a8BlockN - 1) / lqe::kW8a8BlockN) * ((M + 15) / 16);
    TORCH_CHECK(counters.scalar_type() == at::kInt && counters.numel() >= tiles, "lqe w8a8: counters too small");
    ws = at::empty({splits, M, N}, xq.options().dtype(at::kInt));
  }
  raise_if(lqe::launch_w8a8_gemm(dt, xq.data_ptr<int8_t>(), wq.data_ptr(), a_scale.data_ptr<float>(),
                                 azp.has_value() ? azp->data_ptr<int32_t>() : nullptr, w_scale.data_ptr<float>(),
                                 colsum.has_value() ? colsum->data_ptr<int32_t>() : nullptr, opt_ptr(bias, "bias", xq),
                                 out.data_ptr(), splits > 1 ? ws.data_ptr<int32_t>() : nullptr,
                                 splits > 1 ? counters.data_ptr<int>() : nullptr, (int)M, (int)N, (int)K,
                                 (int)slabs_per_split, c10::cuda::getCurrentCUDAStream()));
  return out;
}

void quantize_per_token(const at::Tensor& x, at::Tensor q, at::Tensor scale, const c10::optional<at::Tensor>& azp) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto dt = act_dtype(x);
  check(x, "x", x); check(q, "q", x); check(scale, "scale", x);
  TORCH_CHECK(x.dim() == 2 && q.sizes() == x.sizes() && q.scalar_type() == at::kChar, "lqe quant: q must be int8 like x");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == x.size(0), "lqe quant: scale must be float32 [M]");
  int32_t* zp = nullptr;
  if (azp.has_value()) {
    check(*azp, "azp", x);
    TORCH_CHECK(azp->scalar_type() == at::kInt && azp->numel() == x.size(0), "lqe quant: azp must be int32 [M]");
    zp = azp->data_ptr<int32_t>();
  }
  raise_if(lqe::launch_quantize_per_token(dt, x.data_ptr(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), zp,
                                          (int)x.size(0), (int)x.size(1), c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("wna16_gemm", &wna16_gemm, pybind11::arg("x"), pybind11::arg("qweight"), pybind11::arg("scales"),
        pybind11::arg("zeros"), pybind11::arg("bias"), pybind11::arg("out"), pybind11::arg("bits"),
        pybind11::arg("group_size"), pybind11::arg("slabs_per_split"), pybind11::arg("counters"),
        pybind11::arg("ring") = false, pybind11::arg("pdl") = false);
  m.def("wna16_dequant", &wna16_dequant);
  m.def("w4a16_mma_gemm", &w4a16_mma_gemm);
  m.def("w4a16_mma_dequant", &w4a16_mma_dequant);
  m.def("w8a8_gemm", &w8a8_gemm);
  m.def("quantize_per_token", &quantize_per_token);
}
