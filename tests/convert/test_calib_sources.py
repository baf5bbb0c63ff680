"""tools.convert in a fresh clone: the packaged default calibration text (used without --calib, whatever is beside
the repository), --calib wikitext2 for the workspace's WikiText-2 file, --calib FILE in .txt / .jsonl / .parquet,
--calib self, model names resolved like LLM resolves them, and argument errors before any model is read."""
import gzip
import importlib.util
import json
import os
import re

import pytest
import torch

from tools.convert import calib_data
from tools.convert.calib_data import PACKAGED_CALIB, calibration_ids, default_calib_path, read_calib_text
from tools.convert.cli import build_parser, main
from tools.convert.spec import ConvertError

DOCS = ["The quick brown fox jumps over the lazy dog near the river bank.",
        "Paris is the capital of France, and Berlin is the capital of Germany."] * 30
DATA = os.path.dirname(PACKAGED_CALIB)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the licenses a shipped text may carry (public domain or permissive)
PERMISSIVE = ("public domain", "CC0", "CC BY 4.0", "CC BY 3.0", "MIT", "BSD", "Apache", "PSF")


@pytest.fixture
def shared_file(tmp_path, monkeypatch):
    """A stand-in for ../shared/data/wikitext2-valid.tokens that exists."""
    shared = tmp_path / "wikitext2-valid.tokens"
    shared.write_text("\n\n".join(DOCS))
    monkeypatch.setattr(calib_data, "SHARED_CALIB", str(shared))
    return str(shared)


def _packaged_text() -> str:
    with gzip.open(PACKAGED_CALIB, "rt", encoding="utf-8") as f:
        return f.read()


def test_packaged_text_ships_with_the_package(tiny_llama_dir):
    """A compact gzip file of plain prose inside tools/convert/data, enough tokens for the default 32 x 256."""
    from transformers import AutoTokenizer

    assert default_calib_path() == PACKAGED_CALIB == os.path.join(REPO, "tools", "convert", "data",
                                                                  "calib_default.txt.gz")
    assert os.path.getsize(PACKAGED_CALIB) <= 150 * 1024
    text = _packaged_text()
    assert 200_000 <= len(text.encode()) <= 400_000 and read_calib_text(PACKAGED_CALIB) == text
    paras = text.strip("\n").split("\n\n")
    assert len(paras) >= 300 and all(p.strip() and "\n" not in p for p in paras)
    assert not re.search(r"Gutenberg|<[a-z/][^>]*>|``|:[a-z]+:`|\[Illustration", text)  # no boilerplate or markup
    n = len(AutoTokenizer.from_pretrained(tiny_llama_dir)(text, add_special_tokens=False)["input_ids"])
    assert n >= 60_000  # SmolLM2 tokens: 71,852


def test_attribution_names_a_license_for_every_source():
    md = open(os.path.join(DATA, "ATTRIBUTION.md"), encoding="utf-8").read()
    sections = re.split(r"^### ", md, flags=re.M)[1:]
    assert len(sections) >= 3
    for sec in sections:
        lic = re.search(r"^- License: (.*)$", sec, flags=re.M)
        assert lic and any(k.lower() in lic.group(1).lower() for k in PERMISSIVE), sec.splitlines()[0]
        assert re.search(r"^- Where from: ", sec, flags=re.M), sec.splitlines()[0]
    # the table's shares are the file's paragraphs (blank-line separated, newline at the end)
    shares = [int(m.replace(",", "")) for m in re.findall(r"^\|[^|]+\| ([\d,]+) chars \|", md, flags=re.M)]
    assert len(shares) == len(sections)
    text = _packaged_text()
    assert sum(shares) + 2 * (len(text.strip("\n").split("\n\n")) - 1) + 1 == len(text)
    assert "wikitext" not in text.lower()


def test_no_calib_means_the_packaged_text_even_beside_the_shared_file(tiny_llama_dir, shared_file, monkeypatch,
                                                                     capsys):
    """No --calib: the packaged text, not the model's own samples and not ../shared/data, so a fresh clone and this
    workspace calibrate on the same tokens."""
    monkeypatch.setattr(calib_data, "self_generated_ids", lambda *a, **k: pytest.fail("sampled the model"))
    ids = calibration_ids(tiny_llama_dir, None, 3, 32, seed=2)
    assert "packaged default text" in capsys.readouterr().out
    assert torch.equal(ids, calibration_ids(tiny_llama_dir, PACKAGED_CALIB, 3, 32, seed=2))
    assert torch.equal(ids, calibration_ids(tiny_llama_dir, "default", 3, 32, seed=2))
    assert not torch.equal(ids, calibration_ids(tiny_llama_dir, shared_file, 3, 32, seed=2))


def test_no_calib_quantize_passes_no_path(monkeypatch, tmp_path, tiny_llama_dir):
    """The CLI leaves --calib None, which calibration_ids turns into the packaged text."""
    import tools.convert.quantize as q

    seen = {}

    def fake_quantize(model_dir, out, method, spec, opts, overwrite):
        seen["calib"] = opts.calib
        raise ConvertError("stop here")
    monkeypatch.setattr(q, "quantize_checkpoint", fake_quantize)
    assert main(["quantize", "--model", tiny_llama_dir, "--out", str(tmp_path / "o")]) == 2
    assert seen == {"calib": None}


def test_wikitext2_alias(tiny_llama_dir, shared_file, tmp_path, monkeypatch, capsys):
    """--calib wikitext2 is the shared WikiText-2 file where it exists, and an early error where it does not."""
    assert torch.equal(calibration_ids(tiny_llama_dir, "wikitext2", 2, 16, seed=1),
                       calibration_ids(tiny_llama_dir, shared_file, 2, 16, seed=1))
    monkeypatch.setattr(calib_data, "SHARED_CALIB", str(tmp_path / "absent.tokens"))
    with pytest.raises(ConvertError, match="--calib wikitext2 reads .*absent.tokens, which does not exist"):
        calibration_ids(tiny_llama_dir, "wikitext2", 2, 16)
    import tools.convert.quantize as q

    monkeypatch.setattr(q, "quantize_checkpoint", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["quantize", "--model", str(tmp_path), "--out", str(tmp_path / "o"), "--calib", "wikitext2"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err


def test_missing_packaged_text_is_explained(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(calib_data, "PACKAGED_CALIB", str(tmp_path / "gone.txt.gz"))
    with pytest.raises(ConvertError, match="packaged calibration text .* is missing.*--calib self"):
        calibration_ids(tiny_llama_dir, None, 2, 16)


def test_package_data_is_declared():
    """A non-editable `pip install .` must carry the text: pyproject.toml declares it as tools.convert's data."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    import glob

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        cfg = tomllib.load(f)
    assert any(p.startswith("tools") for p in cfg["tool"]["setuptools"]["packages"]["find"]["include"])
    pats = cfg["tool"]["setuptools"]["package-data"]["tools.convert"]
    shipped = {os.path.relpath(f, os.path.join(REPO, "tools", "convert"))
               for pat in pats for f in glob.glob(os.path.join(REPO, "tools", "convert", pat))}
    assert {"data/calib_default.txt.gz", "data/ATTRIBUTION.md"} <= shipped


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
