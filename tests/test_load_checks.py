"""Issue 19 load-time checks: NaN / inf / non-positive scales and non-finite float weights stop the load with a
message naming the tensor and group (or load with a warning under allow_nonfinite_weights=True); symmetric GPTQ
loads without qzeros; config values that are not numbers name the field and the file."""
from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import build_tiny_model
from lqe import LLM, SamplingParams
from lqe.quant_layers import reference as ref
from lqe.quant_layers.checks import BadWeightsError, check_tensor

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QCFG = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False, "checkpoint_format": "gptq"}


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory):
    base = build_tiny_model(str(tmp_path_factory.mktemp("lc-base")), "llama")
    out = str(tmp_path_factory.mktemp("lc-gptq"))
    sd = load_file(os.path.join(base, "model.safetensors"))
    q = {}
    for name, t in sd.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in LINEARS:
            enc = ref.encode_gptq(ref.rtn_quantize(t, 4, 32, True), "gptq")
            q.update({f"{module}.{k}": v.contiguous() for k, v in enc.items()})
        else:
            q[name] = t
    for f in os.listdir(base):
        if f != "model.safetensors":
            shutil.copy(os.path.join(base, f), out)
    save_file(q, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    _set_qcfg(out, QCFG)
    return out


def _set_qcfg(d: str, qcfg: dict) -> None:
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qcfg
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)


def _variant(src: str, dst, edit) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    sd = load_file(os.path.join(dst, "model.safetensors"))
    edit(sd)
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def _llm(d: str, **kw) -> LLM:
    return LLM(d, device="cpu", num_kv_blocks=16, max_model_len=64, **kw)


SCALES = "model.layers.1.mlp.down_proj.scales"


@pytest.mark.parametrize("value,what", [(float("nan"), "non-finite or non-positive"), (float("inf"), "nan"),
                                        (0.0, "= 0.0"), (-1.0, "= -1.0")])
def test_bad_scale_names_tensor_and_group(gptq_dir, tmp_path, value, what):
    def edit(sd):
        sd[SCALES][2, 5] = value
    d = _variant(gptq_dir, tmp_path / "bad", edit)
    with pytest.raises(BadWeightsError) as e:
        _llm(d)
    msg = str(e.value)
    assert "model.layers.1.mlp.down_proj.scales" in msg and "group 2, output column 5" in msg
    assert "allow_nonfinite_weights" in msg and (what in msg or what == "nan")


def test_all_zero_scales_refused(gptq_dir, tmp_path):
    def edit(sd):
        sd[SCALES].zero_()
    d = _variant(gptq_dir, tmp_path / "zero", edit)
    with pytest.raises(BadWeightsError, match=r"holds \d+ non-finite or non-positive scales"):
        _llm(d)


def test_nan_embedding_refused_and_opt_out_warns_then_runtime_guard(gptq_dir, tmp_path, caplog):
    def edit(sd):
        sd["model.embed_tokens.weight"][3, 1] = float("nan")
    d = _variant(gptq_dir, tmp_path / "emb", edit)
    with pytest.raises(BadWeightsError, match=r"model\.embed_tokens\.weight .*index \(3, 1\) = nan"):
        _llm(d)
    with caplog.at_level(logging.WARNING, logger="lqe"):
        llm = _llm(d, allow_nonfinite_weights=True)
    assert any("embed_tokens" in r.getMessage() and "loaded anyway" in r.getMessage() for r in caplog.records)
    # the tied lm_head makes token 3's logit NaN in every row: a clear error, not a stream of token 0
    with pytest.raises(RuntimeError, match="non-finite logits"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)


def test_sym_gptq_loads_with_or_without_qzeros(gptq_dir, tmp_path):
    def drop(sd):
        for k in [k for k in sd if k.endswith(".qzeros")]:
            del sd[k]
    d = _variant(gptq_dir, tmp_path / "noz", drop)
    p = SamplingParams(temperature=0, max_tokens=6)
    a = _llm(gptq_dir).generate([[1, 2, 3, 4]], p, use_tqdm=False)[0].outputs[0].token_ids
    b = _llm(d).generate([[1, 2, 3, 4]], p, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


@pytest.mark.parametrize("key,value", [("bits", "four"), ("group_size", "big"), ("bits", None)])
def test_non_numeric_config_value_names_field_and_file(gptq_dir, tmp_path, key, value):
    d = str(tmp_path / "cfg")
    shutil.copytree(gptq_dir, d)
    _set_qcfg(d, {**QCFG, key: value})
    with pytest.raises(ValueError) as e:
        _llm(d)
    msg = str(e.value)
    assert f"'{key}'" in msg and "config.json" in msg and "invalid literal" not in msg


def test_check_tensor_unit():
    assert check_tensor("a.weight", "weight", torch.ones(3)) is None
    assert "index 1 = inf" in check_tensor("a.weight", "weight", torch.tensor([1.0, float("inf"), 2.0]))
    assert check_tensor("a.scales", "scales", torch.full((2, 3), 0.5)) is None
    assert "group 1, output column 0" in check_tensor("a.scales", "scales", torch.tensor([[1.0], [0.0]]))
    assert "output row 0, group 1" in check_tensor("a.weight_scale", "weight_scale", torch.tensor([[1.0, -2.0]]))
    assert "zero points in [-300" in check_tensor("a.input_zero_point", "input_zero_point",
                                                  torch.tensor([-300], dtype=torch.int32))
    assert check_tensor("a.qweight", "qweight", torch.tensor([-5], dtype=torch.int32)) is None
    packed = torch.tensor([-2052749943], dtype=torch.int32)  # eight 4-bit fields: any word is in range
    assert check_tensor("a.weight_zero_point", "weight_zero_point", packed, packed=True) is None
    fp8 = torch.tensor([1.0, float("nan"), 2.0]).to(torch.float8_e4m3fn)
    assert "index 1 = nan" in check_tensor("a.weight", "weight", fp8)
    assert check_tensor("a.weight", "weight", torch.ones(4).to(torch.float8_e4m3fn)) is None
