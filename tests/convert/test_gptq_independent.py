"""Exported GPTQ tensors decoded with FORMATS.md §1.3-§1.5 written here with plain int ops (not the code under test)."""
import pytest
import torch

from cutil import fake_quant_model
from tools.convert import export_checkpoint
from tools.convert.writer import load_state_dict


def decode_by_hand(sd, name, bits, sym, v1):
    qw, qz, sc, gi = (sd[f"{name}.{x}"] for x in ("qweight", "qzeros", "scales", "g_idx"))
    pf, mask = 32 // bits, (1 << bits) - 1
    u = qw.to(torch.int64) & 0xFFFFFFFF
    q = torch.stack([(u >> (bits * j)) & mask for j in range(pf)], 1).reshape(-1, qw.shape[1])  # row r*pf + j
    uz = qz.to(torch.int64) & 0xFFFFFFFF
    z = torch.stack([(uz >> (bits * j)) & mask for j in range(pf)], 2).reshape(qz.shape[0], -1)  # col c*pf + j
    if sym:
        assert bool((z == (1 << (bits - 1)) - (1 if v1 else 0)).all())  # the conventional constant
        z = torch.full_like(z, 1 << (bits - 1))
    elif v1:
        z = z + 1
    g = gi.long()
    return ((q[: g.numel()] - z[g]).double() * sc.double()[g]).t()


@pytest.mark.parametrize("fmt,bits,sym", [("gptq", 4, True), ("gptq", 4, False), ("gptq_v2", 4, False), ("gptq", 8, False), ("gptq_v2", 8, True)])
def test_exported_gptq_decodes_by_hand(fmt, bits, sym, tiny_llama_dir, tmp_path):
    fq, canon, _ = fake_quant_model(tiny_llama_dir, str(tmp_path / "fq"), bits, 32, sym, v1=fmt == "gptq")
    out = str(tmp_path / "out")
    export_checkpoint(fq, out, fmt, bits, 32, sym)
    sd, ref_sd = load_state_dict(out), load_state_dict(fq)
    for name in canon:
        assert sd[f"{name}.qweight"].dtype == torch.int32 and sd[f"{name}.scales"].dtype == torch.float16
        torch.testing.assert_close(decode_by_hand(sd, name, bits, sym, fmt == "gptq"), ref_sd[name + ".weight"].double(), rtol=0, atol=0)
