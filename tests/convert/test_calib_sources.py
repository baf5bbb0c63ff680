"""tools.convert in a fresh clone: the default calibration source (the shared file, else the model itself),
--calib FILE in .txt / .jsonl / .parquet, --calib self, model names resolved like LLM resolves them, and argument
errors before any model is read."""
import gzip
import importlib.util
import json
import os
import stat

import pytest
import torch

from tools.convert.calib_data import calibration_ids, default_calib_path, read_calib_text
from tools.convert.cli import build_parser, main
from tools.convert.spec import ConvertError

DOCS = ["The quick brown fox jumps over the lazy dog near the river bank.",
        "Paris is the capital of France, and Berlin is the capital of Germany."] * 30


def test_default_is_the_shared_file_else_self(tiny_llama_dir, monkeypatch, tmp_path, capsys):
    """No --calib: the shared WikiText-2 file when it exists, else text sampled from the model (a fresh clone)."""
    from tools.convert import calib_data

    shared = tmp_path / "valid.tokens"
    shared.write_text("\n\n".join(DOCS))
    monkeypatch.setattr(calib_data, "SHARED_CALIB", str(shared))
    assert default_calib_path() == str(shared)
    assert torch.equal(calibration_ids(tiny_llama_dir, None, 3, 32, seed=2),
                       calibration_ids(tiny_llama_dir, str(shared), 3, 32, seed=2))
    monkeypatch.setattr(calib_data, "SHARED_CALIB", str(tmp_path / "absent.tokens"))
    assert default_calib_path() == "self"
    ids = calibration_ids(tiny_llama_dir, None, 2, 16, seed=0)
    assert ids.shape == (2, 16) and "--calib self" in capsys.readouterr().out
    assert torch.equal(ids, calibration_ids(tiny_llama_dir, "self", 2, 16, seed=0))


def test_txt_jsonl_and_gz_give_the_same_windows(tiny_llama_dir, tmp_path):
    text = "\n\n".join(DOCS)
    (tmp_path / "c.txt").write_text(text)
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS)) + "\n")
    with gzip.open(tmp_path / "c.txt.gz", "wt") as f:
        f.write(text)
    assert read_calib_text(str(tmp_path / "c.jsonl")) == text
    ref = calibration_ids(tiny_llama_dir, str(tmp_path / "c.txt"), 3, 32, seed=1)
    for name in ("c.jsonl", "c.txt.gz"):
        assert torch.equal(calibration_ids(tiny_llama_dir, str(tmp_path / name), 3, 32, seed=1), ref), name


def test_bad_jsonl_names_the_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ConvertError, match=r"bad.jsonl:2: .*'text' field"):
        read_calib_text(str(tmp_path / "bad.jsonl"))


def test_parquet(tiny_llama_dir, tmp_path, monkeypatch):
    path = tmp_path / "c.parquet"
    if importlib.util.find_spec("pyarrow") is not None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": DOCS}), str(path))
        assert read_calib_text(str(path)) == "\n\n".join(DOCS)
        assert calibration_ids(tiny_llama_dir, str(path), 2, 16).shape == (2, 16)
    path.write_bytes(b"PAR1")
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *a, **k):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(ConvertError, match="needs pyarrow.*pip install pyarrow"):
        read_calib_text(str(path))


def test_calib_self_samples_the_model(tiny_llama_dir):
    a = calibration_ids(tiny_llama_dir, "self", 3, 24, seed=0)
    assert a.shape == (3, 24) and bool((a[:, 0] == 1).all())  # BOS first
    assert len({tuple(r) for r in a.tolist()}) == 3  # seeds differ per sample
    assert torch.equal(a, calibration_ids(tiny_llama_dir, "self", 3, 24, seed=0))  # reproducible


@pytest.mark.parametrize("argv,match", [
    (["--calib", "/no/such.txt"], "does not exist"),
    (["--num-samples", "0"], "--num-samples must be >= 1"),
    (["--seq-len", "1"], "--seq-len must be >= 2"),
    (["--model", "no-such-model"], "neither a local directory"),
])
def test_argument_errors_come_before_loading(argv, match, tmp_path, capsys, monkeypatch):
    import tools.convert.quantize as q

    monkeypatch.setattr(q, "quantize_checkpoint", lambda *a, **k: pytest.fail("the model was loaded"))
    args = ["quantize", "--model", str(tmp_path), "--out", str(tmp_path / "o")]
    if "--model" in argv:
        args = ["quantize", "--out", str(tmp_path / "o")]
    rc = main(args + argv)
    err = capsys.readouterr().err
    assert rc == 2 and match in err and "Traceback" not in err


def test_demo_name_and_help_defaults(monkeypatch, tmp_path, tiny_llama_dir):
    import tools.convert.cli as cli
    from lqe.loaders import model_source

    monkeypatch.setattr(model_source, "demo_model_dir", lambda: tiny_llama_dir)
    seen = {}

    def fake_quantize(model_dir, out, method, spec, opts, overwrite):
        seen["model"] = model_dir
        raise ConvertError("stop here")
    import tools.convert.quantize as q
    monkeypatch.setattr(q, "quantize_checkpoint", fake_quantize)
    assert cli.main(["quantize", "--model", "SmolLM2-135M-Instruct", "--out", str(tmp_path / "o"), "--method", "rtn"]) == 2
    assert seen["model"] == tiny_llama_dir
    helps = build_parser()._subparsers._group_actions[0].choices["quantize"].format_help()
    helps = helps[helps.index("options:"):]
    for flag in ("--num-samples", "--seq-len", "--seed", "--damp", "--method", "--batch-size"):
        line = helps[helps.index(flag):]
        end = line.find("\n  --", 3)
        assert "(default:" in (line if end < 0 else line[:end]), flag


def test_every_flag_has_help():
    sub = build_parser()._subparsers._group_actions[0].choices
    for name, parser in sub.items():
        for action in parser._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
