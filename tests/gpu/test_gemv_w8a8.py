"""The M <= 16 GEMV kernels (lqe/kernels/triton_gemv_w8a8.py), int8 and fp8, against the references.

int8: exact int32 accumulation, so the result equals :func:`int8_gemm_ref` up to the output dtype's rounding of the
fp32 epilogue. fp8: fp32 accumulation of exact fp8 x fp8 products; against a float64 product of the same fp8 values
only the summation order differs (and the output rounding). Split-K must be deterministic (bitwise equal runs) and
leave its counters zeroed. The ``check_*`` helpers also run on CPU under ``TRITON_INTERPRET=1``
(tests/test_triton_gemv.py), on small awkward shapes.
"""
from __future__ import annotations

import pytest
import torch

from lqe.kernels.device_info import device_key

from lqe.quant_layers import reference as ref

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def fp8_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def make_case(m, n, k, kind, sym=True, static=False, seed=0):
    """Quantized activations (per token, or static per tensor), weight [N, K], per-channel scales."""
    g = torch.Generator().manual_seed(seed + 31 * m + n + 7 * k)
    x = torch.randn(m, k, generator=g) * 2 + (0.0 if sym else 0.7)
    ws = torch.rand(n, generator=g) * 0.01 + 1e-3
    if kind == "fp8":
        w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        if static:
            sa = torch.tensor([0.02])
        else:
            sa = x.abs().amax(1).clamp(min=1e-12) / 448.0
        xq = (x / sa.reshape(-1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
        return xq, sa, w, ws, None, None
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    if static:
        sa = torch.tensor([0.03])
        azp = None if sym else torch.tensor([5], dtype=torch.int32)
        xq = ref.static_quant_int8(x, sa, azp)
    else:
        xq, sa, azp = ref.per_token_quant_int8(x, sym)
    cs = w.to(torch.int32).sum(1).to(torch.int32)
    return xq, sa, w, ws, azp, cs


def reference(xq, sa, w, ws, azp, bias):
    if w.dtype == torch.int8:
        return ref.int8_gemm_ref(xq, w, sa, ws, azp, bias, torch.float32)
    acc = xq.double() @ w.double().t()
    out = sa.double().reshape(-1, 1) * ws.double().reshape(1, -1) * acc
    return (out if bias is None else out + bias.double()).float()


def check_gemv(m, n, k, cfg, kind="int8", sym=True, bias=True, static=False, dt=torch.float16, device="cuda"):
    from lqe.kernels import triton_gemv_w8a8 as tg

    xq, sa, w, ws, azp, cs = make_case(m, n, k, kind, sym, static)
    g = torch.Generator().manual_seed(m + n)
    b = (torch.randn(n, generator=g)).to(dt) if bias else None
    r = reference(xq, sa, w, ws, azp, None if b is None else b.float())
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    out = torch.full((m, n), float("nan"), dtype=dt, device=device)
    y = tg.gemv_w8a8(on(xq), on(sa), on(w), on(ws), on(azp), on(cs), on(b), dt, out=out, config=cfg)
    assert y.data_ptr() == out.data_ptr() and y.shape == (m, n) and not y.isnan().any(), (m, n, k, str(cfg))
    # output rounding: fp16 2^-11, bf16 2^-8 (plus the fp8 path's fp32 summation order, far below both)
    tol = (1e-3 if dt == torch.float16 else 8e-3) * r.abs().max().item() + 1e-4
    if kind == "fp8" and cfg.use_dot:  # the fp8 tensor cores' accumulation (the FMA path sums in fp32)
        from test_triton_fp8_gemm import fp8_mma_accumulation_tol

        tol += fp8_mma_accumulation_tol(k, r, cfg.split_k)
    err = (y.float().cpu() - r).abs().max().item()
    assert err <= tol, (m, n, k, str(cfg), kind, sym, static, err, tol)
    again = tg.gemv_w8a8(on(xq), on(sa), on(w), on(ws), on(azp), on(cs), on(b), dt, config=cfg)
    assert torch.equal(again, y), "split-K GEMV is not deterministic"
    cnt = tg._WS.get(device_key(device))
    assert cnt is None or not cnt[1].any(), "split-K arrival counters not left zeroed"
    return y


def check_rejects_bad_input(device="cuda"):
    from lqe.kernels import triton_gemv_w8a8 as tg

    x = torch.zeros(2, 64, dtype=torch.int8, device=device)
    w = torch.zeros(32, 64, dtype=torch.int8, device=device)
    s = torch.ones(2, device=device)
    with pytest.raises(ValueError, match="int8 x int8"):
        tg.gemv_w8a8(x.float(), s, w, torch.ones(32, device=device))
    with pytest.raises(ValueError, match="M <= 16"):
        tg.pick_config(17, 32, 64)
    with pytest.raises(ValueError, match="colsum"):
        tg.gemv_w8a8(x, s, w, torch.ones(32, device=device), azp=torch.zeros(2, dtype=torch.int32, device=device))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("shape", [(4096, 4096), (14336, 4096), (4096, 6144), (200, 72)])
def test_gemv_int8_table_configs(m, shape):
    k, n = shape
    from lqe.kernels import triton_gemv_w8a8 as tg

    cfg = tg.pick_config(m, n, k, torch.device("cuda"))
    check_gemv(m, n, k, cfg, "int8", dt=torch.bfloat16)
    check_gemv(m, n, k, cfg, "int8", sym=False, bias=False, dt=torch.float16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("shape", [(4096, 4096), (14336, 4096), (200, 72), (198, 40)])
def test_gemv_int8_dp4a_equals_the_fma_path(shape):
    """int8 at M = 1: the dp4a path (int32 words, the PTX instruction) and the fp32-FMA path both sum exactly in
    integers, so their outputs are equal bit for bit (K = 198: not a multiple of 4, both take the FMA path)."""
    import dataclasses

    from lqe.kernels import triton_gemv_w8a8 as tg

    k, n = shape
    cfg = tg.pick_config(1, n, k, torch.device("cuda"))
    assert not cfg.use_dot and cfg.dp4a
    for sym in (True, False):
        a = check_gemv(1, n, k, cfg, "int8", sym=sym, dt=torch.bfloat16)
        b = check_gemv(1, n, k, dataclasses.replace(cfg, dp4a=False), "int8", sym=sym, dt=torch.bfloat16)
        c = check_gemv(1, n, k, dataclasses.replace(cfg, num_stages=1), "int8", sym=sym, dt=torch.bfloat16)
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gemv_every_sweep_config_compiles_and_is_right(m):
    from lqe.kernels import triton_gemv_w8a8 as tg

    kinds = ["int8"] + (["fp8"] if fp8_ok() else [])
    for cfg in tg.sweep_configs(m)[::3]:
        for kind in kinds:
            check_gemv(m, 1024, 2048, cfg, kind, bias=False, dt=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_ok(), reason="needs an FP8 GPU (sm89+)")
@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("shape", [(4096, 4096), (14336, 4096), (4096, 28672), (200, 72)])
def test_gemv_fp8_table_configs(m, shape):
    k, n = shape
    from lqe.kernels import triton_gemv_w8a8 as tg

    cfg = tg.pick_config(m, n, k, torch.device("cuda"), table=tg.FP8_CONFIGS)
    check_gemv(m, n, k, cfg, "fp8", dt=torch.bfloat16)
    check_gemv(m, n, k, cfg, "fp8", static=True, bias=False, dt=torch.float16)


@pytest.mark.gpu
@requires_cuda
def test_gemv_rejects_bad_input():
    check_rejects_bad_input("cuda")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("shape", [(4096, 4096), (14336, 4096), (200, 72)])
def test_gemv_swapped_tensor_core_path(m, shape):
    """The swap_ab candidate (out^T = W x^T: native 8-bit wgmma on Hopper, promoted to fp32 every BLOCK_K for fp8)
    against the reference, int8 (sym / asym) and fp8, split-K auto."""
    from lqe.kernels import triton_gemv_w8a8 as tg

    k, n = shape
    cfg = tg.GemvConfig(64, 128, use_dot=True, swap_ab=True)
    check_gemv(m, n, k, cfg, "int8", dt=torch.bfloat16)
    check_gemv(m, n, k, cfg, "int8", sym=False, bias=False, dt=torch.float16)
    if fp8_ok():
        check_gemv(m, n, k, cfg, "fp8", dt=torch.bfloat16)
        check_gemv(m, n, k, tg.GemvConfig(64, 128, use_dot=True, swap_ab=True, precise_acc=False), "fp8",
                   dt=torch.bfloat16)
