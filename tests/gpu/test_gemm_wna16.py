"""GPU: lqe W4A16/W8A16 CUDA GEMM and dequantize kernels against the canonical torch reference."""
from __future__ import annotations

import functools

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from lqe.kernels import gemm, gemm_ref, repack  # noqa: E402
from helpers import random_canonical as canonical  # noqa: E402  (tests/ is on sys.path)

MS = [1, 7, 16, 33, 64, 257, 1024]
SHAPES = [(256, 192), (1024, 256), (4096, 4096)]
DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def built():
    if not gemm.available():
        pytest.fail(f"lqe CUDA kernels did not build: {gemm.unavailable_reason()}")


def reference(x, cw, bias):
    w = cw.dequantize(torch.float32).to(x.device).to(x.dtype).float()  # kernel rounds weights to x's dtype
    y = x.float() @ w
    return y if bias is None else y + bias.float()


def check(y, ref, k):
    tol = (2e-2 if y.dtype == torch.bfloat16 else 4e-3) * ref.abs().max().item() + 1e-3
    torch.testing.assert_close(y.float(), ref, rtol=0, atol=tol)
    assert not torch.isnan(y).any()


def run_case(m, k, n, bits, gs, asym, act_order, dtype, path, splits=None, with_bias=True):
    cw = canonical(k, n, bits, gs, asym, act_order, seed=m * 131 + k + n + bits + gs)
    kernel, reason = gemm.select_w4a16_kernel(cw, "cuda", dtype)
    assert kernel is not None, reason
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype) if with_bias else None
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)  # poisoned
    y = gemm.wna16_gemm(x, kernel.packed, bias, out=out, splits=splits, path=path)
    torch.cuda.synchronize()
    assert y.data_ptr() == out.data_ptr()
    check(y, reference(x, cw, bias), k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128, -1])
@pytest.mark.parametrize("asym,act_order", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("m", [1, 7, 33])
def test_fused_all_formats(dtype, bits, gs, asym, act_order, m):
    run_case(m, 1024, 256, bits, gs, asym, act_order, dtype, "fused")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("path", ["fused", "dequant", "auto"])
def test_all_m_and_paths(dtype, m, k, n, path):
    run_case(m, k, n, 4, 128, False, False, dtype, path)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 128, -1])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("splits", [1, None])
def test_ring_equals_the_register_buffered_gemv(dtype, bits, gs, asym, m, splits):
    """lqe-wna16-ring (the weights through a per-warp cp.async ring: 4 stages of 4 slabs for 4-bit, 2 for 8-bit) runs
    the same arithmetic in the same order as lqe-wna16-fused: equal outputs, bit for bit, for every format, M <= 16
    and split (1 split: a long ring walk over K = 4096; None: the SM-count split), against the
    reference too. Above M = 16 the name runs the default kernel."""
    k, n = 4096, 320
    cw = canonical(k, n, bits, gs, asym, False, seed=m + bits + gs)
    kernel, reason = gemm.select_w4a16_kernel(cw, "cuda", dtype)
    assert kernel is not None, reason
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    ring = gemm.wna16_gemm(x, kernel.packed, bias, splits=splits, path="lqe-wna16-ring")
    fused = gemm.wna16_gemm(x, kernel.packed, bias, splits=splits, path="lqe-wna16-fused")
    assert torch.equal(ring, fused)
    check(ring, reference(x, cw, bias), k)


def _pdl_chain(layers, x, path, pdl, splits):
    """x through the square layers one after another: GEMV after GEMV (each reads the one before's output, the same
    split-K counters, and a workspace the allocator hands back as the one before frees it), a torch kernel (no PDL)
    after every second one to keep the values in range."""
    for i, (packed, bias) in enumerate(layers):
        x = gemm.wna16_gemm(x, packed, bias, splits=splits, path=path, pdl=pdl)
        if i % 2:
            x = x * 0.03
    return x


@pytest.mark.parametrize("path", ["lqe-wna16-fused", "lqe-wna16-ring"])
@pytest.mark.parametrize("m", [1, 4, 16, 33])
@pytest.mark.parametrize("splits", [None, 1])
def test_pdl_gives_the_same_outputs(path, m, splits):
    """Programmatic dependent launch (pdl=True, sm_90+: each GEMV requests its first weight batches before it waits
    for the kernel before it) changes no output bit, eager and in a CUDA graph: a chain of six GEMVs where each reads
    the one before's output (a missing or misplaced pdl_wait reads stale activations or races the split-K workspace
    and counters). Below sm_90 pdl=True is refused with an error naming the device."""
    dtype, k = torch.bfloat16, 2048
    layers = []
    for i in range(6):
        cw = canonical(k, k, 4 if i % 3 else 8, 128, bool(i % 2), False, seed=100 + i)
        kernel, reason = gemm.select_w4a16_kernel(cw, "cuda", dtype)
        assert kernel is not None, reason
        layers.append((kernel.packed, torch.randn(k, device="cuda", dtype=dtype) if i % 2 else None))
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    if not gemm.pdl_supported(x.device):
        with pytest.raises(ValueError, match="compute capability 9.0"):
            gemm.wna16_gemm(x, layers[0][0], path=path, pdl=True)
        return
    want = _pdl_chain(layers, x, path, False, splits)
    for _ in range(3):
        assert torch.equal(_pdl_chain(layers, x, path, True, splits), want)
    xs = x.clone()
    _pdl_chain(layers, xs, path, True, splits)  # warm-up (workspace and counters allocated) before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = _pdl_chain(layers, xs, path, True, splits)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
    xs.copy_(torch.randn(m, k, device="cuda", dtype=dtype))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, _pdl_chain(layers, xs, path, False, splits))


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("m", [1, 16, 64, 257])
def test_split_k_counts(splits, m):
    run_case(m, 1024, 320, 4, 64, True, True, torch.float16, "fused", splits=splits)


def test_split_k_is_deterministic_and_reusable():
    cw = canonical(4096, 256, 4, 128, True, False, seed=9)
    kernel, _ = gemm.select_w4a16_kernel(cw, "cuda", torch.float16)
    x = torch.randn(3, 4096, device="cuda", dtype=torch.float16)
    ys = [gemm.wna16_gemm(x, kernel.packed, splits=16, path="fused").clone() for _ in range(5)]
    assert all(torch.equal(ys[0], y) for y in ys[1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("asym", [False, True])
def test_dequant_kernel_matches_emulation_exactly(dtype, bits, asym):
    cw = canonical(512, 384, bits, 64, asym, True, seed=bits)
    cw.scales = cw.scales.to(dtype).float()
    p = repack.repack_wna16(cw, dtype)
    pg = repack.PackedWNA16(p.qweight.cuda(), p.scales.cuda(), None if p.zeros is None else p.zeros.cuda(),
                            p.perm, p.bits, p.group_size, p.k, p.n)
    w = gemm.wna16_dequantize(pg).cpu()
    assert torch.equal(w, gemm_ref.dequantize_wna16(p))
    assert torch.equal(w, cw.dequantize(torch.float32)[p.perm].to(dtype))


@pytest.mark.parametrize("offset", [0, 1])
def test_dequant_kernel_writes_every_element_aligned_or_not(offset):
    """The CUDA dequantize writes whole rows from its shared-memory stage, 16 bytes per lane where ``out`` is 16-byte
    aligned and element by element where not (a view at an odd offset): every element of a NaN-poisoned ``out`` is
    written, with the emulation's bits, on a Llama-3-8B-wide shape (many blocks of 8 tiles)."""
    k, n = 1024, 4096
    cw = canonical(k, n, 4, 128, True, False, seed=offset)
    cw.scales = cw.scales.to(torch.bfloat16).float()
    p = repack.repack_wna16(cw, torch.bfloat16)
    buf = torch.full((k * n + offset,), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = buf[offset:].view(k, n)
    assert (out.data_ptr() % 16 == 0) == (offset == 0)
    gemm._ext().wna16_dequant(p.qweight.cuda(), p.scales.cuda(), p.zeros.cuda(), out, 4, 128)
    assert torch.equal(out.cpu(), gemm_ref.dequantize_wna16(p))


def test_batched_leading_dims_and_callable():
    cw = canonical(512, 128, 4, 128, False, False, seed=1)
    kernel, reason = gemm.select_w4a16_kernel(cw, torch.device("cuda"), torch.bfloat16)
    assert "lqe-wna16" in reason
    x = torch.randn(2, 3, 512, device="cuda", dtype=torch.bfloat16)
    y = kernel(x)
    assert y.shape == (2, 3, 128)
    check(y.reshape(6, 128), reference(x.reshape(6, 512), cw, None), 512)


def test_select_reports_fallback_reasons():
    cw = canonical(96, 96, 4, 32, False, False, seed=0)
    fn, reason = gemm.select_w4a16_kernel(cw, "cuda", torch.float32)
    assert fn is None and "multiples of 64" in reason and "float32" in reason


# ------------------------------------------------------------------------------------ Triton kernels (same layout)
from lqe.kernels import triton_wna16 as tw  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128, -1])
@pytest.mark.parametrize("asym,act_order", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("m", [7, 33, 100])
def test_triton_all_formats(dtype, bits, gs, asym, act_order, m):
    run_case(m, 1024, 256, bits, gs, asym, act_order, dtype, "triton-wna16")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128, -1])
@pytest.mark.parametrize("asym,act_order", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("m", [7, 100])
def test_triton_swap_all_formats(dtype, bits, gs, asym, act_order, m):
    """The swapped-operand kernel (out^T = W^T x^T, its own config table) on every format."""
    run_case(m, 1024, 256, bits, gs, asym, act_order, dtype, "triton-wna16-swap")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("k,n", SHAPES + [(576, 1536), (14336, 4096)])
@pytest.mark.parametrize("path", ["triton-wna16", "triton-wna16-swap", "triton-dequant+cublas"])
def test_triton_all_m(dtype, m, k, n, path):
    run_case(m, k, n, 4, 128, False, False, dtype, path)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 257, 1024])
@pytest.mark.parametrize("k,n", [(4096, 4096), (14336, 4096), (4096, 28672)])
def test_triton_dequant_l2_chunks(dtype, m, k, n):
    """Dequantize + cuBLAS in L2-sized column chunks (triton-dequant-l2+cublas) on Llama-3-8B shapes, which chunk
    on an H100 / H200 (each chunk's dequantize writes a view of one buffer, its GEMM a column slice of out); checked
    against the one-pass dequantize + cuBLAS on the same weights (one weight and reference per shape and dtype)."""
    assert tw.l2_chunk_cols(k, n, torch.device("cuda")) < n
    packed, w = _l2_case(k, n, dtype)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    y = gemm.wna16_gemm(x, packed, bias, out=out, path="triton-dequant-l2+cublas")
    assert y.data_ptr() == out.data_ptr()
    check(y, (x.float() @ w.float() + bias.float()), k)


@functools.lru_cache(maxsize=None)
def _l2_case(k, n, dtype):
    """A 4-bit g128 asymmetric weight on the GPU and its dequantized [K, N] (the one-pass Triton dequantize)."""
    cw = canonical(k, n, 4, 128, True, False, seed=k + n)
    kernel, reason = gemm.select_w4a16_kernel(cw, "cuda", dtype)
    assert kernel is not None, reason
    return kernel.packed, tw.dequantize(kernel.packed)


@pytest.mark.parametrize("m", [8, 16, 32, 64, 128, 1024])
def test_every_sweep_config_is_correct(m):
    """The benchmark sweep must only time correct kernels."""
    cw = canonical(1024, 512, 4, 128, True, False, seed=m)
    kernel, _ = gemm.select_w4a16_kernel(cw, "cuda", torch.bfloat16)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    ref = reference(x, cw, None)
    for cfg in tw.sweep_configs(m):
        check(gemm.wna16_gemm(x, kernel.packed, path="triton-wna16", config=cfg), ref, 1024)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("asym", [False, True])
def test_triton_dequant_bit_equal_to_cuda(dtype, bits, asym):
    cw = canonical(576, 384, bits, 128, asym, True, seed=bits + 7)
    kernel, _ = gemm.select_w4a16_kernel(cw, "cuda", dtype)
    assert torch.equal(gemm.wna16_dequantize(kernel.packed, "triton"), gemm.wna16_dequantize(kernel.packed, "cuda"))


def test_triton_split_k_is_deterministic():
    cw = canonical(4096, 256, 4, 128, True, True, seed=3)
    kernel, _ = gemm.select_w4a16_kernel(cw, "cuda", torch.bfloat16)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    cfg = tw.WNA16Config(16, 64, 128, 4, 4, split_k=8)
    ys = [gemm.wna16_gemm(x, kernel.packed, path="triton-wna16", config=cfg).clone() for _ in range(5)]
    assert all(torch.equal(ys[0], y) for y in ys[1:])
    check(ys[0], reference(x, cw, None), 4096)


@pytest.mark.parametrize("m", [1, 4, 16, 64, 300])
def test_auto_path_is_graph_capturable(m):
    """Every table row (CUDA GEMM, Triton GEMM + split-K reduce, dequantize + cuBLAS) under CUDA-graph capture."""
    cw = canonical(1024, 512, 4, 128, True, True, seed=m)
    kernel, _ = gemm.select_w4a16_kernel(cw, "cuda", torch.bfloat16)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    kernel(x, bias)  # compile / build outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kernel(x, bias)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = kernel(x, bias)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    check(y, reference(x, cw, bias), 1024)
