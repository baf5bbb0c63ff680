"""Each bad input gives its own error, and a failed export leaves nothing behind."""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from cutil import copy_dir, fake_quant_model
from tools.convert import ConvertError, export_checkpoint
from tools.convert.cli import main
from tools.convert.verify import verify_checkpoint


@pytest.fixture(scope="module")
def fq(tiny_llama_dir, tmp_path_factory):
    return fake_quant_model(tiny_llama_dir, str(tmp_path_factory.mktemp("fq") / "m"), 4, 32, False)[0]


def _params(fq, drop=None, transpose=False):
    sd = load_file(os.path.join(fq, "model.safetensors"))
    p = {}
    for k in [k for k in sd if k.endswith("_proj.weight")]:
        n = k[: -len(".weight")]
        if n == drop:
            continue
        gs = 32
        g = -(-sd[k].shape[1] // gs)
        s = torch.full((g, sd[k].shape[0]), 0.1)
        p[n + ".scales"] = s.t().contiguous() if transpose else s
        p[n + ".zeros"] = torch.full((g, sd[k].shape[0]), 8, dtype=torch.int32)
    return p


def _run(fq, tmp_path, *extra):
    return main(["export", "--model", fq, "--out", str(tmp_path / "out"), "--group-size", "32", *extra])


def test_off_grid_layer_named(tiny_llama_dir, tmp_path, capsys):
    assert _run(tiny_llama_dir, tmp_path) == 2
    err = capsys.readouterr().err
    assert "not on a 4-bit symmetric group-32 quantization grid" in err and "model.layers.0.self_attn.q_proj (largest deviation" in err
    assert not os.path.exists(tmp_path / "out") and not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_missing_layer_in_params(fq, tmp_path):
    save_file(_params(fq, drop="model.layers.1.mlp.up_proj"), str(tmp_path / "p.safetensors"))
    with pytest.raises(ConvertError, match="no entries for 1 layer.*model.layers.1.mlp.up_proj"):
        export_checkpoint(fq, str(tmp_path / "out"), "gptq", 4, 32, False, params=str(tmp_path / "p.safetensors"))


def test_transposed_scales(fq, tmp_path):
    with pytest.raises(ConvertError, match=r"scales: expected shape .*looks transposed"):
        export_checkpoint(fq, str(tmp_path / "out"), "gptq", 4, 32, False, params=_nested(_params(fq, transpose=True)))


def _nested(flat):
    out = {}
    for k, v in flat.items():
        p, _, leaf = k.rpartition(".")
        out.setdefault(p, {})[leaf] = v
    return out


@pytest.mark.parametrize("args,msg", [
    (["--format", "awq", "--bits", "8"], "stores bits"),
    (["--format", "gptq", "--bits", "5"], "stores bits"),
    (["--format", "awq", "--group-size", "48"], "does not divide K"),
    (["--format", "w4a16-ct", "--group-size", "48"], "cannot store a short last group"),
    (["--format", "w8a8", "--asym"], "must be symmetric"),
    (["--format", "awq", "--desc-act"], "act-order"),
])
def test_format_limits(fq, tmp_path, capsys, args, msg):
    assert main(["export", "--model", fq, "--out", str(tmp_path / "out"), *args]) == 2
    assert msg in capsys.readouterr().err


def test_out_dir_not_empty_and_overwrite(fq, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ConvertError, match="not empty; pass --overwrite"):
        export_checkpoint(fq, str(out), "gptq_v2", 4, 32, False)
    export_checkpoint(fq, str(out), "gptq_v2", 4, 32, False, overwrite=True, max_shard_size=200_000)
    files = os.listdir(out)
    assert "keep.txt" not in files and "model.safetensors.index.json" in files
    assert sum(f.startswith("model-") for f in files) > 1 and "tokenizer.json" in files
    assert verify_checkpoint(str(out), against=fq).ok


def test_v1_zero_point_zero(tiny_llama_dir, tmp_path):
    sd = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    key = "model.layers.0.self_attn.o_proj.weight"
    w = torch.arange(15, dtype=torch.float32).repeat(sd[key].shape[0], 5)[:, : sd[key].shape[1]] * 0.125  # codes 0..15, zero 0
    w[:, 0] = 15 * 0.125
    for k in [k for k in sd if k.endswith("_proj.weight")]:
        sd[k] = torch.full_like(sd[k], 0.25) if k != key else w
    src = copy_dir(tiny_llama_dir, str(tmp_path / "src"), sd)
    with pytest.raises(ConvertError, match="model.layers.0.self_attn.o_proj.*gptq_v2.*--clamp-zero"):
        export_checkpoint(src, str(tmp_path / "o1"), "gptq", 4, 32, False)
    with pytest.warns(UserWarning, match="clamped to 1 in model.layers.0.self_attn.o_proj"):
        export_checkpoint(src, str(tmp_path / "o2"), "gptq", 4, 32, False, clamp_zero=True)
    export_checkpoint(src, str(tmp_path / "o3"), "gptq_v2", 4, 32, False)
    assert verify_checkpoint(str(tmp_path / "o3"), against=src).ok


def test_verify_flags_corruptions(fq, tmp_path):
    out = str(tmp_path / "out")
    sym = fake_quant_model(fq, str(tmp_path / "fqs"), 4, 32, True)[0]
    export_checkpoint(sym, out, "gptq", 4, 32, True)
    st = os.path.join(out, "model.safetensors")
    sd = load_file(st)
    name = "model.layers.0.self_attn.q_proj"
    sd[name + ".qzeros"] = torch.full_like(sd[name + ".qzeros"], -2004318072)  # 0x88888888: v2 zeros
    sd["model.layers.0.mlp.up_proj.qzeros"][0, 0] = 0x12345678
    save_file(sd, st)
    res = verify_checkpoint(out)
    issues = {c.name: " ".join(c.issues) for c in res.layers}
    assert "v2 zeros (8) under a v1" in issues[name]
    assert "not the constant 7" in issues["model.layers.0.mlp.up_proj"]
    assert main(["verify", out]) == 1
    _edit_config(out, group_size=16)
    os.remove(os.path.join(out, "quantize_config.json"))
    assert all("cannot decode" in " ".join(c.issues) for c in verify_checkpoint(out).layers)


def test_verify_flags_v1_zero_field_and_gemv(fq, tmp_path):
    out = str(tmp_path / "out")
    export_checkpoint(fq, out, "gptq", 4, 32, False)
    st = os.path.join(out, "model.safetensors")
    sd = load_file(st)
    sd["model.layers.1.mlp.down_proj.qzeros"][0, 0] = -14  # 0xFFFFFFF2: AutoGPTQ's zero=0 corruption
    save_file(sd, st)
    assert "v1 zero fields = 15" in " ".join(c for l in verify_checkpoint(out).layers for c in l.issues)
    awq = str(tmp_path / "awq")
    export_checkpoint(fq, awq, "awq", 4, 32, False)
    _edit_config(awq, version="gemv")
    assert any("GEMM layout" in p for p in verify_checkpoint(awq).problems)


def _edit_config(d, **kv):
    import json

    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"].update(kv)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("args,msg", [
    (["--method", "awq", "--format", "awq", "--awq-tokens", "0"], "--awq-tokens 0"),
    (["--method", "gptq", "--drift-alpha", "1.5"], "must be in [0, 1]"),
    (["--method", "rtn", "--drift-alpha", "0.25"], "applies to --method gptq"),
])
def test_quantize_option_limits(tiny_llama_dir, tmp_path, capsys, args, msg):
    assert main(["quantize", "--model", tiny_llama_dir, "--out", str(tmp_path / "out"), *args]) == 2
    assert msg in capsys.readouterr().err


def test_output_has_the_usual_permissions(fq, tmp_path):
    """The checkpoint directory and its files get the permissions the umask gives any new file (the staging
    directory is made by mkdtemp, 0700, and renamed into place: without a chmod, other users could not read it)."""
    old = os.umask(0o022)
    try:
        out = tmp_path / "out"
        export_checkpoint(fq, str(out), "gptq_v2", 4, 32, False)
    finally:
        os.umask(old)
    assert os.stat(out).st_mode & 0o777 == 0o755
    for f in os.listdir(out):
        assert os.stat(out / f).st_mode & 0o777 == 0o644, f
