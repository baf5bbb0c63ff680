"""Helpers for the converter tests: fake-quantized tiny models with known parameters, engine vs HF logprobs."""
from __future__ import annotations

import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from lqe.quant_layers import reference as ref

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = [1, 520, 3100, 28, 9874, 41, 1023, 77, 4500, 12, 650]


def linear_keys(sd):
    return [k for k in sd if k.endswith(".weight") and k.rpartition(".")[0].rpartition(".")[2] in LINEARS]


def known_params(w: torch.Tensor, bits: int, gs: int, sym: bool, act: bool, v1: bool = False):
    """RTN parameters with fp16-representable scales: (canonical, fake-quantized torch weight, g_idx or None)."""
    k = w.shape[1]  # layers reading the same input share one act-order permutation
    g_idx = (torch.randperm(k, generator=torch.Generator().manual_seed(k)) // (k if gs == -1 else gs)).to(torch.int32) if act else None
    cw = ref.rtn_quantize(w, bits, gs, sym, g_idx=g_idx)
    cw.scales = cw.scales.half().float()
    if cw.zeros is not None and v1:
        cw.zeros.clamp_(min=1)
    return cw, cw.dequantize().t().contiguous(), g_idx


def copy_dir(src: str, dst: str, sd: dict[str, torch.Tensor]) -> str:
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f != "model.safetensors":
            shutil.copy(os.path.join(src, f), dst)
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def fake_quant_model(base: str, dst: str, bits: int, gs: int, sym: bool, act: bool = False, v1: bool = False):
    """Write a fake-quantized copy of ``base``; returns (dir, {layer: canonical}, {layer: g_idx})."""
    sd = load_file(os.path.join(base, "model.safetensors"))
    canon, gidx = {}, {}
    for key in linear_keys(sd):
        cw, w, g = known_params(sd[key], bits, gs, sym, act, v1)
        sd[key] = w
        canon[key[: -len(".weight")]] = cw
        if g is not None:
            gidx[key[: -len(".weight")]] = g
    return copy_dir(base, dst, sd), canon, gidx


def engine_logprobs(model_dir: str) -> torch.Tensor:
    from lqe import LLM, SamplingParams

    llm = LLM(model_dir, kv_cache_memory_bytes=16 << 20, max_model_len=256)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[j][PROMPT[j]].logprob for j in range(1, len(PROMPT))])


def hf_prompt_logprobs(model_dir: str, act_int8: bool = False) -> torch.Tensor:
    """HF transformers on the float model (inputs of every linear fake-quantized per token when ``act_int8``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if act_int8:
        def fq(module, args):
            q, s, _ = ref.per_token_quant_int8(args[0].reshape(-1, args[0].shape[-1]))
            return ((q.float() * s).reshape(args[0].shape),)

        for name, m in model.named_modules():
            if name.rpartition(".")[2] in LINEARS:
                m.register_forward_pre_hook(fq)
    with torch.no_grad():
        lp = model(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)
    return torch.tensor([lp[j - 1, PROMPT[j]].item() for j in range(1, len(PROMPT))])
