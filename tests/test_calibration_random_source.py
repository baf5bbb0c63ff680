"""Issue 27 in one device call: the random checkpoint drawn as calibration reads it (benchmarks/common.py
RandomCheckpointReader, ``quantize_checkpoint(reader=...)``, ``calibration_gpu.py --source random``), the pause from
the device budget (``LQE_BUDGET_S``) that writes a partial row, the fp32-matmul guard under torch's new precision API,
and GPTQ's damping retry on a Hessian that is not positive definite."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks")]

import calibration_gpu as cg
from common import RandomCheckpointReader, write_random_checkpoint

TINY = dict(cg.TINY)


def _config(**overrides):
    return cg.llama_config({**TINY, **overrides})


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(str(d / f)))
    return out


# ------------------------------------------------------------------------------------------------ the reader
@pytest.mark.parametrize("tied", [False, True])
def test_random_reader_has_the_written_checkpoints_tensors_and_reads_them_the_same_each_time(tmp_path, tied):
    from tools.convert.writer import CheckpointReader

    config, model_cls = _config(tie_word_embeddings=tied)
    written = write_random_checkpoint(config, model_cls, tmp_path / "disk", seed=0, shard_bytes=1 << 20)
    index = json.loads((written / "model.safetensors.index.json").read_text())["weight_map"]
    disk = CheckpointReader(str(written))
    reader = RandomCheckpointReader(config, model_cls, seed=0)
    assert list(reader.meta) == list(index)  # the same names in the same (state dict) order
    assert ("lm_head.weight" in reader) is not tied
    for k, t in reader.meta.items():
        assert t.shape == disk.meta[k].shape and t.dtype == disk.meta[k].dtype == torch.bfloat16, k
    assert reader.float_dtype() == disk.float_dtype() == torch.bfloat16
    assert reader.nbytes() == sum(t.numel() * t.element_size() for t in disk.meta.values())

    keys = reader.keys()
    first = reader.get_many(keys)
    again = {k: reader.get(k) for k in reversed(keys)}  # one at a time, in another order
    for k in keys:
        assert first[k].device.type == "cpu" and first[k].dtype == torch.bfloat16
        assert torch.equal(first[k], again[k]), k
        if k.endswith("norm.weight"):
            assert torch.equal(first[k], torch.ones_like(first[k]))
        else:
            assert abs(first[k].float().std().item() - 0.02) < 0.004, k
    as_f32 = reader.get_many(keys[:3], "cpu", torch.float32)
    assert all(as_f32[k].dtype == torch.float32 and torch.equal(as_f32[k], first[k].float()) for k in keys[:3])
    other = RandomCheckpointReader(config, model_cls, seed=1)
    assert not torch.equal(other.get(keys[0]), first[keys[0]])
    w = [k for k in keys if k.endswith("q_proj.weight")]
    assert not torch.equal(first[w[0]], first[w[1]])  # every tensor its own draw
    from tools.convert import ConvertError

    with pytest.raises(ConvertError, match="no tensor"):
        reader.get("nope.weight")


def test_quantize_with_the_random_reader_equals_a_disk_checkpoint_of_its_tensors(tmp_path):
    """``quantize_checkpoint(reader=RandomCheckpointReader)`` on a folder holding only config.json writes, tensor
    for tensor, what calibrating a safetensors checkpoint of the reader's tensors writes; tools.convert verifies it."""
    from tools.convert import ExportSpec
    from tools.convert.quantize import CalibOptions, quantize_checkpoint
    from tools.convert.verify import verify_checkpoint

    fields = dict(TINY, num_hidden_layers=2)
    config, model_cls = cg.llama_config(fields)
    cfg_dir = tmp_path / "random-config"
    reader = RandomCheckpointReader(config, model_cls, seed=3)
    reader.save_config(cfg_dir)
    assert sorted(os.listdir(cfg_dir)) == ["config.json"]
    disk = tmp_path / "disk"
    disk.mkdir()
    config.save_pretrained(str(disk))
    save_file(reader.get_many(reader.keys()), str(disk / "model.safetensors"), metadata={"format": "pt"})

    ids = torch.randint(0, fields["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(0))
    opts = CalibOptions(num_samples=4, seq_len=32, batch_size=2, device="cpu")
    outs = {}
    for name, model_dir, rd in (("random", cfg_dir, reader), ("disk", disk, None)):
        spec = ExportSpec(fmt="gptq_v2", sym=False, desc_act=True, group_size=64)
        outs[name] = tmp_path / f"out-{name}"
        quantize_checkpoint(str(model_dir), str(outs[name]), "gptq", spec, opts, overwrite=True, input_ids=ids,
                            reader=rd)
    a, b = _tensors(outs["random"]), _tensors(outs["disk"])
    assert sorted(a) == sorted(b) and any(k.endswith("qweight") for k in a)
    differ = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not differ, differ[:5]
    assert json.loads((outs["random"] / "config.json").read_text()) == json.loads(
        (outs["disk"] / "config.json").read_text())
    assert verify_checkpoint(str(outs["random"])).ok
    with pytest.raises(Exception, match="stream"):
        quantize_checkpoint(str(cfg_dir), str(tmp_path / "x"), "rtn", ExportSpec(fmt="gptq", group_size=64), opts,
                            stream=False, reader=reader)


# ------------------------------------------------------------------------------------------------ the benchmark
def test_calibration_benchmark_random_source_on_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("LQE_BUDGET_S", raising=False)
    out, work = tmp_path / "calib.json", tmp_path / "work"
    base = ["--quick", "--device", "cpu", "--methods", "gptq-asym-act", "--out", str(out), "--work-dir", str(work)]
    assert cg.main(base + ["--source", "random"]) == 0
    assert sorted(p.name for p in (work / "tiny-2l-random-config").iterdir()) == ["config.json"]
    assert not list(work.rglob("*.safetensors"))  # nothing drawn went to disk
    assert cg.main(base + ["--source", "disk"]) == 0
    rows = {r["source"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"random", "disk"}  # one row each: the source is part of the row's key
    for r in rows.values():
        assert r["complete"] and r["layers"] == 2 and r["calib_seconds"] > 0 and 0 < r["mean_layer_error"] < 1
        assert r["setup_seconds"] > 0 and r["method"] == "gptq-asym-act" and r["desc_act"] and not r["sym"]


def test_budget_sets_the_stop():
    assert cg.budget_stop_after(None, {}) is None
    assert cg.budget_stop_after(500.0, {}) == 500.0
    assert cg.budget_stop_after(None, {"LQE_BUDGET_S": "590"}) == 590 - cg.BUDGET_MARGIN_S
    assert cg.budget_stop_after(300.0, {"LQE_BUDGET_S": "590"}) == 300.0
    assert cg.budget_stop_after(600.0, {"LQE_BUDGET_S": "100"}) == 100 - cg.BUDGET_MARGIN_S


def test_a_budget_pause_writes_a_partial_row_that_the_complete_one_replaces(tmp_path, monkeypatch):
    """LQE_BUDGET_S already spent: the call calibrates one layer, saves, writes a partial row (complete false,
    layers done, seconds per layer, the extrapolation) and exits 3; the same command with time continues and its
    complete row replaces the partial one."""
    out, work = tmp_path / "calib.json", tmp_path / "work"
    argv = ["--quick", "--device", "cpu", "--methods", "gptq-asym-act", "--out", str(out), "--work-dir", str(work),
            "--tail-s", "0"]
    monkeypatch.setenv("LQE_BUDGET_S", "1")
    assert cg.main(argv) == 3
    (row,) = json.loads(out.read_text())["rows"]
    assert row["complete"] is False and row["paused_before_layer"] == 1 and row["layers_done"] == 1
    assert row["layers"] == 2 and row["source"] == "random" and len(row["layer_seconds"]) == 1
    assert row["layer_seconds_median"] == pytest.approx(row["layer_seconds"][0], abs=1e-3)
    assert row["extrapolated_seconds"] == pytest.approx(row["fixed_seconds"] + 2 * row["layer_seconds_median"],
                                                        abs=0.1)
    assert row["calls"] == 1 and row["stop_after_s"] == 1 - cg.BUDGET_MARGIN_S
    monkeypatch.delenv("LQE_BUDGET_S")
    assert cg.main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["complete"] is True and row["resumed"] and row["calls"] == 2 and "paused_before_layer" not in row


# ------------------------------------------------------------------------------------------------ precision guard
GUARD = """
import torch
from tools.convert.streaming import fp32_matmuls
m = torch.backends.cuda.matmul
if hasattr(m, "fp32_precision"):  # torch >= 2.9: the new API set first; the legacy getter now raises
    m.fp32_precision = "tf32"
    with fp32_matmuls():
        assert m.fp32_precision == "ieee", m.fp32_precision
        a = torch.randn(8, 8); a @ a
    assert m.fp32_precision == "tf32"

    @fp32_matmuls()
    def inside():
        return m.fp32_precision
    assert inside() == "ieee" and m.fp32_precision == "tf32"
    m.fp32_precision = "none"
torch.set_float32_matmul_precision("high")  # the legacy API: kept to, legacy reads still answer inside
with fp32_matmuls():
    assert torch.get_float32_matmul_precision() == "highest"
    m.allow_tf32
assert torch.get_float32_matmul_precision() == "high"
print("ok", torch.__version__)
"""


def test_fp32_matmuls_guard_under_both_precision_apis():
    """The settings side, in a fresh interpreter (the APIs' state is process-wide). The GPU machine's torch (2.11)
    checks the numbers: tests/gpu/test_calibration_gpu.py::test_fp32_matmuls_turns_tf32_off_on_cuda."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", GUARD], capture_output=True, text=True, env=env, cwd=str(REPO),
                          timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr[-3000:]


# ------------------------------------------------------------------------------------------------ damping retry
def _indefinite_hessian(k: int = 64, rank: int = 8) -> torch.Tensor:
    """A rank-deficient X^T X pushed below zero in its null space: not positive definite at 1 % damping, at 10 %."""
    x = torch.randn(rank, k, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    h = x.t() @ x
    return h - 0.05 * h.diagonal().mean() * torch.eye(k, dtype=torch.float64)


def test_gptq_retries_a_hessian_that_is_not_positive_definite_with_more_damping(caplog):
    from tools.convert.gptq import gptq_quantize

    h = _indefinite_hessian()
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.cholesky(h + 0.01 * h.diagonal().mean() * torch.eye(64, dtype=torch.float64))
    for act_order in (False, True):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lqe.convert"):
            cw = gptq_quantize(w, h, 4, 32, False, damp=0.01, act_order=act_order)
        assert "not positive definite" in caplog.text and "trying again with 0.1" in caplog.text
        # = the first attempt at 10x the damping: the same bits
        ref = gptq_quantize(w, h, 4, 32, False, damp=0.1, act_order=act_order)
        for f in ("codes", "scales", "zeros", "g_idx"):
            a, b = getattr(cw, f), getattr(ref, f)
            assert (a is None and b is None) or torch.equal(a, b), f
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lqe.convert"):  # a Hessian that factors: no retry
        gptq_quantize(w, h + 0.2 * h.diagonal().mean() * torch.eye(64, dtype=torch.float64), 4, 32, True)
    assert not caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lqe.convert"):  # rank 1, no damping asked: retried at 0.01
        cw = gptq_quantize(w, torch.ones(64, 64, dtype=torch.float64), 4, 32, True, damp=0.0)
    assert "trying again with 0.01" in caplog.text and cw.codes.shape == (64, 16)
    bad = h.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(torch.linalg.LinAlgError, match="damping"):
        gptq_quantize(w, bad, 4, 32, True)
