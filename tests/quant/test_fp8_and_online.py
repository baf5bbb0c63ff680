"""vLLM-style quantization names and formats: ``quant_method: fp8`` checkpoints (per-tensor and 128x128 block
scales, dynamic and static activations), quantize-on-load (``quantization="fp8"`` / ``"int8"`` on a float
model), and the vLLM kernel aliases ``gptq_marlin`` / ``awq_marlin`` / ``marlin``."""
import logging

import pytest
import torch

from helpers import build_tiny_model, hf_logprobs
from lqe import LLM, SamplingParams
from lqe.quant_layers import reference as ref
from lqe.quant_layers import resolve_quant_config
from lqe.quant_layers.fp8_checkpoint import Fp8Config, OnlineQuantConfig
from test_quant_models import FORMATS, PROMPT, _hf_w8a8_logprobs, _write

FP8_MAX = 448.0


def _fp8_tensor(w):
    s = w.abs().amax() / FP8_MAX
    q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": s.reshape(())}, q.float() * s


def _fp8_static(w):
    t, deq = _fp8_tensor(w)
    t["input_scale"] = torch.tensor(0.02)
    return t, deq


def _fp8_block(w, bh=128, bw=128):
    n, k = w.shape
    nb, kb = -(-n // bh), -(-k // bw)
    pad = torch.zeros(nb * bh, kb * bw)
    pad[:n, :k] = w
    blocks = pad.reshape(nb, bh, kb, bw)
    s = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(nb * bh, kb * bw)[:n, :k]
    return {"weight": q.contiguous(), "weight_scale_inv": s}, ref.dequant_fp8(q, s, (bh, bw))


def _logprob_error(llm, expected):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
    got = torch.tensor([out.prompt_logprobs[j][PROMPT[j]].logprob for j in range(1, len(PROMPT))])
    want = torch.tensor([expected[j - 1, PROMPT[j]].item() for j in range(1, len(PROMPT))])
    return (got - want).abs().max().item()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    # hidden 64, intermediate 160: 128x128 blocks would not fit the fused shards, so this model uses 32x32 blocks
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-fp8-base")), "llama")


@pytest.mark.parametrize("name,encode,qcfg", [
    ("tensor-dynamic", _fp8_tensor, {"quant_method": "fp8", "activation_scheme": "dynamic"}),
    ("tensor-static", _fp8_static, {"quant_method": "fp8", "activation_scheme": "static"}),
    ("block-32", lambda w: _fp8_block(w, 32, 32),
     {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}),
])
def test_fp8_checkpoint_matches_hf_on_dequantized_weights(name, encode, qcfg, base_dir, tmp_path):
    qdir, ddir = str(tmp_path / "q"), str(tmp_path / "deq")
    _write(base_dir, qdir, ddir, encode, qcfg)
    llm = LLM(qdir, kv_cache_memory_bytes=16 << 20, max_model_len=256)
    assert "fp8 e4m3" in llm.llm_engine.quant_description()
    assert _logprob_error(llm, hf_logprobs(ddir, PROMPT)) < 1e-3, name
    # the same checkpoint named by the user
    assert isinstance(llm.llm_engine.quant_config, Fp8Config)


def test_fp8_block_128_and_ignored_layers(tmp_path):
    base = build_tiny_model(str(tmp_path / "b"), "llama", hidden_size=256, intermediate_size=384,
                            num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, tokenizer=False)
    qdir, ddir = str(tmp_path / "q"), str(tmp_path / "deq")
    qcfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "ignored_layers": ["model.layers.0.mlp.down_proj"]}

    def enc(w):
        if tuple(w.shape) == (256, 384):  # down_proj stays float: ignored
            return {"weight": w}, w
        return _fp8_block(w)
    _write(base, qdir, ddir, enc, qcfg)
    llm = LLM(qdir, kv_cache_memory_bytes=16 << 20, max_model_len=256, quantization="fp8")
    desc = llm.llm_engine.quant_description()
    assert "block 128x128" in desc and "unquantized" in desc
    assert _logprob_error(llm, hf_logprobs(ddir, PROMPT)) < 1e-3


def test_fp8_config_errors():
    with pytest.raises(ValueError, match="activation_scheme"):
        Fp8Config.from_hf_config({"quant_method": "fp8", "activation_scheme": "per_token"})
    with pytest.raises(ValueError, match="weight_block_size"):
        Fp8Config.from_hf_config({"quant_method": "fp8", "weight_block_size": [128]})


def _online_expected(base_dir, tmp_path, kind):
    """HF on the weights quantized the way the loader does (and, for int8, per-token fake-quantized inputs)."""
    encode = (lambda w: (lambda q, s: ({"weight": q}, q.float() * s))(*ref.quantize_fp8(w))) if kind == "fp8" \
        else FORMATS["ct-w8a8"][0]
    ddir = str(tmp_path / f"deq-{kind}")
    _write(base_dir, str(tmp_path / f"unused-{kind}"), ddir, encode, {})
    return _hf_w8a8_logprobs(ddir, PROMPT) if kind == "int8" else hf_logprobs(ddir, PROMPT)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_quantize_on_load(kind, base_dir, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="lqe"):
        llm = LLM(base_dir, quantization=kind, kv_cache_memory_bytes=16 << 20, max_model_len=256)
    assert any("quantizing every linear layer" in r.getMessage() for r in caplog.records)
    assert isinstance(llm.llm_engine.quant_config, OnlineQuantConfig)
    desc = llm.llm_engine.quant_description()
    assert ("fp8 e4m3 channel" if kind == "fp8" else "w8a8 int8 channel weights, dynamic per-token") in desc
    err = _logprob_error(llm, _online_expected(base_dir, tmp_path, kind))
    assert err < 2e-3, (kind, err)
    # and it is really quantized: far from the float model on the same prompt
    assert _logprob_error(llm, hf_logprobs(base_dir, PROMPT)) > 1e-4


@pytest.mark.parametrize("alias,method", [("gptq_marlin", "gptq"), ("marlin", "gptq"), ("awq_marlin", "awq")])
def test_vllm_kernel_aliases(alias, method, tmp_path, caplog):
    cfg = {"gptq": FORMATS["gptq-v1-sym"][1], "awq": FORMATS["awq"][1]}[method]
    with caplog.at_level(logging.INFO, logger="lqe"):
        c = resolve_quant_config(str(tmp_path), {"quantization_config": cfg}, alias)
    assert c.name == method
    assert any(alias in r.getMessage() and "W4A16" in r.getMessage() for r in caplog.records)
    other = {"gptq": FORMATS["awq"][1], "awq": FORMATS["gptq-v1-sym"][1]}[method]
    with pytest.raises(ValueError, match="was requested, but the checkpoint is quantized with"):
        resolve_quant_config(str(tmp_path), {"quantization_config": other}, alias)


def test_online_names_still_check_quantized_checkpoints(tmp_path):
    with pytest.raises(ValueError, match="quantized with 'gptq'"):
        resolve_quant_config(str(tmp_path), {"quantization_config": FORMATS["gptq-v1-sym"][1]}, "int8")
