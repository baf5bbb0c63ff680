"""AWQ GEMM layers: interleaved packing, real zeros, zero_point false, skips and refusals."""
import pytest
import torch

from lqe.quant_layers import reference as ref
from lqe.quant_layers.awq import AWQConfig
from qutil import build, make_layer, rel_err


def cfg(**kw):
    return AWQConfig.from_hf_config({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm", **kw})


def shards(k, sizes, gs, sym=False, drop_zeros=False):
    torch.manual_seed(1)
    out, ws = [], []
    for n in sizes:
        t = ref.encode_awq(ref.rtn_quantize(torch.randn(n, k), 4, gs, sym))
        if drop_zeros:
            del t["qzeros"]
        out.append(t)
        ws.append(ref.decode_awq(t["qweight"], t.get("qzeros"), t["scales"], gs).dequantize())
    return out, torch.cat(ws, 1)


@pytest.mark.parametrize("kind,k,sizes,gs", [("qkv", 576, [64, 32, 32], 128), ("gate_up", 256, [48, 48], 64), ("plain", 128, [24], -1)])
def test_awq_apply(kind, k, sizes, gs):
    tensors, w = shards(k, sizes, gs)
    layer = build(cfg(group_size=gs), kind, k, sizes, tensors)
    x = torch.randn(4, k)
    assert torch.allclose(layer(x), x @ w, atol=1e-4)
    assert layer.quant_method.describe(layer).startswith("awq 4-bit")


def test_awq_zero_point_false_with_and_without_qzeros():
    tensors, w = shards(128, [32], 64, sym=True)
    assert int(ref.unpack_awq(tensors[0]["qzeros"]).unique().item()) == 8
    x = torch.randn(2, 128)
    assert torch.allclose(build(cfg(group_size=64, zero_point=False), "plain", 128, [32], tensors)(x), x @ w, atol=1e-4)
    tensors, _ = shards(128, [32], 64, sym=True, drop_zeros=True)
    assert torch.allclose(build(cfg(group_size=64, zero_point=False), "plain", 128, [32], tensors)(x), x @ w, atol=1e-4)


def test_awq_bf16():
    tensors, w = shards(256, [64, 64], 128)
    layer = build(cfg(), "gate_up", 256, [64, 64], tensors, dtype=torch.bfloat16)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert rel_err(layer(x), x.float() @ w) < 2e-2


def test_awq_config_rules():
    with pytest.raises(ValueError, match="GEMV checkpoints store qweight"):
        cfg(version="gemv")
    with pytest.raises(ValueError, match="4-bit only"):
        cfg(bits=8)
    old = AWQConfig.from_hf_config({"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM".lower()})
    assert (old.bits, old.group_size) == (4, 64)
    c = cfg(modules_to_not_convert=["mlp.down_proj", "self_attn.k_proj"])
    assert c.get_linear_method(None, "model.layers.0.mlp.down_proj") is None
    assert c.get_linear_method(None, "model.layers.0.mlp.gate_up_proj") is not None
    assert c.get_linear_method(None, "lm_head") is None
    with pytest.raises(ValueError, match="modules_to_not_convert"):
        c.get_linear_method(None, "model.layers.0.self_attn.qkv_proj")


def test_awq_missing_qzeros_with_zero_point():
    tensors, _ = shards(128, [32], 64, drop_zeros=True)
    with pytest.raises(ValueError, match="o_proj.qzeros is missing"):
        build(cfg(group_size=64), "plain", 128, [32], tensors)
    with pytest.raises(ValueError, match="multiples of 8"):
        make_layer(cfg(), "plain", 128, [12])
