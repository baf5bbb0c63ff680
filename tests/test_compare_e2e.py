"""benchmarks/compare_e2e.py, issue 27's e2e gate (every row >= 0.95x the committed one), on small synthetic JSONs:
rows matched by (model_shape, variant), speed ratios per column (TTFT inverted), throughput compared only between
runs of the same requests, committed rows with no new measurement listed."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import compare_e2e  # noqa: E402


def _row(shape="qwen2.5-0.5b", variant="bf16", scale=1.0, ttft=20.0, **extra) -> dict:
    return {"model_shape": shape, "variant": variant, "decode_tok_s_bs1": 700.0 * scale,
            "decode_tok_s_bs16": 8000.0 * scale, "ttft_ms": ttft, "throughput_tok_s": 4000.0 * scale,
            "total_tok_s": 8000.0 * scale, "num_requests": 32, **extra}


WL = {"workload_id": "sha256:6ed173c5ad497b1c", "workload_output_tokens": 17947, "max_num_seqs": 64}


def _files(tmp_path, old_rows, new_rows) -> tuple[str, str]:
    old, new = tmp_path / "old.json", tmp_path / "e2e-stub-gpu.json"
    old.write_text(json.dumps({"device": "Stub GPU", "rows": old_rows}))
    new.write_text(json.dumps({"device": "Stub GPU", "rows": new_rows}))
    return str(new), str(old)


def test_rows_within_five_percent_or_faster_pass(tmp_path, capsys):
    new, old = _files(tmp_path, [_row(**WL), _row(variant="w4a16", **WL)],
                      [_row(scale=0.96, ttft=20.5, **WL), _row(variant="w4a16", scale=1.3, ttft=10.0, **WL)])
    assert compare_e2e.main([new, "--old", old]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-0.5b/bf16" in out and "SLOWER" not in out and "throughput_tok_s 0.960x" in out
    assert "ttft_ms 2.000x" in out  # 20 ms -> 10 ms: twice as fast
    assert "2 rows compared, 0 slower" in out


def test_a_row_under_095_fails(tmp_path, capsys):
    new, old = _files(tmp_path, [_row(**WL), _row(shape="smollm2-135m", **WL)],
                      [_row(**WL), _row(shape="smollm2-135m", ttft=25.0, **WL)])  # TTFT 25 % slower
    assert compare_e2e.main([new, "--old", old]) == 1
    out = capsys.readouterr().out
    assert "smollm2-135m/bf16" in out and "SLOWER (ttft_ms under 0.95x)" in out and "1 slower" in out
    r = compare_e2e.compare([_row(**WL)], [_row(scale=0.9, **WL)])["rows"][("qwen2.5-0.5b", "bf16")]
    assert set(r["slower"]) == {"decode_tok_s_bs1", "decode_tok_s_bs16", "throughput_tok_s", "total_tok_s"}
    assert compare_e2e.compare([_row(**WL)], [_row(scale=0.9, **WL)], threshold=0.85)["rows"][
        ("qwen2.5-0.5b", "bf16")]["slower"] == []


def test_throughput_of_other_requests_is_not_compared(tmp_path, capsys):
    """The committed rows predate workload_id (their 32 requests drew 19,266 output tokens, today's 17,947): their
    throughput is reported not comparable and the decode / TTFT columns decide, even with a 7 % lower throughput."""
    low_throughput = {**_row(**WL), "throughput_tok_s": 3700.0, "total_tok_s": 7400.0}
    new, old = _files(tmp_path, [_row()], [low_throughput])
    assert compare_e2e.main([new, "--old", old]) == 0
    out = capsys.readouterr().out
    assert "not comparable (workload changed: the committed row records no workload_id)" in out
    assert "throughput_tok_s" not in out.split("throughput:")[0] and "decode_tok_s_bs16 1.000x" in out
    redrawn = {**low_throughput, "workload_id": "sha256:0", "workload_output_tokens": 1}
    other = compare_e2e.compare([_row(**WL)], [redrawn])
    assert other["rows"][("qwen2.5-0.5b", "bf16")]["throughput"].startswith("not comparable (other requests")
    seqs = compare_e2e.compare([_row(**WL)], [{**low_throughput, "max_num_seqs": 256}])
    assert seqs["rows"][("qwen2.5-0.5b", "bf16")]["throughput"] == "not comparable (max_num_seqs 64 -> 256)"


def test_committed_rows_without_a_new_measurement_are_listed(tmp_path, capsys):
    """e2e_gpu.py --quick measures no llama3-8b row: absent, or carried over unchanged by its merge, the row is
    listed as not measured (a failure only with --strict); a new row with no committed one is listed too."""
    llama = _row(shape="llama3-8b", commit="c046bb6")
    new, old = _files(tmp_path, [_row(**WL), llama, _row(variant="w8a8")],
                      [_row(scale=1.01, **WL), llama, _row(variant="fp8")])
    assert compare_e2e.main([new, "--old", old]) == 0
    out = capsys.readouterr().out
    assert "llama3-8b/bf16" in out and "no new measurement (carried over unchanged)" in out
    assert "qwen2.5-0.5b/w8a8" in out and "no new measurement (absent)" in out
    assert "qwen2.5-0.5b/fp8" in out and "new row (no committed one)" in out
    assert "1 rows compared, 0 slower than 0.95x, 2 committed rows not measured, 1 new" in out
    assert compare_e2e.main([new, "--old", old, "--strict"]) == 1


def test_committed_file_from_git_or_the_tree(tmp_path):
    """The default committed file is the new file's name under benchmarks/results at git HEAD; without git, the
    working tree's file when that is not the new file itself; else nothing to compare (exit 2)."""
    repo = tmp_path / "repo"
    (repo / "benchmarks" / "results").mkdir(parents=True)
    committed = repo / "benchmarks" / "results" / "e2e-stub-gpu.json"
    committed.write_text(json.dumps({"rows": [_row()]}))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(git + ["add", "."], cwd=repo, check=True)
    subprocess.run(git + ["commit", "-qm", "rows"], cwd=repo, check=True)
    committed.write_text(json.dumps({"rows": [_row(scale=2.0)]}))  # the run overwrote the tree's file
    doc, where = compare_e2e.committed_doc(committed, "HEAD", root=repo)
    assert where == "HEAD:benchmarks/results/e2e-stub-gpu.json" and doc["rows"] == [_row()]
    out = tmp_path / "out" / "e2e-stub-gpu.json"
    out.parent.mkdir()
    out.write_text("{}")
    nogit = tmp_path / "nogit"
    (nogit / "benchmarks").mkdir(parents=True)
    (repo / "benchmarks" / "results").rename(nogit / "benchmarks" / "results")
    doc, where = compare_e2e.committed_doc(out, "HEAD", root=nogit)
    assert doc["rows"] == [_row(scale=2.0)] and "working tree" in where
    with pytest.raises(FileNotFoundError, match="--old"):
        compare_e2e.committed_doc(nogit / "benchmarks" / "results" / "e2e-stub-gpu.json", "HEAD", root=nogit)
    assert compare_e2e.main([str(tmp_path / "missing.json")]) == 2


def test_default_new_file_is_the_one_in_out(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="0 e2e"):
        compare_e2e.default_new()
    (tmp_path / "e2e-stub-gpu.json").write_text("{}")
    assert compare_e2e.default_new() == tmp_path / "e2e-stub-gpu.json"


def test_the_committed_file_parses():
    """The committed H100 rows: keys unique, compared with themselves every row is carried over (no new measurement)."""
    doc = json.loads((ROOT / "benchmarks" / "results" / "e2e-nvidia-h100-80gb-hbm3.json").read_text())
    keys = [compare_e2e.row_key(r) for r in doc["rows"]]
    assert len(keys) == len(set(keys)) and ("llama3-8b", "bf16") in keys
    res = compare_e2e.compare(doc["rows"], doc["rows"])
    assert res["rows"] == {} and sorted(res["carried"]) == sorted(keys)
    assert compare_e2e.report(res, 0.95, False)[1] == 2  # nothing measured again: nothing checked
