"""CPU tests of two W8A8 host-side decisions (lqe/kernels/w8a8.py):

* the output dtype asked of row-wise ``torch._scaled_mm`` (:func:`fp8_scaled_mm_dtype`): float16 written directly,
  with the float16 bias in the GEMM, where a one-time probe per device finds torch doing it right, else bfloat16
  then a cast and the bias added after; never probed inside a CUDA-graph capture;
* ``plan_w8a8`` reserving triton-w8a8's split-K workspace whenever a table row can reroute to triton-w8a8
  (int-mm+epilogue at M <= 16, triton-gemv at M > 16), so no batch size grows it inside a capture.
"""
from __future__ import annotations

import pytest
import torch

from lqe.kernels import w8a8 as kw

pytestmark = pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8_e4m3fn")


@pytest.fixture
def fake_scaled_mm(monkeypatch):
    """torch._scaled_mm replaced by the fp32 math of its operands, recording ``(out_dtype, bias dtype)`` per call;
    ``state["fp16"]``: "ok" (writes fp16), "refuse" (raises, as torch < 2.10 does) or "wrong" (garbage)."""
    state = {"fp16": "ok", "calls": []}

    def scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None, **_):
        state["calls"].append((out_dtype, None if bias is None else bias.dtype))
        if out_dtype == torch.float16 and state["fp16"] == "refuse":
            raise RuntimeError("Only bf16 high precision output types are supported for row-wise scaling.")
        y = (a.float() * scale_a) @ (b.float() * scale_b)
        if out_dtype == torch.float16 and state["fp16"] == "wrong":
            y = torch.zeros_like(y)
        if bias is not None:
            assert bias.dtype == out_dtype, "the bias goes in with the output's dtype"
            y = y + bias.float()
        return y.to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(kw, "_FP16_OUT_PROBED", {})
    return state


def _operands(m=5, k=64, n=32, dtype=torch.float16):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(k, n, generator=g) * 0.05
    x = torch.randn(m, k, generator=g).to(dtype)
    wq, ws = kw.fp8_quantize_weight(w)
    return x, wq, ws, torch.randn(n, generator=g).to(dtype)


def _expected(x, wq, ws, bias):
    xq, xs = kw.fp8_quantize_per_token(x, use_triton=False)
    return (xq.float() * xs) @ (wq.float() * ws.reshape(-1, 1)).t() + bias.float()


def test_fp16_output_written_directly_where_the_probe_passes(fake_scaled_mm):
    x, wq, ws, bias = _operands()
    y = kw.fp8_linear(x, wq, ws, bias)
    # the probe (fp16 out + fp16 bias), then the layer's one call: fp16 out, its bias in the GEMM
    assert fake_scaled_mm["calls"] == [(torch.float16, torch.float16)] * 2
    assert y.dtype == torch.float16 and torch.allclose(y.float(), _expected(x, wq, ws, bias), atol=1e-2, rtol=1e-2)
    assert kw._FP16_OUT_PROBED == {"cpu": True}
    fake_scaled_mm["calls"].clear()
    xq, xs = kw.fp8_quantize_per_token(x, use_triton=False)
    y2 = kw.fp8_apply(xq, xs, wq, ws, bias, torch.float16, table=[(None, "scaled-mm")])
    assert fake_scaled_mm["calls"] == [(torch.float16, torch.float16)]  # probed once per device
    assert torch.equal(y, y2)


@pytest.mark.parametrize("probe", ["refuse", "wrong"])
def test_bf16_route_where_torch_cannot_write_fp16(fake_scaled_mm, probe):
    fake_scaled_mm["fp16"] = probe
    x, wq, ws, bias = _operands()
    y = kw.fp8_linear(x, wq, ws, bias)
    assert fake_scaled_mm["calls"] == [(torch.float16, torch.float16), (torch.bfloat16, None)]
    assert kw._FP16_OUT_PROBED == {"cpu": False}
    assert y.dtype == torch.float16 and torch.allclose(y.float(), _expected(x, wq, ws, bias), atol=5e-2, rtol=2e-2)
    fake_scaled_mm["calls"].clear()
    kw.fp8_linear(x, wq, ws, bias)
    assert fake_scaled_mm["calls"] == [(torch.bfloat16, None)]  # the probe's answer is kept


def test_bf16_and_fp32_outputs_never_probe(fake_scaled_mm):
    x, wq, ws, bias = _operands(dtype=torch.bfloat16)
    kw.fp8_linear(x, wq, ws, bias)
    assert fake_scaled_mm["calls"] == [(torch.bfloat16, torch.bfloat16)]
    xq, xs = kw.fp8_quantize_per_token(x, use_triton=False)
    out = kw.fp8_apply(xq, xs, wq, ws, bias.float(), torch.float32, table=[(None, "scaled-mm")])
    assert out.dtype == torch.float32 and fake_scaled_mm["calls"][-1] == (torch.bfloat16, None)
    assert kw._FP16_OUT_PROBED == {}


def test_no_probe_inside_a_graph_capture(fake_scaled_mm, monkeypatch):
    """Inside a capture the probe (which synchronizes) does not run: bfloat16 until an eager call has probed."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert kw.fp8_scaled_mm_dtype("cuda:0", torch.float16) == torch.bfloat16
    assert kw._FP16_OUT_PROBED == {} and fake_scaled_mm["calls"] == []
    kw._FP16_OUT_PROBED["cuda:0"] = True  # probed at load (fp8_rowwise_reason runs fp8_linear in fp16)
    assert kw.fp8_scaled_mm_dtype("cuda:0", torch.float16) == torch.float16
    assert kw.fp8_scaled_mm_dtype("cuda:1", torch.float16) == torch.bfloat16  # per device


def test_real_scaled_mm_fp16_on_this_torch():
    """Whatever this torch's CPU _scaled_mm does with fp16 output, fp8_linear gives the right fp16 result."""
    x, wq, ws, bias = _operands()
    try:
        y = kw.fp8_linear(x, wq, ws, bias)
    except RuntimeError as e:  # a torch without row-wise _scaled_mm on CPU
        pytest.skip(f"row-wise torch._scaled_mm does not run on CPU here: {str(e)[:80]}")
    assert y.dtype == torch.float16 and torch.allclose(y.float(), _expected(x, wq, ws, bias), atol=5e-2, rtol=2e-2)


# ------------------------------------------------------------------------------------------------ plan_w8a8
@pytest.mark.parametrize("table", [
    [(128, "int-mm+epilogue"), (None, "lqe-w8a8")],  # int-mm+epilogue reroutes M <= 16 to triton-w8a8
    [(32, "triton-gemv"), (None, "lqe-w8a8")],  # the GEMV serves M <= 16: 17..32 run triton-w8a8
    [(None, "triton-gemv")],
    [(None, "int-mm+epilogue")],
    [(16, "triton-gemv"), (None, "triton-w8a8")],
])
def test_plan_reserves_triton_w8a8_workspace_for_every_reroute(monkeypatch, table):
    pytest.importorskip("triton")
    from lqe.kernels import triton_gemv_w8a8 as tg
    from lqe.kernels import triton_w8a8 as tw

    monkeypatch.setattr(tw, "_WS", type(tw._WS)("triton-w8a8", "lqe.kernels.triton_w8a8", torch.int32, zeroed=True))
    monkeypatch.setattr(tg, "_WS", type(tg._WS)("triton-gemv", "lqe.kernels.triton_gemv_w8a8", torch.int32))
    monkeypatch.setattr(kw, "kernel_unsupported", lambda name, k, n, device, dtype: None)
    monkeypatch.setattr(kw, "select_w8a8_kernel", lambda w_kn, s, device, dtype: (object(), "lqe-w8a8 (stub)"))
    n, k = 96, 4096
    wts, desc = kw.plan_w8a8(torch.zeros(n, k, dtype=torch.int8), torch.ones(n), torch.bfloat16, False, table)
    assert wts is not None and wts.table == tuple(table), desc
    reserved = tw._WS.get("cpu")
    assert reserved is not None and reserved[0].numel() >= tw.workspace_rows() * n
    size = reserved[0].numel()
    # every M that reaches triton-w8a8 then finds the workspace big enough (no growth: it would raise in a capture)
    launches = []

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *a, **kw_: launches.append(grid)
    monkeypatch.setattr(tw, "_w8a8_mm_kernel", NoLaunch())
    monkeypatch.setattr(tw, "int_mm_w8a8", lambda *a, **k: None)
    monkeypatch.setattr(tg, "gemv_w8a8", lambda *a, **k: None)
    monkeypatch.setattr(kw, "w8a8_gemm", lambda *a, **k: None)
    for m in (1, 2, 4, 8, 16, 17, 32, 64, 128):
        kw.w8a8_apply(torch.zeros(m, k, dtype=torch.int8), torch.ones(m), wts)
        assert tw._WS["cpu"][0].numel() == size, (m, table)
    assert launches and any(split > 1 for _, split in launches)  # the split-K path was taken
