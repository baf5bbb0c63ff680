"""Residual-stream rotation (tools/convert/rotation.py): exact float equivalence, Hadamard construction, and the
rotated, untied checkpoint as lqe and transformers load it."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from cutil import PROMPT, engine_logprobs, hf_prompt_logprobs
from helpers import build_tiny_model
from tools.convert.rotation import (Rotation, hadamard, model_rotation, rotate_embedding, rotate_head, rotate_layer,
                                    rotate_model, rotation_matrix)
from tools.convert.spec import ConvertError


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rot")
    return {"llama-tied": build_tiny_model(str(root / "llama-tied"), "llama", tokenizer=False),
            "llama-untied": build_tiny_model(str(root / "llama-untied"), "llama", tokenizer=False,
                                             tie_word_embeddings=False),
            "qwen2": build_tiny_model(str(root / "qwen2"), "qwen2", tokenizer=False)}


def _logits(model, ids=PROMPT):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("n", [1, 2, 12, 20, 28, 576, 896])
def test_hadamard_orders(n):
    h = hadamard(n)
    assert torch.equal(h.abs(), torch.ones(n, n, dtype=torch.float64))
    assert torch.equal(h @ h.t(), n * torch.eye(n, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["hadamard", "orthogonal"])
def test_rotation_matrices_are_orthogonal(kind):
    q = rotation_matrix(kind, 64, seed=3)
    assert torch.allclose(q @ q.t(), torch.eye(64, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q, rotation_matrix(kind, 64, seed=3))
    assert not torch.equal(q, rotation_matrix(kind, 64, seed=4))


def test_bad_rotation_inputs():
    with pytest.raises(ConvertError, match="Hadamard matrix of order 6"):
        hadamard(6)
    with pytest.raises(ConvertError, match="unknown rotation"):
        rotation_matrix("givens", 8)


@pytest.mark.parametrize("case,heads", [("llama-tied", False), ("llama-tied", True), ("llama-untied", False),
                                        ("qwen2", True)])
def test_rotation_preserves_float_logits(tiny_dirs, case, heads):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[case], dtype=torch.float64).eval()
    want = _logits(model)
    rot = model_rotation(model, "hadamard", heads=heads, seed=1)
    gammas = [float(layer.input_layernorm.weight.detach().std()) for layer in model.model.layers]
    assert max(gammas) > 0  # the fixture's norms are not all ones: folding them is exercised
    rotate_model(model, rot)
    got = _logits(model)
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings is False
    for layer in model.model.layers:
        assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    if case == "qwen2":  # q/k/v biases are untouched by an input rotation (v's only by the head rotation)
        ref = AutoModelForCausalLM.from_pretrained(tiny_dirs[case], dtype=torch.float64)
        assert torch.equal(model.model.layers[0].self_attn.q_proj.bias, ref.model.layers[0].self_attn.q_proj.bias)


def test_rotation_steps_commute_per_layer(tiny_dirs):
    """Head first, then layers in any order, then the embedding (what a streaming caller may do): same model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama-tied"], dtype=torch.float64).eval()
    want = _logits(model)
    rot = Rotation(rotation_matrix("orthogonal", model.config.hidden_size, 0))
    rotate_head(model, rot)
    for layer in reversed(model.model.layers):
        rotate_layer(layer, rot)
    rotate_embedding(model, rot)
    assert (_logits(model) - want).abs().max() < 1e-5 * want.abs().max()


def _dequantized_dir(qdir: str, canon: dict, dst: str) -> str:
    """The exported checkpoint's float tensors plus the dequantized linears, without quantization_config: the
    fake-quantized float model transformers loads."""
    sd = {}
    for f in os.listdir(qdir):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(qdir, f)))
    for name, cw in canon.items():
        for leaf in ("qweight", "qzeros", "scales", "g_idx"):
            sd.pop(f"{name}.{leaf}", None)
        sd[f"{name}.weight"] = cw.dequantize().t().contiguous()
    os.makedirs(dst)
    with open(os.path.join(qdir, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("method,extra", [("gptq", {}), ("rtn", {"rotate_heads": True})])
def test_rotated_checkpoint_loads_in_lqe_and_transformers(tiny_llama_dir, tmp_path, method, extra):
    from tools.convert.quantize import CalibOptions, quantize_checkpoint
    from tools.convert.spec import ExportSpec

    base = tiny_llama_dir
    out = str(tmp_path / "q")
    ids = torch.randint(0, 4000, (8, 32), generator=torch.Generator().manual_seed(0))
    opts = CalibOptions(num_samples=8, seq_len=32, rotate="hadamard", device="cpu", **extra)
    spec = ExportSpec(fmt="gptq", bits=8 if method == "rtn" else 4, group_size=32, sym=True)
    _, res = quantize_checkpoint(base, out, method, spec, opts, input_ids=ids)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["tie_word_embeddings"] is False and cfg["quantization_config"]["quant_method"] == "gptq"
    tensors = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(out, f)))
    assert "lm_head.weight" in tensors and not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    fq = _dequantized_dir(out, res.canon, str(tmp_path / "fq"))
    got, want = engine_logprobs(out), hf_prompt_logprobs(fq)
    assert torch.allclose(got, want, atol=2e-3), (got - want).abs().max()
    if method == "rtn":  # 8-bit: as close to the float model as 8-bit RTN without the rotation
        plain = str(tmp_path / "plain")
        quantize_checkpoint(base, plain, method, spec, CalibOptions(device="cpu"))
        ref = hf_prompt_logprobs(base)
        assert (got - ref).abs().max() < 2 * (engine_logprobs(plain) - ref).abs().max() + 0.01


def test_rotated_streaming_matches_whole_model(tiny_dirs, tmp_path):
    """Rotating layer by layer as they stream in writes the checkpoint whole-model calibration writes."""
    from tools.convert.quantize import CalibOptions, quantize_checkpoint
    from tools.convert.spec import ExportSpec

    base = tiny_dirs["llama-untied"]
    ids = torch.randint(0, 4000, (4, 32), generator=torch.Generator().manual_seed(0))
    outs = []
    for stream in (True, False):
        out = str(tmp_path / f"q{stream}")
        opts = CalibOptions(rotate="hadamard", rotate_heads=True, device="cpu", refine_passes=1)
        quantize_checkpoint(base, out, "gptq", ExportSpec(group_size=32), opts, stream=stream, input_ids=ids)
        outs.append(load_file(os.path.join(out, "model.safetensors")))
    assert outs[0].keys() == outs[1].keys()
    for k in outs[0]:
        assert torch.allclose(outs[0][k].float(), outs[1][k].float(), atol=1e-6), k
