"""CPU tests of the W8A8 int8 kernel choice (W8A8_TABLE, host-side tile configs) and, under Triton's
interpreter, of the Triton W8A8 kernels (lqe/kernels/triton_w8a8.py) on small awkward shapes against the pure-torch
reference, including a whole W8A8 layer routed through the Triton / int_mm paths."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from lqe.kernels import dispatch
from lqe.kernels import triton_w8a8 as tw
from lqe.kernels import w8a8 as kw
from triton_compat import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None


# ------------------------------------------------------------------------------------------------ host side
def test_table_is_well_formed():
    names = [nm for _, nm in dispatch.W8A8_TABLE]
    assert set(names) <= set(kw.KERNELS) and dispatch.W8A8_TABLE[-1][0] is None
    bounds = [mm for mm, _ in dispatch.W8A8_TABLE[:-1]]
    assert bounds == sorted(bounds)
    assert tw.CONFIGS[-1][0] is None


@pytest.mark.parametrize("m", [1, 7, 16, 17, 33, 64, 65, 128, 129, 256, 257, 1024, 5000])
def test_pick_config_is_a_host_function_of_shapes(m):
    cfg = tw.pick_config(m, 4096, 4096, torch.device("cpu"))
    assert cfg.split_k >= 1 and cfg.block_m >= 16 and cfg.block_k >= 32
    assert cfg == tw.pick_config(m, 4096, 4096, torch.device("cpu"))
    if m <= 16:
        assert cfg.block_m == 16  # weight streaming: one M tile
    if m > 256:
        assert cfg.split_k == 1 and cfg.block_m >= 64


def test_auto_split_k_fills_the_gpu_and_keeps_k_blocks():
    cfg = tw.W8A8Config(16, 64, 256, split_k=0)
    assert tw.auto_split_k(1, 4096, 4096, cfg, 132) == 4  # 64 tiles; 16 K blocks / 4 per split
    assert tw.auto_split_k(1, 28672, 4096, cfg, 132) == 1  # 448 tiles already fill 132 SMs
    assert tw.auto_split_k(1, 1024, 14336, cfg, 132) == 14  # 16 tiles, 56 K blocks: 4 per split
    assert tw.auto_split_k(1, 64, 256, cfg, 132) == 1  # one K block


def test_sweep_configs_are_valid():
    for m in (1, 16, 32, 64, 128, 256, 1024):
        cfgs = tw.sweep_configs(m)
        assert len(cfgs) >= 8 and len(set(cfgs)) == len(cfgs)
        for c in cfgs:
            assert c.block_m >= min(m, 16) and c.num_warps in (4, 8) and c.block_k in (64, 128, 256, 512)
            assert (c.block_m + c.block_n) * c.block_k * c.num_stages <= 200 * 1024
    assert tw.workspace_rows() == 64


def _plan(monkeypatch, table, asym=False, n=72, k=160):
    """plan_w8a8 on a CPU weight with the device check waived (the kernels are not run)."""
    real = kw.kernel_unsupported
    monkeypatch.setattr(kw, "kernel_unsupported",
                        lambda name, k, n, device, dtype: None if name != "lqe-w8a8" else real(name, k, n, device, dtype))
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    return w, kw.plan_w8a8(w, torch.rand(n) + 0.5, torch.bfloat16, asym, table)


def test_plan_keeps_one_copy_and_resolves_rows(monkeypatch):
    w, (wts, desc) = _plan(monkeypatch, None, asym=True)
    assert wts is not None and wts.packed is None and wts.w_nk.data_ptr() == w.data_ptr()  # no second copy
    assert torch.equal(wts.colsum, w.to(torch.int64).sum(1).to(torch.int32)) and wts.colsum.dtype == torch.int32
    assert wts.table == tuple(dispatch.W8A8_TABLE) and "triton-w8a8" in desc
    # a table naming lqe-w8a8 on a machine where it cannot run: that row falls back, with the reason
    _, (wts2, desc2) = _plan(monkeypatch, [(16, "lqe-w8a8"), (None, "int-mm+epilogue")])
    assert wts2.table == ((16, "triton-w8a8"), (None, "int-mm+epilogue")) and "lqe-w8a8 -> triton-w8a8" in desc2
    assert wts2.packed is None and wts2.colsum is None


def test_plan_declines_with_every_reason():
    wts, why = kw.plan_w8a8(torch.zeros(64, 64, dtype=torch.int8), torch.ones(64), torch.bfloat16, False)
    assert wts is None
    for name in kw.KERNELS:
        assert f"{name} unavailable: device is cpu" in why


def test_apply_picks_by_m_and_never_int_mm_below_17(monkeypatch):
    calls = []
    monkeypatch.setattr(tw, "w8a8_mm", lambda *a, **k: calls.append("triton-w8a8"))
    monkeypatch.setattr(tw, "int_mm_w8a8", lambda *a, **k: calls.append("int-mm+epilogue"))
    monkeypatch.setattr(kw, "w8a8_gemm", lambda *a, **k: calls.append("lqe-w8a8"))
    w = torch.zeros(64, 64, dtype=torch.int8)
    table = ((8, "int-mm+epilogue"), (32, "triton-w8a8"), (None, "int-mm+epilogue"))
    wts = kw.W8A8Weights(w, torch.ones(64), None, None, table, 64, 64)
    for m in (1, 8, 9, 32, 33):
        kw.w8a8_apply(torch.zeros(m, 64, dtype=torch.int8), torch.ones(m), wts)
    assert calls == ["triton-w8a8", "triton-w8a8", "triton-w8a8", "triton-w8a8", "int-mm+epilogue"]


# ------------------------------------------------------------------------------------------------ interpreter
SCRIPT = """
    import torch
    from lqe.kernels import triton_w8a8 as tw
    from lqe.kernels import w8a8 as kw
    from lqe.quant_layers import reference as ref
    import test_gemv_w8a8 as G  # the operands of the GPU tests (tests/gpu)
    C = tw.W8A8Config

    def case(m, n, k, cfg, sym=True, bias=True, static=False, dt=torch.float16, epi=False):
        xq, sa, w, ws, azp, cs = G.make_case(m, n, k, "int8", sym, static)
        b = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dt) if bias else None
        out = torch.full((m, n), float("nan"), dtype=dt)
        if epi:
            acc = (xq.to(torch.int64) @ w.to(torch.int64).t()).to(torch.int32)
            y = tw.w8a8_epilogue(acc, sa, ws, azp, cs, b, dt, out=out)
        else:
            y = tw.w8a8_mm(xq, sa, w, ws, azp, cs, b, dt, out=out, config=cfg)
        r = ref.int8_gemm_ref(xq, w, sa, ws, azp, b, torch.float32)
        # fp16 rounding (2^-11); the interpreter truncates fp32 -> bf16 (2^-8)
        tol = (2e-3 if dt == torch.float16 else 8e-3) * r.abs().max().item() + 1e-4
        err = (y.float() - r).abs().max().item()
        assert y.data_ptr() == out.data_ptr() and not y.isnan().any(), (m, n, k, cfg)
        assert err <= tol, (m, n, k, str(cfg), sym, err, tol)
        ws_, cnt_ = tw._WS["cpu"]
        assert not ws_.any() and not cnt_.any(), "split-K workspace / counters not left zeroed"
        return y

    # weight streaming (split-K, ragged last split, K % BLOCK_K != 0), M=1 and 7; N, K not powers of two
    case(1, 72, 200, C(16, 32, 64, split_k=3))
    y1 = case(7, 72, 200, C(16, 32, 64, split_k=2), sym=False)
    assert torch.equal(y1, case(7, 72, 200, C(16, 32, 64, split_k=2), sym=False))  # deterministic
    # M=33 over two M tiles (second one ragged), asymmetric with no bias; one split; bf16 output
    case(33, 40, 96, C(32, 32, 32, split_k=1), sym=False, bias=False, dt=torch.bfloat16)
    case(33, 40, 96, C(16, 32, 32, split_k=2), static=True)
    case(33, 40, 96, C(16, 32, 32), static=True, sym=False)
    # split_k=0: resolved from the (CPU stand-in) SM count
    case(7, 72, 200, C(16, 32, 32, split_k=0))
    # the int_mm path's epilogue kernel alone
    case(33, 72, 200, None, sym=False, epi=True)
    case(7, 40, 96, None, static=True, epi=True, dt=torch.bfloat16)

    # a whole compressed-tensors W8A8 layer through plan_w8a8 / w8a8_apply (device check waived), W8A8_TABLE as it is:
    # M=1 and 7 on the GEMV (triton-gemv, M <= 16), M=33 on int-mm+epilogue (torch._int_mm runs on CPU), against the
    # torch path; the dynamic activations quantized by the Triton quantizer (lqe/kernels/triton_act_quant.py), the
    # static ones too
    import test_kernel_selection as T
    from lqe.quant_layers import w8a8 as w8a8_mod
    real = kw.kernel_unsupported
    for sym, static in ((True, False), (False, False), (False, True)):
        plain, w, b = T.w8a8_layer(static, sym, k=160, sizes=(40, 16, 16), dtype=torch.float16)
        w8a8_mod.cuda_kernels_declined = lambda device: None
        kw.kernel_unsupported = lambda name, k, n, d, dt: None if name != "lqe-w8a8" else real(name, k, n, d, dt)
        layer, _, _ = T.w8a8_layer(static, sym, k=160, sizes=(40, 16, 16), dtype=torch.float16)
        kw.kernel_unsupported = real
        w8a8_mod.cuda_kernels_declined = T.wna16_kernels.cuda_kernels_declined
        desc = layer.quant_method.describe(layer)
        assert "triton-w8a8 int8 GEMM" in desc and layer.w8a8_qweight is None and layer.w8a8_w.dtype == torch.int8, desc
        for m in (1, 7, 33):
            x = torch.randn(m, 160).half()
            got, exp = layer(x), plain(x)
            assert got.dtype == torch.float16 and got.shape == (m, 72)
            err = (got.float() - exp.float()).abs().max().item()
            assert err <= 2e-3 * exp.float().abs().max().item() + 1e-3, (sym, static, m, err)
    print("W8A8-INTERPRET-OK")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_w8a8_under_interpreter():
    run_interpreted(SCRIPT, "W8A8-INTERPRET-OK")


def test_apply_sends_gemv_rows_to_the_gemv_up_to_16_tokens(monkeypatch):
    from lqe.kernels import triton_gemv_w8a8 as tg

    calls = []
    monkeypatch.setattr(tw, "w8a8_mm", lambda *a, **k: calls.append("triton-w8a8"))
    monkeypatch.setattr(tg, "gemv_w8a8", lambda *a, **k: calls.append("triton-gemv"))
    w = torch.zeros(64, 64, dtype=torch.int8)
    wts = kw.W8A8Weights(w, torch.ones(64), None, None, ((32, "triton-gemv"), (None, "triton-w8a8")), 64, 64)
    for m in (1, 16, 17, 33):
        kw.w8a8_apply(torch.zeros(m, 64, dtype=torch.int8), torch.ones(m), wts)
    assert calls == ["triton-gemv", "triton-gemv", "triton-w8a8", "triton-w8a8"]
