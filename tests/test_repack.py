"""CPU tests of the lqe kernel layout: repack (lqe.kernels.repack) then decode the packed words the way the
CUDA kernels do (lqe.kernels.gemm_ref) must give back the canonical weights exactly."""
from __future__ import annotations

import pytest
import torch

from lqe.kernels import gemm_ref, repack
from lqe.kernels.canonical import CanonicalWeight

SHAPES = [(64, 64), (320, 128), (448, 320)]  # K not a multiple of 128: short last group
GROUPS = [32, 64, 128, -1]


def make_canonical(k, n, bits, gs, asym, act_order, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    gsz = k if gs == -1 else gs
    ng = -(-k // gsz)
    codes = torch.randint(0, 2**bits, (k, n), dtype=torch.uint8, generator=g)
    # scales exactly representable in the activation dtype, so the emulation can be compared bit for bit
    scales = (torch.rand(ng, n, generator=g) * 0.05 + 0.001).to(dtype).float()
    zeros = torch.randint(0, 2**bits, (ng, n), dtype=torch.uint8, generator=g) if asym else None
    g_idx = None
    if act_order:
        g_idx = (torch.randperm(k, generator=g) // gsz).to(torch.int32)
    return CanonicalWeight(codes, scales, zeros, g_idx, bits, gs)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", GROUPS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("asym,act_order", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_repack_then_kernel_decode_is_exact(bits, gs, shape, asym, act_order, dtype):
    k, n = shape
    cw = make_canonical(k, n, bits, gs, asym, act_order, dtype, seed=k * 7 + n + bits + gs)
    p = repack.repack_wna16(cw, dtype)
    assert p.qweight.dtype == torch.int32 and p.qweight.shape == (k // 16, n * bits // 2)
    perm = p.perm if p.perm is not None else torch.arange(k)
    assert (p.perm is not None) == (act_order and cw.has_act_order())
    assert torch.equal(gemm_ref.unpack_wna16_codes(p), cw.codes.long()[perm])
    want = cw.dequantize(torch.float32)[perm].to(dtype)
    got = gemm_ref.dequantize_wna16(p)
    assert got.dtype == dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("bits,gs,asym,act_order", [(4, 128, False, False), (4, 32, True, True), (8, 64, True, True)])
@pytest.mark.parametrize("m", [1, 7, 26, 257])
def test_emulated_gemm_matches_canonical(bits, gs, asym, act_order, m):
    k, n = 320, 192
    cw = make_canonical(k, n, bits, gs, asym, act_order, torch.float16, seed=m)
    p = repack.repack_wna16(cw, torch.float16)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).half()
    bias = torch.randn(n).half()
    y = gemm_ref.wna16_gemm_ref(x, p, bias)
    ref = x.float() @ cw.dequantize(torch.float32) + bias.float()
    torch.testing.assert_close(y.float(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())


def test_act_order_perm_gathers_x_like_rows():
    cw = make_canonical(128, 64, 4, 32, True, True, torch.float16, seed=3)
    p = repack.repack_wna16(cw, torch.float16)
    assert p.perm is not None
    assert torch.equal(torch.sort(cw.g_idx.long(), stable=True).indices, p.perm)
    # sorted rows are grouped contiguously: row k of the packed weight is in group k // gs
    assert torch.equal(cw.g_idx.long()[p.perm], torch.arange(128) // 32)


def test_trivial_g_idx_is_not_act_order():
    cw = make_canonical(128, 64, 4, 64, False, False, torch.float16)
    cw.g_idx = (torch.arange(128) // 64).to(torch.int32)
    assert repack.repack_wna16(cw, torch.float16).perm is None


@pytest.mark.parametrize("k,n,bits,gs,why", [
    (64, 96, 4, 32, "multiples of 64"), (48, 64, 4, 16, "multiples of 64"), (128, 64, 3, 32, "bits=3"),
    (128, 64, 4, 40, "group_size=40"),
])
def test_unsupported_shapes_give_reasons(k, n, bits, gs, why):
    cw = CanonicalWeight(torch.zeros(k, n, dtype=torch.uint8), torch.ones(-(-k // gs), n), None, None, bits, gs)
    reason = repack.wna16_unsupported(cw)
    assert reason is not None and why in reason
    with pytest.raises(ValueError, match="lqe-wna16"):
        repack.repack_wna16(cw)


def test_uneven_g_idx_is_rejected():
    g_idx = torch.cat([torch.zeros(40), torch.ones(24), torch.full((64,), 2)]).to(torch.int32)
    cw = CanonicalWeight(torch.zeros(128, 64, dtype=torch.uint8), torch.ones(3, 64), None, g_idx, 4, 64)
    assert "contiguous groups" in repack.wna16_unsupported(cw)


def test_scale_column_permutation():
    s = torch.arange(2 * 128, dtype=torch.float32).reshape(2, 128)
    ps = repack.permute_columns(s)
    for col in range(128):
        j, g8 = (col % 64) // 8, col % 8
        assert ps[1, (col // 64) * 64 + g8 * 8 + j] == s[1, col]


@pytest.mark.parametrize("k,n", [(64, 64), (192, 320), (256, 128)])
def test_w8a8_repack_roundtrip(k, n):
    g = torch.Generator().manual_seed(k + n)
    wq = torch.randint(-128, 128, (k, n), dtype=torch.int8, generator=g)
    p = repack.repack_w8a8(wq, torch.rand(n, generator=g))
    assert p.qweight.shape == (k // 32, n * 8)
    assert torch.equal(gemm_ref.unpack_w8a8(p), wq)
    assert torch.equal(p.colsum, wq.int().sum(0))
    with pytest.raises(ValueError):
        repack.repack_w8a8(torch.zeros(96, 64, dtype=torch.int8), torch.ones(64))


@pytest.mark.parametrize("symmetric", [True, False])
def test_quantize_per_token_ref_properties(symmetric):
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(5)) * 3 + (0 if symmetric else 1.5)
    x[4] = 0  # all-zero row: scale 0
    q, s, azp = gemm_ref.quantize_per_token_ref(x.half(), symmetric)
    assert q.dtype == torch.int8 and s[4] == 0 and (q[4] == 0).all()
    zp = torch.zeros(9) if azp is None else azp.float()
    err = ((q.float() - zp[:, None]) * s[:, None] - x.half().float()).abs()
    assert (err <= s[:, None] * 0.5 + 1e-6).all()
    if not symmetric:
        assert azp.dtype == torch.int32 and int(azp.min()) >= -128 and int(azp.max()) <= 127


@pytest.mark.parametrize("symmetric", [True, False])
def test_w8a8_ref_matches_float(symmetric):
    g = torch.Generator().manual_seed(2)
    k, n, m = 256, 128, 7
    x = (torch.randn(m, k, generator=g) + (0 if symmetric else 0.7)).half()
    w = torch.randn(k, n, generator=g)
    ws = w.abs().amax(0) / 127
    wq = torch.round(w / ws).clamp(-128, 127).to(torch.int8)
    p = repack.repack_w8a8(wq, ws)
    q, s, azp = gemm_ref.quantize_per_token_ref(x, symmetric)
    y = gemm_ref.w8a8_gemm_ref(q, s, azp, p, None, torch.float32)
    ref = x.float() @ (wq.float() * ws)
    torch.testing.assert_close(y, ref, rtol=0.05, atol=0.05 * ref.abs().max().item())


def test_import_without_cuda_reports_reason():
    import lqe.kernels as kernels

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert kernels.available() is False
    assert "cuda" in kernels.unavailable_reason().lower()
    cw = make_canonical(128, 128, 4, 128, False, False, torch.float16)
    fn, reason = kernels.select_w4a16_kernel(cw, "cuda", torch.float16)
    assert fn is None and "lqe-wna16 unavailable" in reason
