"""GPTQ layers end to end: pack with the reference encoder, load through ``layer.load_weight``, process,
and compare ``apply`` with ``x @ W`` where W is decoded independently by the reference decoder."""
import pytest
import torch

from lqe.quant_layers import QuantWarning, reference as ref
from lqe.quant_layers.gptq import GPTQConfig
from qutil import build, make_layer, load, rel_err


def cfg(**kw):
    base = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
    return GPTQConfig.from_hf_config({**base, **kw})


def shards(bits, gs, sym, fmt, k, sizes, act_order=False, seed=0):
    torch.manual_seed(seed)
    g_idx = (torch.randperm(k) // (k if gs == -1 else gs)).to(torch.int32) if act_order else None
    out, ws = [], []
    for n in sizes:
        cw = ref.rtn_quantize(torch.randn(n, k), bits, gs, sym, g_idx=g_idx)
        if cw.zeros is not None and fmt == "gptq":
            cw.zeros.clamp_(min=1)  # v1 cannot store zero 0
        t = ref.encode_gptq(cw, fmt)
        out.append(t)
        ws.append(ref.decode_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, gs, sym, fmt).dequantize())
    return out, torch.cat(ws, dim=1)


CASES = [  # bits, group, sym, fmt, act_order, kind, K, sizes
    (4, 128, True, "gptq", False, "qkv", 576, [576, 192, 192]),  # SmolLM2: 5 groups, last one short
    (4, 128, False, "gptq", False, "gate_up", 576, [64, 64]),
    (4, 128, False, "gptq_v2", True, "qkv", 576, [64, 32, 32]),
    (4, 32, False, "gptq", True, "plain", 128, [48]),
    (4, 64, True, "gptq_v2", False, "plain", 192, [40]),
    (4, -1, False, "gptq", False, "gate_up", 96, [32, 16]),
    (8, 128, True, "gptq", True, "qkv", 256, [64, 32, 32]),
    (8, 32, False, "gptq_v2", False, "plain", 96, [20]),
    (8, -1, True, "gptq_v2", False, "plain", 64, [24]),
    (2, 32, False, "gptq_v2", False, "plain", 64, [32]),
    (3, 64, True, "gptq", False, "plain", 128, [64]),
]


@pytest.mark.parametrize("bits,gs,sym,fmt,act,kind,k,sizes", CASES)
def test_gptq_apply_matches_dequant(bits, gs, sym, fmt, act, kind, k, sizes):
    tensors, w = shards(bits, gs, sym, fmt, k, sizes, act)
    c = cfg(bits=bits, group_size=gs, sym=sym, checkpoint_format=fmt, desc_act=act)
    bias = torch.randn(sum(sizes))
    layer = build(c, kind, k, sizes, tensors, bias=bias)
    x = torch.randn(3, 2, k)
    assert torch.allclose(layer(x), x @ w + bias, rtol=1e-4, atol=1e-4)
    desc = layer.quant_method.describe(layer)
    assert f"gptq {bits}-bit" in desc and ("act-order" in desc) == act and "qweight" not in dict(layer.named_parameters())


@pytest.mark.parametrize("bits,gs", [(4, 128), (4, 32), (8, -1), (4, 96)])
def test_gptq_bf16_paths(bits, gs):
    k, sizes = 384, [64, 32, 32]
    tensors, w = shards(bits, gs, False, "gptq_v2", k, sizes)
    layer = build(cfg(bits=bits, group_size=gs, sym=False, checkpoint_format="gptq_v2"), "qkv", k, sizes, tensors, dtype=torch.bfloat16)
    x = torch.randn(5, k, dtype=torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and rel_err(out, x.float() @ w) < 2e-2
    if (bits, gs) in ((4, 128), (4, 32)):
        assert "int4pack" in layer.quant_method.describe(layer)


def test_sym_ignores_zeros_and_warns_on_v2_under_v1_label():
    tensors, w = shards(4, 128, True, "gptq_v2", 256, [32])  # v2 constant 0x88888888 ...
    with pytest.warns(QuantWarning, match=r"o_proj: stored qzeros are the gptq_v2 symmetric constant"):
        layer = build(cfg(checkpoint_format="gptq"), "plain", 256, [32], tensors)  # ... under a v1 label
    x = torch.randn(2, 256)
    assert torch.allclose(layer(x), x @ w, atol=1e-4)


def test_asym_v1_zero0_corruption_warns():
    tensors, _ = shards(4, 128, False, "gptq", 256, [32])
    tensors[0]["qzeros"][0, 0] = -14  # 0xFFFFFFF2: AutoGPTQ's packing of a true zero 0
    with pytest.warns(QuantWarning, match=r"self_attn.o_proj: 7 stored qzeros fields equal 15"):
        build(cfg(sym=False), "plain", 256, [32], tensors)


def test_errors_name_the_tensor():
    tensors, _ = shards(4, 128, False, "gptq", 256, [32])
    layer = make_layer(cfg(sym=False), "plain", 256, [32])
    with pytest.raises(ValueError, match=r"o_proj.qweight: expected shape \(32, 32\), found \(16, 32\)"):
        layer.load_weight("qweight", layer.qweight, tensors[0]["qweight"][:16], None)
    with pytest.raises(ValueError, match=r"o_proj.scales: expected dtype .*found torch.int32"):
        layer.load_weight("scales", layer.scales, tensors[0]["qweight"][:2], None)
    with pytest.raises(ValueError, match=r"qweight: expected dtype int32, found torch.int64"):
        layer.load_weight("qweight", layer.qweight, tensors[0]["qweight"].long(), None)
    load(layer, [{k: v for k, v in tensors[0].items() if k != "qzeros"}])
    with pytest.raises(ValueError, match=r"tensor model.layers.0.self_attn.o_proj.qzeros is missing"):
        layer.quant_method.process_weights_after_loading(layer)


def test_group_count_576_g128():
    tensors, _ = shards(4, 128, True, "gptq", 576, [32])
    layer = make_layer(cfg(), "plain", 576, [32])
    with pytest.raises(ValueError, match=r"scales: expected shape \(5, 32\), found \(4, 32\)"):
        layer.load_weight("scales", layer.scales, tensors[0]["scales"][:4], None)


def test_fused_g_idx_must_agree():
    tensors, _ = shards(4, 32, True, "gptq", 128, [32, 32, 32], act_order=True)
    tensors[1]["g_idx"] = torch.arange(128, dtype=torch.int32) // 32
    with pytest.raises(ValueError, match=r"qkv_proj.g_idx \(shard 'k'\) differs from shard 'q'"):
        build(cfg(group_size=32, desc_act=True), "qkv", 128, [32, 32, 32], tensors)


def test_g_idx_out_of_range():
    tensors, _ = shards(4, 32, True, "gptq", 128, [32])
    tensors[0]["g_idx"] = torch.full((128,), 7, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"g_idx: group ids must lie in \[0, 4\)"):
        build(cfg(group_size=32), "plain", 128, [32], tensors)


def test_desc_act_detected_from_tensor_not_flag():
    tensors, w = shards(4, 32, False, "gptq_v2", 128, [32], act_order=True)
    layer = build(cfg(group_size=32, sym=False, checkpoint_format="gptq_v2", desc_act=False), "plain", 128, [32], tensors)
    assert "act-order" in layer.quant_method.describe(layer)
    x = torch.randn(2, 128)
    assert torch.allclose(layer(x), x @ w, atol=1e-4)


@pytest.mark.parametrize("bad,match", [
    ({"bits": 5}, "bits=5 is not supported"),
    ({"pack_dtype": "int16"}, "pack_dtype 'int16' is not supported"),
    ({"checkpoint_format": "marlin"}, "'marlin'"),
    ({"checkpoint_format": "gptq_v3"}, "gptq_v3"),
    ({"dynamic": {"+:.*q_proj": {"bits": 6}}}, r"dynamic\['.\*q_proj'\]: GPTQ bits=6"),
    ({"group_size": 0}, "group_size=0"),
])
def test_config_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        cfg(**bad)


def test_dynamic_rules_and_lm_head():
    c = cfg(dynamic={"-:.*layers\\.1\\..*": {}, "+:.*mlp\\..*": {"bits": 8, "group_size": 32}, ".*layers\\.2\\.self_attn\\.q_proj": {"sym": False}},
            lm_head=False)
    assert c.params_for("model.layers.1.self_attn.qkv_proj") is None
    mlp = c.params_for("model.layers.0.mlp.gate_up_proj")
    assert (mlp.bits, mlp.group_size) == (8, 32)
    assert c.params_for("model.layers.0.self_attn.qkv_proj").bits == 4
    with pytest.raises(ValueError, match="resolve to different GPTQ `dynamic` rules"):
        c.params_for("model.layers.2.self_attn.qkv_proj")
    assert c.params_for("lm_head") is None and cfg(lm_head=True).params_for("lm_head") is not None
    fused_only = cfg(dynamic={"-:.*qkv_proj": {}})
    assert fused_only.params_for("model.layers.0.self_attn.qkv_proj") is None


def test_modules_in_block_to_quantize():
    c = cfg(modules_in_block_to_quantize=[["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.down_proj"]])
    assert c.params_for("model.layers.0.self_attn.qkv_proj") is not None
    assert c.params_for("model.layers.0.mlp.gate_up_proj") is None
    assert c.params_for("model.layers.0.mlp.down_proj") is not None
    bad = cfg(modules_in_block_to_quantize=[["self_attn.q_proj"]])
    with pytest.raises(ValueError, match="membership"):
        bad.params_for("model.layers.0.self_attn.qkv_proj")


def test_missing_sym_key_warns():
    with pytest.warns(QuantWarning, match="no 'sym' key"):
        GPTQConfig.from_hf_config({"quant_method": "gptq", "bits": 4, "group_size": 128})
