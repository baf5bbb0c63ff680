"""CPU tests of the link pass (lqe/layers/act_quant_fusion.py) for FP8 consumers and mixed checkpoints, and of the
FP8 block-scaled layer's kernel selection (lqe/quant_layers/fp8.py).

* FP8 W8A8 with dynamic activations: the norm / SiLU-mul producers emit fp8 per token (channel / tensor weight scales,
  ``torch._scaled_mm`` / GEMV path) or per 1 x 128 group (128x128 block-scaled weights, the Triton block GEMM), and a
  whole engine gives the same tokens and logprobs, bit for bit, with the link on and off. The FP8 GPU paths are faked on
  CPU: ``fp8_rowwise_reason`` says yes (``torch._scaled_mm`` itself runs on CPU), and the block GEMM is a torch
  product of the dequantized operands (the producers run their torch twins, as on any CPU tensor).
* What is not linked: static fp8 activations, a float consumer, consumers of one producer that take different
  inputs, tensor-parallel shards.
* The block-scaled layer picks the Triton block GEMM only on an FP8 GPU (capability faked: 9.0 yes, 8.0 no), with
  128x128 blocks, dynamic activations and K % 128 == 0; otherwise the weight-only dequant path with the reason.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "quant"))

from helpers import build_tiny_model, write_quantized_checkpoint
from lqe.quant_layers import reference as ref
from qutil import build  # noqa: E402
from test_act_quant_fusion import _load, _producers, _run  # noqa: E402

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
             initializer_range=0.1)  # every fused shard and K a multiple of 128: block-scaled weights fit
PAIRS = [("input_layernorm", "self_attn.qkv_proj"), ("post_attention_layernorm", "mlp.gate_up_proj"),
         ("mlp.act_fn", "mlp.down_proj")]


def _fp8_block(w: torch.Tensor) -> dict:
    n, k = w.shape
    s = w.reshape(n // 128, 128, k // 128, 128).abs().amax((1, 3)).clamp(min=1e-12) / 448.0
    q = (w / s.repeat_interleave(128, 0).repeat_interleave(128, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": s}


def _fp8_group(strategy: str, dynamic: bool, targets: list[str]) -> dict:
    return {"targets": targets, "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                            "block_structure": [128, 128] if strategy == "block" else None},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token" if dynamic else "tensor",
                                  "dynamic": dynamic}}


def _int8_group(targets: list[str]) -> dict:
    return {"targets": targets, "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}}


def _encode(kind: str):
    def encode(name: str, w: torch.Tensor) -> dict:
        k = kind if kind != "mixed" else ("int8" if ".mlp." in name else "fp8-channel")
        if kind == "mixed" and name.endswith("down_proj"):
            return {"weight": w}  # ignored: stays float
        if k == "int8":
            q, s = ref.quantize_int8_per_channel(w)
            return {"weight": q, "weight_scale": s}
        if k == "fp8-block":
            return _fp8_block(w)
        q, s = ref.quantize_fp8(w, per_channel=True)
        return {"weight": q, "weight_scale": s, **({"input_scale": torch.tensor([0.02])} if kind == "fp8-static" else {})}
    return encode


CONFIGS = {
    "fp8-channel": {"group_0": _fp8_group("channel", True, ["Linear"])},
    "fp8-block": {"group_0": _fp8_group("block", True, ["Linear"])},
    "fp8-static": {"group_0": _fp8_group("channel", False, ["Linear"])},
    # attention fp8, gate_up int8 W8A8, down_proj float (ignored): each producer takes its own consumer's scheme
    "mixed": {"group_0": _fp8_group("channel", True, ["re:.*self_attn.*"]), "group_1": _int8_group(["re:.*mlp.*"])},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("act-quant-link")
    base = build_tiny_model(str(root / "float"), "llama", tokenizer=False, **SHAPE)
    dirs = {}
    for name, groups in CONFIGS.items():
        fmt = "mixed-precision" if name == "mixed" else "float-quantized"
        qcfg = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
                "ignore": ["lm_head"] + (["re:.*down_proj"] if name == "mixed" else []), "config_groups": groups}
        if name == "mixed":
            groups["group_0"]["format"], groups["group_1"]["format"] = "float-quantized", "int-quantized"
        dirs[name] = write_quantized_checkpoint(base, str(root / name), _encode(name), qcfg)
    return dirs


@pytest.fixture
def fake_fp8_gpu(monkeypatch):
    """FP8 layers on CPU select their GPU paths; counts the calls that received a pre-quantized input."""
    import lqe.kernels as kernels
    from lqe.kernels import triton_fp8
    from lqe.kernels import w8a8 as kw
    from lqe.quant_layers import fp8 as fp8_mod
    from lqe.quant_layers.quantized_activation import QuantizedActivation

    def block_mm(xq, xs, wq, ws, bias=None, out_dtype=torch.bfloat16):
        x = (xq.float().unflatten(-1, (xs.shape[-1], 128)) * xs[..., None]).flatten(-2)
        w = wq.float() * ws.repeat_interleave(128, 0)[: wq.shape[0]].repeat_interleave(128, 1)[:, : wq.shape[1]]
        out = x @ w.t()
        return (out if bias is None else out + bias.float()).to(out_dtype)

    calls: dict[str, int] = {}
    real = fp8_mod.FP8Method.apply

    def counted(self, layer, x, bias=None):
        if isinstance(x, QuantizedActivation):
            calls[layer.prefix.rsplit(".", 1)[-1]] = calls.get(layer.prefix.rsplit(".", 1)[-1], 0) + 1
        return real(self, layer, x, bias)

    monkeypatch.setattr(fp8_mod, "cuda_kernels_declined", lambda device: None)
    monkeypatch.setattr(kernels, "fp8_rowwise_reason", lambda device: None)
    monkeypatch.setattr(triton_fp8, "available", lambda: None)
    monkeypatch.setattr(kw, "fp8_supported", lambda device=None: None)
    monkeypatch.setattr(kw, "fp8_block_apply_quantized", block_mm)
    monkeypatch.setattr(fp8_mod.FP8Method, "apply", counted)
    return calls


def _want(schemes: list[str | None]) -> dict[str, str]:
    return {f"model.layers.{i}.{p}": s for i in range(2) for (p, _), s in zip(PAIRS, schemes) if s is not None}


@pytest.mark.parametrize("name,schemes,path", [
    ("fp8-channel", ["fp8-per-token"] * 3, "torch._scaled_mm"),
    ("fp8-static", ["fp8-static"] * 3, "torch._scaled_mm"),
    ("fp8-block", ["fp8-per-group(128)"] * 3, "triton-fp8-block"),
    ("mixed", ["fp8-per-token", "int8-per-token-sym", None], "torch._scaled_mm"),
])
def test_fp8_pairs_linked_and_no_bit_changes(name, schemes, path, checkpoints, fake_fp8_gpu, fake_cuda_plan,
                                             monkeypatch):
    llm = _load(checkpoints[name], monkeypatch, True, "bfloat16")
    runner = llm.llm_engine.runner
    model = runner.model
    assert path in model.model.layers[0].self_attn.qkv_proj.quant_method.describe(model.model.layers[0].self_attn.qkv_proj)
    linked = {n: str(s) for n, s in _producers(model).items() if s is not None}
    assert linked == _want(schemes)
    assert sorted(p for p, _ in runner.fused_act_quant) == sorted(linked)
    fused = _run(llm)
    fp8_consumers = {c.rsplit(".", 1)[-1] for (_, c), s in zip(PAIRS, schemes) if s is not None and s.startswith("fp8")}
    assert set(fake_fp8_gpu) == fp8_consumers and len(set(fake_fp8_gpu.values())) == 1
    if name == "mixed":
        assert set(fake_cuda_plan) == {"gate_up_proj"}  # the int8 W8A8 consumer took int8 from its norm
    del llm, runner, model
    fake_fp8_gpu.clear()
    llm = _load(checkpoints[name], monkeypatch, False, "bfloat16")
    assert llm.llm_engine.runner.fused_act_quant == []
    unfused = _run(llm)
    assert not fake_fp8_gpu
    assert fused[0] == unfused[0] and torch.equal(fused[1], unfused[1]), (fused, unfused)


def test_static_fp8_producers_serve_their_own_consumer(checkpoints, fake_fp8_gpu, monkeypatch):
    """A static fp8 consumer offers its own input_scale buffer: the producer quantizes with that tensor (read on the
    device, not a value copied at link time), and a QuantizedActivation made with another scale is refused."""
    from lqe.quant_layers.quantized_activation import FP8_STATIC, ActQuant

    llm = _load(checkpoints["fp8-static"], monkeypatch, True, "bfloat16")
    model = llm.llm_engine.runner.model
    attn = model.model.layers[0]
    layer = attn.self_attn.qkv_proj
    assert "static per-tensor" in layer.quant_method.describe(layer)
    spec = attn.input_layernorm.output_quant
    assert spec.scheme == FP8_STATIC and spec.scale is layer.fp8_in_scale
    x = torch.randn(3, layer.fp8_weight.shape[1], dtype=torch.bfloat16)
    other = ActQuant(FP8_STATIC, scale=layer.fp8_in_scale.clone())
    qa = other.rms_norm(x, attn.input_layernorm.weight, 1e-6)
    with pytest.raises(ValueError, match="fp8-static"):
        layer.quant_method.apply(layer, qa)
    with pytest.raises(ValueError, match="zero point"):
        ActQuant(FP8_STATIC, scale=layer.fp8_in_scale, zero_point=torch.zeros(1, dtype=torch.int32))
    del llm, model


def test_cpu_fp8_links_nothing(checkpoints, monkeypatch):
    llm = _load(checkpoints["fp8-channel"], monkeypatch, True, "bfloat16")
    assert llm.llm_engine.runner.fused_act_quant == []


def test_tensor_parallel_shards_are_not_offered(checkpoints, fake_fp8_gpu, monkeypatch):
    from lqe.layers.act_quant_fusion import link_act_quant

    llm = _load(checkpoints["fp8-block"], monkeypatch, True, "bfloat16")
    model = llm.llm_engine.runner.model
    assert len(link_act_quant(model)) == 6
    assert link_act_quant(model, tp_size=2) == [] and not any(_producers(model).values())
    layer = model.model.layers[0].mlp.down_proj
    assert str(layer.quant_method.input_quant(layer)) == "fp8-per-group(128)"
    layer.tp_mode = "row"  # a row-parallel shard quantizes with the all-reduced range: never from its producer
    assert layer.quant_method.input_quant(layer) is None


# ------------------------------------------------------------------------------------------------ one producer, two consumers
class _Offer:
    def __init__(self, spec):
        self.spec = spec

    def input_quant(self, layer):
        return self.spec


class _Block(nn.Module):
    act_quant_pairs = (("norm", "a"), ("norm", "b"))

    def __init__(self, spec_a, spec_b):
        from lqe.layers.norm import RMSNorm

        super().__init__()
        self.norm = RMSNorm(16, 1e-6, torch.float32)
        self.a, self.b = nn.Linear(16, 8), nn.Linear(16, 8)
        self.a.quant_method, self.b.quant_method = _Offer(spec_a), _Offer(spec_b)


def test_a_producer_links_only_when_all_its_consumers_agree(caplog):
    from lqe.layers.act_quant_fusion import _LOGGED, link_act_quant
    from lqe.quant_layers import quantized_activation as qa

    _LOGGED.clear()
    scale = torch.tensor([0.1])
    same = _Block(qa.ActQuant(qa.INT8_STATIC, scale=scale), qa.ActQuant(qa.INT8_STATIC, scale=scale.clone()))
    assert link_act_quant(same) == [("norm", "a"), ("norm", "b")] and str(same.norm.output_quant) == "int8-static(sym)"
    with caplog.at_level("INFO", logger="lqe"):
        for spec_b in (qa.ActQuant(qa.INT8_STATIC, scale=torch.tensor([0.2])), qa.ActQuant(qa.FP8_PER_TOKEN), None):
            mixed = _Block(qa.ActQuant(qa.INT8_STATIC, scale=scale), spec_b)
            assert link_act_quant(mixed) == [] and mixed.norm.output_quant is None
    assert sum("consumers take different inputs" in r.getMessage() for r in caplog.records) == 3


# ------------------------------------------------------------------------------------------------ block-scaled selection
@pytest.mark.parametrize("cap,block,k,why", [((9, 0), (128, 128), 256, None), ((8, 9), (128, 128), 256, None),
                                             ((8, 0), (128, 128), 256, "compute capability 8.0 < 8.9"),
                                             ((9, 0), (64, 64), 256, "block 64x64"),
                                             ((9, 0), (128, 128), 192, "K=192 is not a multiple of 128")])
def test_fp8_block_layer_picks_the_triton_kernel_on_fp8_gpus(monkeypatch, cap, block, k, why):
    """The selection logic of FP8Method for block-scaled weights, the device capability faked (the layer on CPU)."""
    from lqe.kernels import triton_fp8
    from lqe.quant_layers import fp8 as fp8_mod
    from lqe.quant_layers.compressed_tensors import CompressedTensorsConfig

    monkeypatch.setattr(fp8_mod, "cuda_kernels_declined", lambda device: None)
    monkeypatch.setattr(triton_fp8, "available", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    cfg = CompressedTensorsConfig.from_hf_config({
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                                                   "block_structure": list(block)},
                                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                      "dynamic": True}}}})
    torch.manual_seed(0)
    sizes = [128, 128]
    w = torch.randn(sum(sizes), k)
    tensors = []
    for i, n in enumerate(sizes):
        s = torch.rand(-(-n // block[0]), -(-k // block[1])) + 0.5
        tensors.append({"weight": w[i * n:(i + 1) * n].to(torch.float8_e4m3fn), "weight_scale": s})
    layer = build(cfg, "gate_up", k, sizes, tensors, dtype=torch.bfloat16)  # loaded and processed
    desc = layer.quant_method.describe(layer)
    if why is None:
        assert "triton-fp8-block (cuda)" in desc and layer.fp8_block_scale.shape == (2, k // 128)
        assert str(layer.quant_method.input_quant(layer)) == "fp8-per-group(128)"
    else:
        assert "weight-only dequant-matmul" in desc and why in desc, desc
        assert getattr(layer, "fp8_block_scale", None) is None and layer.quant_method.input_quant(layer) is None
