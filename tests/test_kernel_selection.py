"""CPU tests of the glue between the quant layers and lqe.kernels: which path a layer picks, the reason it gives
when a CUDA kernel declines (logged once per layer kind), and -- with the kernels' CPU emulation standing in for
the CUDA extension -- that the kernel path computes what the torch path computes."""
from __future__ import annotations

import logging
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "quant"))

import lqe.kernels as kernels  # noqa: E402
from lqe.kernels import gemm, gemm_ref, repack  # noqa: E402
from lqe.kernels import w8a8 as kw  # noqa: E402
from lqe.quant_layers import fp8 as fp8_mod  # noqa: E402
from lqe.quant_layers import reference as ref  # noqa: E402
from lqe.quant_layers import w8a8 as w8a8_mod  # noqa: E402
from lqe.quant_layers import weight_only, wna16_kernels  # noqa: E402
from lqe.quant_layers.awq import AWQConfig  # noqa: E402
from lqe.kernels.canonical import CanonicalWeight  # noqa: E402
from lqe.quant_layers.compressed_tensors import CompressedTensorsConfig  # noqa: E402
from lqe.quant_layers.gptq import GPTQConfig  # noqa: E402
from qutil import load, make_layer, rel_err  # noqa: E402

LOGGER = "lqe.quant_layers"


# --------------------------------------------------------------------------------------------- builders
def on(device, cfg, kind, k, sizes, tensors, dtype=torch.float32, bias=None):
    """``qutil.build`` with the layer created on ``device`` the way the engine does it: parameters made under
    ``torch.device``, then checkpoint tensors (made on the CPU, so CPU and GPU builds with one seed hold the same
    weights) loaded and processed outside that context."""
    with torch.device(device):
        layer = make_layer(cfg, kind, k, sizes, dtype, bias is not None)
    load(layer, tensors)
    if bias is not None:
        layer.load_weight("bias", layer.bias, bias, None)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def gptq_layer(bits=4, gs=128, sym=True, act=False, k=576, sizes=(576, 192, 192), dtype=torch.float32, seed=0,
               kind="qkv", bias=True, device="cpu"):
    torch.manual_seed(seed)
    g_idx = (torch.randperm(k) // (k if gs == -1 else gs)).to(torch.int32) if act else None
    tensors, ws = [], []
    for n in sizes:
        cw = ref.rtn_quantize(torch.randn(n, k), bits, gs, sym, g_idx=g_idx)
        t = ref.encode_gptq(cw, "gptq_v2")
        tensors.append(t)
        ws.append(ref.decode_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, gs, sym, "gptq_v2").dequantize())
    c = GPTQConfig.from_hf_config({"quant_method": "gptq", "bits": bits, "group_size": gs, "sym": sym, "desc_act": act,
                                   "checkpoint_format": "gptq_v2"})
    b = torch.randn(sum(sizes)) if bias else None
    return on(device, c, kind, k, list(sizes), tensors, dtype=dtype, bias=b), torch.cat(ws, 1), b


def awq_layer(k=256, sizes=(128, 128), gs=64, dtype=torch.float32, seed=1, device="cpu"):
    torch.manual_seed(seed)
    tensors, ws = [], []
    for n in sizes:
        t = ref.encode_awq(ref.rtn_quantize(torch.randn(n, k), 4, gs, False))
        tensors.append(t)
        ws.append(ref.decode_awq(t["qweight"], t["qzeros"], t["scales"], gs).dequantize())
    c = AWQConfig.from_hf_config({"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": True, "version": "GEMM"})
    return on(device, c, "gate_up", k, list(sizes), tensors, dtype=dtype), torch.cat(ws, 1)


def ct_cfg(weights, acts, fmt):
    return CompressedTensorsConfig.from_hf_config({
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}})


def w8a8_layer(static=False, sym=True, k=256, sizes=(128, 64, 64), dtype=torch.float32, acts=True, seed=2, device="cpu"):
    torch.manual_seed(seed)
    tensors, wq, ws = [], [], []
    for i, n in enumerate(sizes):
        q, s = ref.quantize_int8_per_channel(torch.randn(n, k))
        t = {"weight": q, "weight_scale": s}
        if static:
            t["input_scale"] = torch.tensor([0.02 + 0.005 * i])
            if not sym:
                t["input_zero_point"] = torch.tensor([3], dtype=torch.int8)
        tensors.append(t)
        wq.append(q)
        ws.append(s.reshape(-1))
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    a = {"num_bits": 8, "type": "int", "symmetric": sym, "strategy": "tensor" if static else "token", "dynamic": not static}
    bias = torch.randn(sum(sizes))
    layer = on(device, ct_cfg(weights, a if acts else None, "int-quantized"), "qkv", k, list(sizes), tensors, dtype=dtype,
               bias=bias)
    w = torch.cat(wq).float() * torch.cat(ws)[:, None]  # [N, K]
    return layer, w, bias


def fp8_layer(strategy="channel", static=True, k=256, sizes=(128, 64), dtype=torch.float32, seed=3, device="cpu"):
    torch.manual_seed(seed)
    tensors, ws = [], []
    for n in sizes:
        w = torch.randn(n, k)
        if strategy == "block":
            q, s = w.to(torch.float8_e4m3fn), torch.rand(-(-n // 128), -(-k // 128)) + 0.5
        else:
            q, s = ref.quantize_fp8(w, per_channel=strategy == "channel")
        tensors.append({"weight": q, "weight_scale": s, **({"input_scale": torch.tensor([0.05])} if static else {})})
        ws.append(ref.dequant_fp8(q, s, (128, 128) if strategy == "block" else None))
    wargs = {"num_bits": 8, "type": "float", "strategy": strategy, "block_structure": [128, 128] if strategy == "block" else None}
    acts = {"num_bits": 8, "type": "float", "strategy": "tensor" if static else "token", "dynamic": not static}
    layer = on(device, ct_cfg(wargs, acts, "float-quantized"), "gate_up", k, list(sizes), tensors, dtype=dtype)
    return layer, torch.cat(ws)


# --------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True)
def fresh_log_keys(monkeypatch):
    monkeypatch.setattr(wna16_kernels, "_LOGGED", set())


def force(monkeypatch):
    """Make CPU layers go through the CUDA selection logic (the kernels themselves still see a CPU device)."""
    for mod in (wna16_kernels, weight_only, w8a8_mod, fp8_mod):
        monkeypatch.setattr(mod, "cuda_kernels_declined", lambda device: None)


@pytest.fixture
def force_cuda_selection(monkeypatch):
    force(monkeypatch)


class FakeExt:
    """The CUDA extension's four entry points, computed with lqe.kernels.gemm_ref on CPU."""

    def wna16_gemm(self, x, qweight, scales, zeros, bias, out, bits, group_size, slabs_per_split, counters,
                   ring=False, pdl=False):  # (ring, pdl: the same results, another way to stream / launch)
        p = repack.PackedWNA16(qweight, scales, zeros, None, bits, group_size, x.shape[1], out.shape[1])
        out.copy_(gemm_ref.wna16_gemm_ref(x, p, bias))
        return out

    def wna16_dequant(self, qweight, scales, zeros, out, bits, group_size):
        p = repack.PackedWNA16(qweight, scales, zeros, None, bits, group_size, out.shape[0], out.shape[1])
        out.copy_(gemm_ref.dequantize_wna16(p, out.dtype))
        return out

    def w8a8_gemm(self, xq, a_scale, azp, wq, w_scale, colsum, bias, out, slabs_per_split, counters):
        p = repack.PackedW8A8(wq, w_scale, colsum, xq.shape[1], out.shape[1])
        out.copy_(gemm_ref.w8a8_gemm_ref(xq, a_scale, azp, p, bias, out.dtype))
        return out

    def quantize_per_token(self, x, q, scale, azp):
        q2, s2, z2 = gemm_ref.quantize_per_token_ref(x, azp is None)
        q.copy_(q2)
        scale.copy_(s2)
        if azp is not None:
            azp.copy_(z2)


@pytest.fixture
def emulated_kernels(monkeypatch, force_cuda_selection):
    """lqe.kernels 'available' with the CPU emulation as its extension; the selectors skip only the device check."""
    monkeypatch.setattr(gemm, "_state", {"ext": FakeExt()})
    monkeypatch.setattr(gemm, "sm_count", lambda index: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def select_wna16(cw, device, dtype):
        why = repack.wna16_unsupported(cw)
        if why or dtype not in (torch.float16, torch.bfloat16):
            return None, f"lqe-wna16 unavailable: {why or dtype}"
        return gemm.WNA16Kernel(repack.repack_wna16(cw, dtype), "lqe-wna16 (emulated)"), "lqe-wna16 (emulated)"

    def select_w8a8(wq_kn, w_scale, device, dtype):
        why = repack.w8a8_unsupported(*wq_kn.shape)
        if why or dtype not in (torch.float16, torch.bfloat16):
            return None, f"lqe-w8a8 unavailable: {why or dtype}"
        return repack.repack_w8a8(wq_kn, w_scale), "lqe-w8a8 int8 GEMM (emulated)"

    monkeypatch.setattr(kernels, "select_w4a16_kernel", select_wna16)
    monkeypatch.setattr(kw, "select_w8a8_kernel", select_w8a8)
    monkeypatch.setattr(kernels, "fp8_rowwise_reason", lambda device: None)


def fallback_records(caplog):
    return [r for r in caplog.records if r.name == LOGGER and "runs on the torch path" in r.getMessage()]


# --------------------------------------------------------------------------------------------- CPU never tries
def test_cpu_layers_never_touch_the_kernels(monkeypatch, caplog):
    def boom(*a, **k):
        raise AssertionError("lqe.kernels consulted for a CPU layer")

    monkeypatch.setattr(kernels, "select_w4a16_kernel", boom)
    monkeypatch.setattr(kw, "select_w8a8_kernel", boom)
    monkeypatch.setattr(kernels, "fp8_rowwise_reason", boom)
    caplog.set_level(logging.INFO, logger=LOGGER)
    layer, _, _ = gptq_layer()
    assert wna16_kernels.cuda_kernels_declined(torch.device("cpu")) == "device is cpu"
    assert layer.quant_method.describe(layer).endswith("dequant-matmul (cpu)")
    wl, _, _ = w8a8_layer()
    assert wl.quant_method.describe(wl).endswith("torch._int_mm (cpu)") or "exact fallback (cpu)" in wl.quant_method.describe(wl)
    fl, _ = fp8_layer()
    assert fl.quant_method.describe(fl).endswith("weight-only dequant-matmul (cpu)")
    assert not fallback_records(caplog)


def test_disable_env(monkeypatch):
    assert wna16_kernels.cuda_kernels_declined("cuda") is None
    monkeypatch.setenv("LQE_DISABLE_CUDA_KERNELS", "1")
    assert "LQE_DISABLE_CUDA_KERNELS" in wna16_kernels.cuda_kernels_declined("cuda")
    monkeypatch.setenv("LQE_DISABLE_CUDA_KERNELS", "0")
    assert wna16_kernels.cuda_kernels_declined("cuda:0") is None


# --------------------------------------------------------------------------------------------- declines
def test_unavailable_extension_gives_the_reason(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    monkeypatch.setattr(gemm, "_state", {"error": "nvcc not found (set CUDA_HOME or put nvcc on PATH)"})
    cw = CanonicalWeight(torch.randint(0, 16, (128, 64), dtype=torch.uint8), torch.rand(1, 64), None, None, 4, 128)
    module, why = wna16_kernels._external(cw, torch.device("cuda"), torch.float16)
    assert module is None and why == "lqe-wna16 unavailable: nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    packed, why = kw.select_w8a8_kernel(torch.zeros(128, 64, dtype=torch.int8), torch.ones(64), "cuda", torch.bfloat16)
    assert packed is None and "nvcc not found" in why
    packed, why = kw.select_w8a8_kernel(torch.zeros(128, 64, dtype=torch.int8), torch.ones(64), "cuda", torch.float32)
    assert packed is None and "float32" in why
    assert "CUDA not available" in kernels.fp8_rowwise_reason("cuda")
    assert "device is cpu" in kernels.fp8_rowwise_reason("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_decline_is_torch_path_with_reason(monkeypatch, caplog, dtype):
    caplog.set_level(logging.INFO, logger=LOGGER)
    plain, w, b = gptq_layer(dtype=dtype)
    force(monkeypatch)
    forced, _, _ = gptq_layer(dtype=dtype)  # same seed: same weights, now through the CUDA selection (declines: cpu)
    forced2, _, _ = gptq_layer(dtype=dtype)
    desc = forced.quant_method.describe(forced)
    assert "lqe-wna16 unavailable: device is cpu, lqe-wna16 needs cuda" in desc
    assert type(forced.qkernel) is type(plain.qkernel)  # noqa: E721
    assert desc.replace("; " + forced.qkernel.why, "") == plain.quant_method.describe(plain)
    x = torch.randn(5, 576).to(dtype)
    assert torch.equal(forced(x), plain(x))  # bit-identical torch path
    recs = fallback_records(caplog)
    assert len(recs) == 1 and "gptq weight-only qkv_proj" in recs[0].getMessage()  # once per layer kind
    gptq_layer(dtype=dtype, kind="plain", sizes=(576,))
    assert len(fallback_records(caplog)) == 2 and "o_proj" in fallback_records(caplog)[1].getMessage()


def test_kernel_selection_exception_falls_back(force_cuda_selection, monkeypatch, caplog):
    def broken(*a, **k):
        raise RuntimeError("error building extension 'lqe_gemm'\nlong log")

    monkeypatch.setattr(kernels, "select_w4a16_kernel", broken)
    caplog.set_level(logging.INFO, logger=LOGGER)
    layer, w, b = gptq_layer(bits=8, gs=-1, k=256, sizes=(64,), kind="plain", dtype=torch.bfloat16)
    desc = layer.quant_method.describe(layer)
    assert "int8-weight-only" in desc and "lqe-wna16 failed: RuntimeError: error building extension 'lqe_gemm')" in desc
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert rel_err(layer(x), x.float() @ w + b) < 2e-2
    assert len(fallback_records(caplog)) == 1


@pytest.mark.parametrize("static,sym", [(False, True), (False, False), (True, True), (True, False)])
def test_w8a8_decline_is_torch_path_with_reason(monkeypatch, caplog, static, sym):
    caplog.set_level(logging.INFO, logger=LOGGER)
    plain, w, b = w8a8_layer(static, sym)
    force(monkeypatch)
    forced, _, _ = w8a8_layer(static, sym)
    desc = forced.quant_method.describe(forced)
    assert "lqe-w8a8 unavailable: device is cpu" in desc and hasattr(forced, "w_int8_t")
    assert desc.split(" (cpu; ")[0] + " (cpu)" == plain.quant_method.describe(plain)
    assert len(fallback_records(caplog)) == 1
    x = torch.randn(7, 256)
    assert torch.equal(forced(x), plain(x))
    assert rel_err(forced(x), x @ w.t() + b) < 0.05


def test_w8a8_weight_only_decline(force_cuda_selection, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    layer, w, b = w8a8_layer(acts=False, dtype=torch.bfloat16)
    desc = layer.quant_method.describe(layer)
    assert desc.startswith("w8a16 int8 channel, int8-weight-only") and "lqe-wna16 unavailable" in desc
    assert len(fallback_records(caplog)) == 1


@pytest.mark.parametrize("strategy,dtype,why", [("block", torch.float32, "block-scaled"), ("channel", torch.float32, "float32"),
                                                ("channel", torch.bfloat16, "device is cpu, fp8 _scaled_mm needs cuda")])
def test_fp8_decline_is_dequant_with_reason(monkeypatch, caplog, strategy, dtype, why):
    caplog.set_level(logging.INFO, logger=LOGGER)
    plain, w = fp8_layer(strategy, dtype=dtype)
    force(monkeypatch)
    layer, _ = fp8_layer(strategy, dtype=dtype)
    desc = layer.quant_method.describe(layer)
    assert "weight-only dequant-matmul (cpu; " in desc and why in desc
    x = torch.randn(3, 256).to(dtype)
    assert torch.equal(layer(x), plain(x))
    assert rel_err(layer(x), x.float() @ w.t()) < (1e-4 if dtype == torch.float32 else 2e-2)
    assert len(fallback_records(caplog)) == 1


# --------------------------------------------------------------------------------------------- kernel path (emulated)
WNA16_CASES = [  # bits, gs, sym, act, k, sizes
    (4, 128, True, False, 576, (576, 192, 192)),  # SmolLM2 qkv: 5 groups, the last one short
    (4, 128, False, True, 576, (64, 64, 64)),
    (4, 32, False, False, 256, (128, 64, 64)),
    (8, -1, True, False, 256, (128, 64, 64)),
    (8, 64, False, True, 256, (64, 64, 64)),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits,gs,sym,act,k,sizes", WNA16_CASES)
def test_gptq_kernel_path_emulated(emulated_kernels, caplog, dtype, bits, gs, sym, act, k, sizes):
    caplog.set_level(logging.INFO, logger=LOGGER)
    layer, w, b = gptq_layer(bits, gs, sym, act, k, sizes, dtype=dtype)
    desc = layer.quant_method.describe(layer)
    assert "cuda w4a16 kernel (lqe-wna16 (emulated))" in desc and ("act-order" in desc) == act
    assert isinstance(layer.qkernel, wna16_kernels.CudaWNA16) and not fallback_records(caplog)
    n = sum(sizes)
    # only the repacked state: no float copy of the weights, checkpoint tensors dropped
    for name, t in layer.named_buffers():
        assert t.numel() < k * n or t.dtype == torch.int32, name
    assert not any(nm in dict(layer.named_parameters()) for nm in ("qweight", "qzeros", "scales", "g_idx"))
    assert (layer.qkernel.perm is not None) == act
    for m in (1, 7, 130):  # 130 > LARGE_M_THRESHOLD: the dequantize + matmul branch
        x = torch.randn(2, m, k).to(dtype)
        out = layer(x)
        assert out.dtype == dtype and out.shape == (2, m, n)
        expect = x.float() @ w.to(dtype).float() + b.to(dtype).float()
        assert rel_err(out, expect) < (2e-2 if dtype == torch.bfloat16 else 4e-3)


def test_awq_kernel_path_emulated(emulated_kernels):
    layer, w = awq_layer(dtype=torch.float16)
    assert "cuda w4a16 kernel" in layer.quant_method.describe(layer)
    x = torch.randn(4, 256, dtype=torch.float16)
    assert rel_err(layer(x), x.float() @ w) < 4e-3


def test_kernel_declines_shape_then_torch_path(emulated_kernels, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    layer, w, b = gptq_layer(4, 32, False, False, 128, (48,), dtype=torch.bfloat16, kind="plain")  # N=48: not /64
    desc = layer.quant_method.describe(layer)
    assert "torch-int4pack" in desc and "cuda" not in desc.split(",", 1)[1].split("(")[0]
    recs = fallback_records(caplog)
    assert len(recs) == 1 and "multiples of 64" in recs[0].getMessage()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("static,sym", [(False, True), (False, False), (True, True), (True, False)])
def test_w8a8_kernel_path_emulated(emulated_kernels, caplog, dtype, static, sym):
    caplog.set_level(logging.INFO, logger=LOGGER)
    layer, w, b = w8a8_layer(static, sym, dtype=dtype)
    desc = layer.quant_method.describe(layer)
    assert "cuda lqe-w8a8 int8 GEMM (emulated)" in desc and not fallback_records(caplog)
    assert not hasattr(layer, "w_int8_t") and layer.w8a8_qweight.dtype == torch.int32
    assert (layer.w8a8_colsum is None) == sym
    x = torch.randn(3, 7, 256).to(dtype)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (3, 7, 256)
    x2 = x.reshape(-1, 256)
    if static:  # the same static quantization as the torch path
        assert torch.equal(kw.quantize_static(x2, layer.in_scale, layer.in_zp), ref.static_quant_int8(x2, layer.in_scale, layer.in_zp))
    assert rel_err(out, x.float() @ w.t() + b) < 0.05
    if not static and sym:  # per-token sym quantization is identical, so only output rounding differs
        q, s, _ = ref.per_token_quant_int8(x2)
        wq = gemm_ref.unpack_w8a8(repack.PackedW8A8(layer.w8a8_qweight, layer.w8a8_w_scale, None, 256, 256))
        exp = ref.int8_gemm_ref(q, wq.t(), s, layer.w8a8_w_scale, None, b).to(dtype)
        assert rel_err(out.reshape(-1, 256), exp) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("strategy,static", [("channel", False), ("tensor", True), ("channel", True)])
def test_fp8_scaled_mm_path(emulated_kernels, dtype, strategy, static):
    """torch._scaled_mm runs on CPU in this torch: the W8A8 FP8 glue end to end."""
    layer, w = fp8_layer(strategy, static, dtype=dtype)
    desc = layer.quant_method.describe(layer)
    assert "torch._scaled_mm" in desc and ("static per-tensor" in desc) == static
    assert layer.fp8_w_scale.shape == (1, 192) and not hasattr(layer, "fp8_scale")
    x = torch.randn(5, 256).to(dtype)
    out = layer(x)
    assert out.dtype == dtype and rel_err(out, x.float() @ w.t()) < 0.1


def test_split_k_counters_outlive_a_larger_reserve():
    """The CUDA GEMMs' split-K counters: one zeroed buffer per device, large enough that graphs never see it grow;
    when a call needs more, the old buffer stays alive (a graph captured earlier still addresses it)."""
    from lqe.kernels import gemm

    dev = torch.device("cpu")
    gemm._state.pop(f"counters:{dev}", None)
    first = gemm.counters(dev, 10)
    assert first.numel() == gemm.COUNTERS_MIN and not first.any()
    assert gemm.counters(dev, gemm.COUNTERS_MIN) is first
    bigger = gemm.counters(dev, gemm.COUNTERS_MIN + 1)
    assert bigger.numel() == gemm.COUNTERS_MIN + 1 and any(b is first for b in gemm._retired_counters)
    gemm._state.pop(f"counters:{dev}", None)


def test_pdl_switch(monkeypatch):
    """Programmatic dependent launch is on by default (unset or LQE_PDL=1) and off with LQE_PDL=0; it takes effect only
    on a CUDA device of compute capability 9.0+ (never on the CPU), and a value other than 0 / 1 / unset is an error
    that names the accepted ones."""
    from lqe.kernels import device_info

    cpu = torch.device("cpu")
    monkeypatch.delenv("LQE_PDL", raising=False)
    assert device_info.pdl_enabled(cpu) is False
    for value in ("1", "0", " 1 "):
        monkeypatch.setenv("LQE_PDL", value)
        assert device_info.pdl_enabled(cpu) is False  # no griddepcontrol off CUDA
    monkeypatch.setattr(device_info, "_cuda_capability", lambda index: (9, 0))  # (a Hopper GPU, as far as asked)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv("LQE_PDL", "1")
    assert device_info.pdl_enabled(cuda) is True
    monkeypatch.setenv("LQE_PDL", "0")
    assert device_info.pdl_enabled(cuda) is False
    monkeypatch.delenv("LQE_PDL")
    assert device_info.pdl_enabled(cuda) is True  # the default on sm_90+
    monkeypatch.setattr(device_info, "_cuda_capability", lambda index: (8, 0))
    for value in ("1", ""):
        monkeypatch.setenv("LQE_PDL", value)
        assert device_info.pdl_enabled(cuda) is False and device_info.pdl_supported(cuda) is False
    monkeypatch.setenv("LQE_PDL", "yes")
    with pytest.raises(ValueError, match="LQE_PDL='yes'.*use 0"):
        device_info.pdl_enabled(cuda)


def test_pdl_is_refused_where_it_would_not_apply():
    """pdl=True names the CUDA GEMV's launch: any other path (the Triton GEMMs, dequantize + cuBLAS, lqe-w4a16-mma
    weights) refuses it with an error naming the path, instead of timing a launch without PDL under a -pdl name."""
    from lqe.kernels import repack_mma

    g = torch.Generator().manual_seed(0)
    cw = CanonicalWeight(torch.randint(0, 16, (256, 128), dtype=torch.uint8, generator=g),
                         torch.rand(2, 128, generator=g) * 0.01 + 0.001, None, None, 4, 128)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    p = repack.repack_wna16(cw, torch.bfloat16)
    for path, name in (("triton-wna16", "triton-wna16"), ("dequant", "dequant+cublas"),
                       ("triton-dequant+cublas", "triton-dequant+cublas")):
        with pytest.raises(ValueError, match=f"pdl=True applies to the CUDA GEMV .*not to {re.escape(repr(name))}"):
            gemm.wna16_gemm(x, p, path=path, pdl=True)
    with pytest.raises(ValueError, match="not to lqe-w4a16-mma weights"):
        gemm.wna16_gemm(x, repack_mma.repack_mma(cw, torch.bfloat16), pdl=True)
