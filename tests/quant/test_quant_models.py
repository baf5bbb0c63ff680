"""Model-level: a tiny random Llama written in each quantized format, loaded by the engine, compared with
HF transformers running the same model with the dequantized weights."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import build_tiny_model, hf_logprobs
from lqe import LLM, SamplingParams
from lqe.quant_layers import reference as ref

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = [1, 520, 3100, 28, 9874, 41, 1023, 77, 4500, 12, 650]


def _gptq(w, bits, gs, sym, fmt, act, seed=0):
    k = w.shape[1]  # layers reading the same input share one act-order permutation, as real GPTQ output does
    g_idx = (torch.randperm(k, generator=torch.Generator().manual_seed(seed)) // gs).to(torch.int32) if act else None
    cw = ref.rtn_quantize(w, bits, gs, sym, g_idx=g_idx)
    if cw.zeros is not None and fmt == "gptq":
        cw.zeros.clamp_(min=1)
    t = ref.encode_gptq(cw, fmt)
    return t, ref.decode_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, gs, sym, fmt).dequantize().t()


def _awq(w, gs):
    t = ref.encode_awq(ref.rtn_quantize(w, 4, gs, False))
    return t, ref.decode_awq(t["qweight"], t["qzeros"], t["scales"], gs).dequantize().t()


def _w8a8(w):
    q, s = ref.quantize_int8_per_channel(w)
    return {"weight": q, "weight_scale": s}, q.float() * s


def _ct_w4a16(w, gs):
    t = ref.encode_ct_packed(ref.rtn_quantize(w, 4, gs, False))
    cw = ref.decode_ct_packed(t["weight_packed"], t["weight_scale"], t["weight_shape"], 4, gs, t["weight_zero_point"])
    return t, cw.dequantize().t()


def _ct_cfg(weights, acts, fmt):
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


FORMATS = {
    "gptq-v1-sym": (lambda w: _gptq(w, 4, 32, True, "gptq", False),
                    {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False, "checkpoint_format": "gptq"}),
    "gptq-v2-asym-actorder": (lambda w: _gptq(w, 4, 32, False, "gptq_v2", True, seed=w.shape[1]),
                              {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True, "checkpoint_format": "gptq_v2"}),
    "gptq-8bit-v1-asym": (lambda w: _gptq(w, 8, -1, False, "gptq", False),
                          {"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": False, "desc_act": False}),
    "awq": (lambda w: _awq(w, 32), {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "GEMM"}),
    "ct-w4a16-asym": (lambda w: _ct_w4a16(w, 32), _ct_cfg({"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                                                           "group_size": 32}, None, "pack-quantized")),
    "ct-w8a8": (_w8a8, _ct_cfg({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                               {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}, "int-quantized")),
}


def _hf_w8a8_logprobs(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """HF with dequantized weights and every quantized linear's input fake-quantized per token (int8, sym)."""
    from transformers import AutoModelForCausalLM

    def fake_quant(module, args):
        q, s, _ = ref.per_token_quant_int8(args[0].reshape(-1, args[0].shape[-1]))
        return ((q.float() * s).reshape(args[0].shape),)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for name, m in model.named_modules():
        if name.rpartition(".")[2] in LINEARS:
            m.register_forward_pre_hook(fake_quant)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-base")), "llama")


def _write(base: str, out_q: str, out_deq: str, encode, qcfg) -> None:
    torch.manual_seed(0)
    sd = load_file(os.path.join(base, "model.safetensors"))
    q_sd, deq_sd = {}, {}
    for name, t in sd.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in LINEARS:
            tensors, w = encode(t)
            q_sd.update({f"{module}.{k}": v.contiguous() for k, v in tensors.items()})
            deq_sd[name] = w.to(t.dtype).contiguous()
        else:
            q_sd[name] = deq_sd[name] = t
    for d, state in ((out_q, q_sd), (out_deq, deq_sd)):
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(base):
            if f != "model.safetensors" and os.path.isfile(os.path.join(base, f)):
                with open(os.path.join(base, f), "rb") as src, open(os.path.join(d, f), "wb") as dst:
                    dst.write(src.read())
        save_file(state, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_q, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qcfg
    with open(os.path.join(out_q, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_model_matches_hf_on_dequantized_weights(fmt, base_dir, tmp_path):
    encode, qcfg = FORMATS[fmt]
    qdir, ddir = str(tmp_path / "q"), str(tmp_path / "deq")
    _write(base_dir, qdir, ddir, encode, qcfg)
    llm = LLM(qdir, kv_cache_memory_bytes=16 << 20, max_model_len=256)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
    expected = _hf_w8a8_logprobs(ddir, PROMPT) if fmt == "ct-w8a8" else hf_logprobs(ddir, PROMPT)
    got = torch.tensor([out.prompt_logprobs[j][PROMPT[j]].logprob for j in range(1, len(PROMPT))])
    want = torch.tensor([expected[j - 1, PROMPT[j]].item() for j in range(1, len(PROMPT))])
    assert (got - want).abs().max().item() < 1e-3, fmt
