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
    x = (torch.randn(m, k, device="cuda") * 4 + (0 if symmetric else 2)).to(dtype)
    if m > 2:
        x[1] = 0
    q, s, azp = w8a8.quantize_per_token(x, symmetric)
    qr, sr, azpr = gemm_ref.quantize_per_token_ref(x, symmetric)  # on GPU: same IEEE fp32 ops
    assert torch.equal(q, qr) and torch.equal(s, sr)
    if not symmetric:
        assert torch.equal(azp, azpr)


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
