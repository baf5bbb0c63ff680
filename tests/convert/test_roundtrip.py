"""Fake-quantize a tiny model with known parameters -> export each format -> verify (0 error) -> the engine's
prompt logprobs equal HF transformers on the fake-quantized float model."""
import os

import pytest
import torch
from safetensors.torch import save_file

from cutil import engine_logprobs, fake_quant_model, hf_prompt_logprobs
from helpers import build_tiny_model
from tools.convert import export_checkpoint
from tools.convert.verify import verify_checkpoint

# name: (format, bits, group size, sym, act-order, run the engine)
CASES = {
    "gptq-v1-sym-g32": ("gptq", 4, 32, True, False, True),
    "gptq-v1-asym-g64": ("gptq", 4, 64, False, False, False),
    "gptq-v2-asym-actorder-g32": ("gptq_v2", 4, 32, False, True, True),
    "gptq-v1-8bit-sym-actorder": ("gptq", 8, 32, True, True, False),
    "gptq-v2-8bit-asym-channel": ("gptq_v2", 8, -1, False, False, False),
    "awq-asym-g32": ("awq", 4, 32, False, False, True),
    "awq-sym-g32": ("awq", 4, 32, True, False, False),
    "ct-w4a16-asym-g32": ("w4a16-ct", 4, 32, False, False, True),
    "ct-w4a16-sym-actorder": ("w4a16-ct", 4, 32, True, True, False),
    "ct-w8a8": ("w8a8", 8, -1, True, False, True),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("conv-base")), "llama")


@pytest.mark.parametrize("case", list(CASES))
def test_fake_quant_round_trip(case, base, tmp_path):
    fmt, bits, gs, sym, act, engine = CASES[case]
    fq, canon, gidx = fake_quant_model(base, str(tmp_path / "fq"), bits, gs, sym, act, v1=fmt == "gptq")
    params = None
    if gidx:  # act-order groups cannot be seen in the weights: give only g_idx, scales are recovered
        params = str(tmp_path / "gidx.safetensors")
        save_file({f"{k}.g_idx": v for k, v in gidx.items()}, params)
    out = str(tmp_path / "out")
    export_checkpoint(fq, out, fmt, bits, gs, sym, act, params=params)
    res = verify_checkpoint(out, against=fq)
    assert res.ok, [c.issues for c in res.layers]
    assert len(res.layers) == len(canon)
    assert all(c.max_err == 0.0 for c in res.layers), [(c.name, c.max_err) for c in res.layers]
    if engine:
        got = engine_logprobs(out)
        want = hf_prompt_logprobs(fq, act_int8=fmt == "w8a8")
        assert (got - want).abs().max().item() < 1e-3, case


def test_params_file_export(base, tmp_path):
    """--params: float weights (off grid) + scales/zeros/perm -> codes = clamp(round(w/s) + z)."""
    from safetensors.torch import load_file

    sd = load_file(os.path.join(base, "model.safetensors"))
    params, expect = {}, {}
    for key in [k for k in sd if k.endswith("_proj.weight")]:
        name, w = key[: -len(".weight")], sd[key]
        k = w.shape[1]
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(k))
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[perm] = torch.arange(k) // 16
        wt = w.t().double()
        gmin = torch.stack([wt[g_idx == g].amin(0) for g in range(k // 16)]).clamp(max=0)
        gmax = torch.stack([wt[g_idx == g].amax(0) for g in range(k // 16)]).clamp(min=0)
        s = ((gmax - gmin) / 15).half().float()
        z = torch.round(-gmin / s.double()).clamp(1, 15)
        params.update({f"{name}.scales": s, f"{name}.zeros": z.to(torch.int32), f"{name}.perm": perm.to(torch.int32)})
        q = torch.clamp(torch.round(wt / s.double()[g_idx]) + z[g_idx], 0, 15)
        expect[name] = ((q - z[g_idx]) * s.double()[g_idx]).t()
    pfile = str(tmp_path / "params.safetensors")
    save_file(params, pfile)
    out = str(tmp_path / "out")
    from tools.convert.cli import main

    assert main(["export", "--model", base, "--out", out, "--format", "gptq", "--group-size", "16", "--asym",
                 "--desc-act", "--params", pfile]) == 0
    res = verify_checkpoint(out)
    assert res.ok
    from tools.convert.writer import load_state_dict
    from lqe.quant_layers import reference as ref

    osd = load_state_dict(out)
    for name, w in expect.items():
        cw = ref.decode_gptq(osd[f"{name}.qweight"], osd[f"{name}.qzeros"], osd[f"{name}.scales"], osd[f"{name}.g_idx"], 4, 16, False)
        assert cw.g_idx is not None
        torch.testing.assert_close(cw.dequantize().t().double(), w, rtol=0, atol=1e-6)
