"""GPU: lqe W8A8 int8 GEMM, per-token quantization and the FP8 wrapper against torch references."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from lqe.kernels import gemm, gemm_ref, repack, w8a8  # noqa: E402

MS = [1, 7, 16, 33, 64, 257, 1024]


@pytest.fixture(scope="module", autouse=True)
def built():
    if not gemm.available():
        pytest.fail(f"lqe CUDA kernels did not build: {gemm.unavailable_reason()}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("m,k", [(1, 64), (7, 4096), (33, 1000), (257, 14336)])
def test_quantize_per_token_bit_exact(dtype, symmetric, m, k):
    """The kernel against the contract, reference.per_token_quant_int8, evaluated on CPU: torch on CUDA computes
    ``tensor / 127.0`` as ``tensor * (1/127)``, which is not the IEEE quotient (csrc/gemm/quant_per_token.cu)."""
    from lqe.quant_layers.reference import per_token_quant_int8

    x = (torch.randn(m, k, device="cuda") * 4 + (0 if symmetric else 2)).to(dtype)
    if m > 2:
        x[1] = 0
    if m > 5:
        x[3] = x[3].abs() + 1  # a row whose range excludes 0 (asym: its own min, not 0)
        x[4] = 0.75  # constant row: asym scale 0
    q, s, azp = w8a8.quantize_per_token(x, symmetric)
    qr, sr, azpr = per_token_quant_int8(x.cpu(), symmetric)
    assert torch.equal(q.cpu(), qr) and torch.equal(s.cpu(), sr.reshape(-1))
    if not symmetric:
        assert torch.equal(azp.cpu(), azpr.reshape(-1))
    assert (s > 0).sum() == m - (m > 2) - (0 if symmetric else (m > 5))


def make(k, n, seed):
    g = torch.Generator().manual_seed(seed)
    wq = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=g)
    ws = torch.rand(n, generator=g) * 0.01 + 1e-3
    p = repack.repack_w8a8(wq, ws)
    return p, repack.PackedW8A8(p.qweight.cuda(), p.w_scale.cuda(), p.colsum.cuda(), p.k, p.n)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("k,n", [(256, 192), (4096, 1024), (14336, 256)])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_w8a8_gemm(out_dtype, symmetric, m, k, n, splits):
    p_cpu, p = make(k, n, seed=m + k + n)
    x = torch.randn(m, k, device="cuda", dtype=out_dtype) + (0 if symmetric else 0.5)
    q, s, azp = w8a8.quantize_per_token(x, symmetric)
    bias = torch.randn(n, device="cuda", dtype=out_dtype)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
    y = w8a8.w8a8_gemm(q, s, p, azp, bias, out_dtype, out=out, splits=splits)
    acc = q.double() @ gemm_ref.unpack_w8a8(p_cpu).cuda().double()  # exact: |acc| < 2^53
    if azp is not None:
        acc = acc - azp.double()[:, None] * p.colsum.double()[None, :]
    ref = (acc * s.double()[:, None] * p.w_scale.double()[None, :] + bias.double()).float()
    tol = (1e-2 if out_dtype == torch.bfloat16 else 2e-3) * ref.abs().max().item() + 1e-3
    torch.testing.assert_close(y.float(), ref, rtol=0, atol=tol)


def test_w8a8_static_scalar_scale_and_linear():
    p_cpu, p = make(512, 128, seed=3)
    x = torch.randn(5, 512, device="cuda", dtype=torch.bfloat16)
    y = w8a8.w8a8_linear(x, p)
    w = (gemm_ref.unpack_w8a8(p_cpu).float() * p_cpu.w_scale).cuda()
    ref = x.float() @ w
    torch.testing.assert_close(y.float(), ref, rtol=0, atol=0.03 * ref.abs().max().item())
    q = torch.randint(-127, 128, (5, 512), dtype=torch.int8, device="cuda")
    y2 = w8a8.w8a8_gemm(q, torch.tensor(0.02, device="cuda"), p, out_dtype=torch.float16)
    ref2 = gemm_ref.w8a8_gemm_ref(q, torch.full((5,), 0.02), None, p_cpu, None, torch.float32)
    torch.testing.assert_close(y2.float().cpu(), ref2, rtol=0, atol=2e-3 * ref2.abs().max().item())


@pytest.mark.skipif(torch.cuda.is_available() and w8a8.fp8_supported() is not None, reason="needs sm89+")
@pytest.mark.parametrize("m", [1, 16, 257])
def test_fp8_linear(m):
    w = torch.randn(1024, 512, device="cuda") * 0.05
    wq, ws = w8a8.fp8_quantize_weight(w)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    y = w8a8.fp8_linear(x, wq, ws)
    ref = x.float() @ w
    torch.testing.assert_close(y.float(), ref, rtol=0, atol=0.06 * ref.abs().max().item())


# ------------------------------------------------------------------------------------------------ Triton / int_mm
def _case(m, k, n, symmetric, dtype, seed=0):
    from lqe.quant_layers.reference import int8_gemm_ref

    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g).cuda()
    ws = (torch.rand(n, generator=g) * 0.01 + 1e-3).cuda()
    x = (torch.randn(m, k, generator=g) + (0 if symmetric else 0.5)).to(dtype).cuda()
    q, s, azp = w8a8.quantize_per_token(x, symmetric)
    bias = torch.randn(n, generator=g).to(dtype).cuda()
    colsum = w.to(torch.int32).sum(1, dtype=torch.int32)
    ref = int8_gemm_ref(q, w, s.reshape(-1, 1), ws, None if azp is None else azp.reshape(-1, 1), bias,
                        torch.float32).cpu()  # float64 on the GPU: exact, and seconds faster than the CPU
    return q, s, azp, w, ws, colsum, bias, ref


def _close(y, ref, dtype):
    tol = (8e-3 if dtype == torch.bfloat16 else 1e-3) * ref.abs().max().item() + 1e-3
    torch.testing.assert_close(y.float().cpu(), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("m", [1, 7, 16, 33, 64, 100, 257, 1024])
@pytest.mark.parametrize("k,n", [(4096, 6144), (14336, 4096), (1000, 200)])
def test_triton_w8a8_table_configs(dtype, symmetric, m, k, n):
    from lqe.kernels import triton_w8a8 as tw

    q, s, azp, w, ws, colsum, bias, ref = _case(m, k, n, symmetric, dtype, seed=m + k)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    y = tw.w8a8_mm(q, s, w, ws, azp, colsum, bias, dtype, out=out)
    _close(y, ref, dtype)
    y2 = tw.w8a8_mm(q, s, w, ws, azp, colsum, bias, dtype)  # split-K: deterministic, workspace left clean
    assert torch.equal(y, y2)
    if tw.int_mm_unsupported(m, n, k) is None:
        _close(tw.int_mm_w8a8(q, s, w, ws, azp, colsum, bias, dtype), ref, dtype)


@pytest.mark.parametrize("m", [1, 64, 512])
def test_triton_w8a8_sweep_configs_compile_and_are_right(m):
    """The configs benchmarks/kernels.py --w8a8-sweep times must be correct, or the table could pick a bad one
    (every third, to keep the compile time of this test near a minute)."""
    from lqe.kernels import triton_w8a8 as tw

    k, n = 4096, 1024
    q, s, azp, w, ws, colsum, bias, ref = _case(m, k, n, False, torch.bfloat16, seed=5)
    for cfg in tw.sweep_configs(m)[::3] + [tw.pick_config(m, n, k, torch.device("cuda"))]:
        y = tw.w8a8_mm(q, s, w, ws, azp, colsum, bias, torch.bfloat16, config=cfg)
        try:
            _close(y, ref, torch.bfloat16)
        except AssertionError as e:
            raise AssertionError(f"config {cfg}: {e}") from None


def test_triton_w8a8_static_scalar_and_cuda_graph():
    """Scalar (static) activation scale and zero point, captured in a CUDA graph and replayed on new inputs."""
    from lqe.kernels import triton_w8a8 as tw
    from lqe.quant_layers.reference import int8_gemm_ref

    k, n = 4096, 1024
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
    ws = torch.rand(n, device="cuda") * 0.01
    colsum = w.to(torch.int32).sum(1, dtype=torch.int32)
    sa, zp = torch.tensor([0.02], device="cuda"), torch.tensor([3], dtype=torch.int32, device="cuda")
    tw.reserve_workspace("cuda", tw.workspace_rows(), n)
    for m in (1, 8, 48, 300):
        q = torch.randint(-128, 128, (m, k), dtype=torch.int8, device="cuda")
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        fn = (lambda: tw.int_mm_w8a8(q, sa, w, ws, zp, colsum, None, torch.bfloat16, out=out)) if m > 16 else \
            (lambda: tw.w8a8_mm(q, sa, w, ws, zp, colsum, None, torch.bfloat16, out=out))
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        q.copy_(torch.randint(-128, 128, (m, k), dtype=torch.int8, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        ref = int8_gemm_ref(q.cpu(), w.cpu(), sa.cpu(), ws.cpu(), zp.cpu(), None, torch.float32)
        _close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_plan_and_apply_every_kernel(dtype, symmetric):
    """plan_w8a8 / w8a8_apply with a table naming each kernel for some M, against the reference."""
    from lqe.kernels.w8a8 import plan_w8a8, w8a8_apply

    k, n = 4096, 1024
    table = [(4, "lqe-w8a8"), (16, "triton-w8a8"), (64, "int-mm+epilogue"), (None, "triton-w8a8")]
    q, s, azp, w, ws, colsum, bias, _ = _case(300, k, n, symmetric, dtype)
    wts, desc = plan_w8a8(w, ws, dtype, not symmetric, table)
    assert wts is not None and wts.packed is not None and wts.w_nk is not None, desc
    for m in (1, 4, 5, 16, 17, 64, 65, 300):
        from lqe.quant_layers.reference import int8_gemm_ref

        ref = int8_gemm_ref(q[:m].cpu(), w.cpu(), s[:m].cpu().reshape(-1, 1), ws.cpu(),
                            None if azp is None else azp[:m].cpu().reshape(-1, 1), bias.cpu(), torch.float32)
        _close(w8a8_apply(q[:m].contiguous(), s[:m].contiguous(), wts, None if azp is None else azp[:m].contiguous(),
                          bias, dtype), ref, dtype)
