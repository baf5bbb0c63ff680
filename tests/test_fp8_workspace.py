"""An FP8 W8A8 layer reserves the split-K workspaces of every kernel its table can pick when its weights are processed
(the fp8 GEMV, the Triton fp8 GEMM, the block-scaled GEMM), so no batch size grows them later: growing allocates, and
``SplitKWorkspace.reserve`` would replace the buffers a captured CUDA graph holds. CPU only: the layer is forced onto
its CUDA path and the Triton launches are stubbed (their host side, which asks for the workspace, runs)."""
from __future__ import annotations

import pytest
import torch

import test_kernel_selection as T
from lqe.kernels import dispatch
from lqe.kernels import triton_fp8 as tf
from lqe.kernels import triton_gemv_w8a8 as tg
from lqe.kernels import w8a8 as kw
from lqe.quant_layers import fp8 as fp8_mod

MAX_BATCH = 512


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *a, **k: None


def _sizes():
    return {name: (None if ws.get("cpu") is None else ws["cpu"][0].numel()) for name, ws in
            (("gemv", tg._WS), ("fp8", tf._WS))}


@pytest.fixture
def fresh(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(tg, "_WS", type(tg._WS)("triton-gemv", "lqe.kernels.triton_gemv_w8a8", torch.int32))
    monkeypatch.setattr(tf, "_WS", type(tf._WS)("triton-fp8", "lqe.kernels.triton_fp8", torch.float32))
    monkeypatch.setattr(fp8_mod, "cuda_kernels_declined", lambda device: None)
    monkeypatch.setattr(fp8_mod.FP8Method, "scaled_mm_reason", lambda self, layer: None
                        if self.s.weights.strategy != "block" else "block")
    monkeypatch.setattr(fp8_mod.FP8Method, "block_kernel_reason", lambda self, layer: None)
    monkeypatch.setattr(tg, "_gemv_kernel", _NoLaunch())
    monkeypatch.setattr(tf, "_fp8_mm_kernel", _NoLaunch())
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # fp8_apply's Triton rows for CPU tensors (launches stubbed)


@pytest.mark.parametrize("table", [None, [(16, "triton-gemv"), (None, "triton-fp8")],
                                   [(8, "triton-gemv"), (64, "scaled-mm"), (None, "triton-fp8")]])
def test_fp8_layer_reserves_its_final_workspace_at_load(fresh, monkeypatch, table):
    if table is not None:
        monkeypatch.setattr(dispatch, "FP8_TABLE", table)
    names = {nm for _, nm in dispatch.FP8_TABLE}
    layer, _ = T.fp8_layer("channel", static=False, k=256, sizes=(128, 64), dtype=torch.bfloat16)
    assert layer.fp8_w_scale is not None
    loaded = _sizes()
    assert (loaded["gemv"] is not None) == ("triton-gemv" in names)
    assert (loaded["fp8"] is not None) == ("triton-fp8" in names)
    n = layer.fp8_weight.shape[0]
    for m in range(1, MAX_BATCH + 1):
        xq = torch.zeros(m, 256, dtype=torch.float8_e4m3fn)
        name = dispatch.pick(dispatch.FP8_TABLE, m)
        if name == "scaled-mm":
            continue  # torch._scaled_mm: no workspace
        kw.fp8_apply(xq, torch.ones(m, 1), layer.fp8_weight, layer.fp8_w_scale, out_dtype=torch.bfloat16)
        assert _sizes() == loaded, (m, name, loaded, _sizes())
    if loaded["gemv"] is not None:
        assert loaded["gemv"] >= tg.WS_ROWS * n
    if loaded["fp8"] is not None:
        assert loaded["fp8"] >= tf.WS_ROWS * n


def test_block_scaled_fp8_layer_reserves_at_load(fresh):
    layer, _ = T.fp8_layer("block", static=False, k=256, sizes=(128, 128), dtype=torch.bfloat16)
    assert getattr(layer, "fp8_block_scale", None) is not None, layer.quant_method.describe(layer)
    loaded = _sizes()
    assert loaded["fp8"] is not None and loaded["fp8"] >= tf.WS_ROWS * 256 and loaded["gemv"] is None
    for m in (1, 7, 16, 17, 64, 200, MAX_BATCH):
        xq = torch.zeros(m, 256, dtype=torch.float8_e4m3fn)
        kw.fp8_block_apply_quantized(xq, torch.ones(m, 2), layer.fp8_weight, layer.fp8_block_scale)
        assert _sizes() == loaded, m


def test_block_table_is_read(monkeypatch):
    assert dispatch.FP8_BLOCK_TABLE[-1][0] is None
    assert {nm for _, nm in dispatch.FP8_BLOCK_TABLE} <= set(kw.FP8_BLOCK_KERNELS)
    monkeypatch.setattr(dispatch, "FP8_BLOCK_TABLE", [(None, "scaled-mm")])
    with pytest.raises(ValueError, match="FP8_BLOCK_TABLE names 'scaled-mm'"):
        kw.fp8_block_apply_quantized(torch.zeros(1, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1),
                                     torch.zeros(128, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1))
