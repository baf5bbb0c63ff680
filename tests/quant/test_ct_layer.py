"""compressed-tensors layers: W8A8 int8 (dynamic/static, sym/asym, per-tensor shard scales), FP8 and
pack-quantized W4A16/W8A16, plus config matching and refusals."""
import pytest
import torch

from lqe.quant_layers import QuantWarning, reference as ref
from lqe.quant_layers.compressed_tensors import CompressedTensorsConfig
from qutil import build, make_layer, rel_err

INT8_W = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}


def cfg(weights, acts=None, fmt="int-quantized", ignore=("lm_head",), targets=("Linear",), **kw):
    group = {"targets": list(targets), "weights": weights, "input_activations": acts}
    return CompressedTensorsConfig.from_hf_config({"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
                                                   "config_groups": {"group_0": group}, "ignore": list(ignore), **kw})


def int8_shards(k, sizes, per_tensor, static, sym):
    torch.manual_seed(2)
    out, ws, ss = [], [], []
    for n in sizes:
        w = torch.randn(n, k)
        q, s = ref.quantize_int8_per_channel(w)
        if per_tensor:
            s = w.abs().max().reshape(1) / 127.0
            q = torch.round(w / s).clamp(-128, 127).to(torch.int8)
        t = {"weight": q, "weight_scale": s.to(torch.bfloat16).float()}
        if static:
            t["input_scale"] = torch.tensor([0.02 + 0.01 * len(out)])
            if not sym:
                t["input_zero_point"] = torch.tensor([3], dtype=torch.int8)
        out.append(t)
        ws.append(q)
        ss.append(t["weight_scale"].reshape(-1).expand(n))
    return out, torch.cat(ws), torch.cat(ss)


@pytest.mark.parametrize("static,sym", [(False, True), (False, False), (True, True), (True, False)])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_w8a8_int8(static, sym, per_tensor):
    k, sizes = 96, [64, 32, 32]
    acts = {"num_bits": 8, "type": "int", "symmetric": sym, "strategy": "tensor" if static else "token", "dynamic": not static}
    wargs = {**INT8_W, "strategy": "tensor" if per_tensor else "channel"}
    tensors, w_q, s_w = int8_shards(k, sizes, per_tensor, static, sym)
    bias = torch.randn(sum(sizes))
    layer = build(cfg(wargs, acts), "qkv", k, sizes, tensors, bias=bias)
    x = torch.randn(7, k)
    if static:
        scales = torch.tensor([t["input_scale"].item() for t in tensors])
        if sym:
            s_in, azp = scales.max(), None
        else:  # one quantizer covering every shard's range
            lo, hi = (scales * (-128 - 3)).min(), (scales * (127 - 3)).max()
            s_in = (hi - lo) / 255
            azp = torch.round(-128 - lo / s_in).to(torch.int32)
        expected = ref.int8_gemm_ref(ref.static_quant_int8(x, s_in, azp), w_q, s_in, s_w, azp, bias)
    else:
        x_q, s_a, azp = ref.per_token_quant_int8(x, sym)
        expected = ref.int8_gemm_ref(x_q, w_q, s_a, s_w, azp, bias)
    assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-5)
    w = w_q.float() * s_w[:, None]
    assert rel_err(layer(x), x @ w.t() + bias) < 0.05  # and close to the float product
    assert "w8a8 int8" in layer.quant_method.describe(layer)


def test_per_token_quant_by_hand():
    q, s, azp = ref.per_token_quant_int8(torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]]))
    assert q.tolist() == [[64, -127, 32], [0, 0, 0]]  # 63.5 -> 64 (half to even), 31.75 -> 32
    assert s[0].item() == pytest.approx(2 / 127) and s[1].item() == 0 and azp is None
    q, s, azp = ref.per_token_quant_int8(torch.tensor([[0.0, 2.55, 1.0]]), symmetric=False)
    assert s.item() == pytest.approx(0.01) and azp.item() == -128 and q.tolist() == [[-128, 127, -28]]
    acc = ref.int8_gemm_ref(torch.tensor([[1, 2]], dtype=torch.int8), torch.tensor([[3, 4], [5, 6]], dtype=torch.int8), 0.5, torch.tensor([1.0, 2.0]), azp=1)
    assert acc.tolist() == [[0.5 * 1 * (11 - 7), 0.5 * 2 * (17 - 11)]]


def test_w8a16_int8_weight_only():
    tensors, w_q, s_w = int8_shards(64, [32], False, False, True)
    for dtype in (torch.float32, torch.bfloat16):
        layer = build(cfg(INT8_W, None), "plain", 64, [32], tensors, dtype=dtype)
        x = torch.randn(3, 64, dtype=dtype)
        assert rel_err(layer(x), x.float() @ (w_q.float() * s_w[:, None]).t()) < 1e-2


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_fp8(strategy):
    torch.manual_seed(3)
    k, sizes = 160, [128, 64]
    tensors, ws = [], []
    for n in sizes:
        w = torch.randn(n, k)
        if strategy == "block":
            q = w.to(torch.float8_e4m3fn)
            s = torch.rand(-(-n // 128), -(-k // 128)) + 0.5
        else:
            q, s = ref.quantize_fp8(w, per_channel=strategy == "channel")
        tensors.append({"weight": q, "weight_scale": s, "input_scale": torch.tensor([0.1])})
        ws.append(ref.dequant_fp8(q, s, (128, 128) if strategy == "block" else None))
    wargs = {"num_bits": 8, "type": "float", "strategy": strategy, "block_structure": [128, 128] if strategy == "block" else None}
    acts = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    layer = build(cfg(wargs, acts, fmt="float-quantized"), "gate_up", k, sizes, tensors)
    x = torch.randn(3, k)
    assert torch.allclose(layer(x), x @ torch.cat(ws).t(), rtol=1e-4, atol=1e-4)
    assert layer.quant_method.describe(layer).startswith("fp8 e4m3")


@pytest.mark.parametrize("bits,sym,gs,act", [(4, True, 128, False), (4, False, 64, True), (8, True, None, False), (8, False, 32, False)])
def test_pack_quantized(bits, sym, gs, act):
    torch.manual_seed(4)
    k, sizes = 576, [64, 24, 24]  # 24 is not a multiple of 8: zero points of each shard padded separately
    g_idx = (torch.randperm(k) // gs).to(torch.int32) if act else None
    tensors, ws = [], []
    for n in sizes:
        cw = ref.rtn_quantize(torch.randn(n, k), bits, gs or -1, sym, g_idx=g_idx)
        t = ref.encode_ct_packed(cw)
        tensors.append(t)
        ws.append(ref.decode_ct_packed(t["weight_packed"], t["weight_scale"], t["weight_shape"], bits, gs or -1,
                                       t.get("weight_zero_point"), t.get("weight_g_idx")).dequantize())
    wargs = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group" if gs else "channel", "group_size": gs,
             "actorder": "group" if act else None}
    layer = build(cfg(wargs, None, fmt="pack-quantized"), "qkv", k, sizes, tensors)
    x = torch.randn(5, k)
    assert torch.allclose(layer(x), x @ torch.cat(ws, 1), rtol=1e-4, atol=1e-4)
    assert "compressed-tensors w%da16" % bits in layer.quant_method.describe(layer)


def test_weight_shape_checked():
    cw = ref.rtn_quantize(torch.randn(32, 128), 4, 32, True)
    t = ref.encode_ct_packed(cw)
    t["weight_shape"] = torch.tensor([32, 120])
    wargs = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}
    with pytest.raises(ValueError, match=r"weight_shape: expected \[32, 128\], found \[32, 120\]"):
        build(cfg(wargs, None, fmt="pack-quantized"), "plain", 128, [32], [t])


def test_targets_ignore_and_fused_consistency():
    c = cfg(INT8_W, None, ignore=("lm_head", "re:.*mlp.down_proj$", "model.layers.0.self_attn.k_proj"),
            targets=("re:.*self_attn.*", "re:.*mlp.*"))
    assert c.get_linear_method(None, "lm_head") is None
    assert c.get_linear_method(None, "model.layers.0.mlp.down_proj") is None
    assert c.get_linear_method(None, "model.layers.1.self_attn.qkv_proj") is not None
    with pytest.raises(ValueError, match="resolve to different compressed-tensors schemes"):
        c.get_linear_method(None, "model.layers.0.self_attn.qkv_proj")


@pytest.mark.parametrize("weights,acts,fmt,kw,match", [
    (INT8_W, None, "int-quantized", {"quantization_status": "initialized"}, "quantization_status 'initialized'"),
    ({**INT8_W, "symmetric": False}, None, "int-quantized", {}, "8-bit symmetric"),
    ({**INT8_W, "num_bits": 2}, None, "pack-quantized", {}, "4 or 8 bits"),
    (INT8_W, {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 128, "dynamic": True}, "int-quantized", {}, "per-token"),
    (INT8_W, None, "marlin-24", {}, "format 'marlin-24'"),
])
def test_ct_config_errors(weights, acts, fmt, kw, match):
    with pytest.raises(ValueError, match=match):
        cfg(weights, acts, fmt=fmt, **kw)


def test_frozen_status_float_weights_refused():
    with pytest.warns(QuantWarning, match="frozen"):
        c = cfg(INT8_W, None, quantization_status="frozen")
    layer = make_layer(c, "plain", 64, [32])
    with pytest.raises(ValueError, match=r"o_proj.weight: expected dtype int8, found torch.float32.*fake-quantized"):
        layer.load_weight("weight", layer.weight, torch.randn(32, 64), None)
