"""benchmarks/kv_cache_gpu.py on the CPU (issue 29's GPU rows): the timed window is steady full-batch decode, the
JSON survives a failing variant, the floor's bandwidth is the device's, the checkpoint is e2e_gpu.py's, and the
concurrent-sequence count is what the block manager really fits."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import kv_cache_gpu

BATCH, CONTEXT, STEPS, BUDGET = 4, 40, 3, 64  # 4 x 40 prompt tokens over a 64-token budget: a ramp of mixed steps


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from helpers import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("kv-bench")), "llama", tokenizer=False)


def _cpu_args(model: str, out: Path, *extra: str) -> list[str]:
    return ["--device", "cpu", "--model", model, "--context", str(CONTEXT), "--batch", str(BATCH),
            "--decode-steps", str(STEPS), "--warmup-steps", "1", "--max-num-batched-tokens", str(BUDGET),
            "--kv-cache-memory-bytes", str(2 << 20), "--out", str(out), *extra]


@pytest.fixture(scope="module")
def cpu_run(tiny_model, tmp_path_factory):
    """One end-to-end CPU run of auto and fp8, with every engine step logged and the window's two syncs marked."""
    from lqe.engine.model_runner import ModelRunner

    log: list = []
    out = tmp_path_factory.mktemp("kv-out") / "kvcache.json"
    mp = pytest.MonkeyPatch()
    execute = ModelRunner.execute

    def logged(self, sched, *a, **k):
        log.append([(s.num_new_tokens, s.start, s.seq.num_prompt_tokens) for s in sched.scheduled])
        return execute(self, sched, *a, **k)

    mp.setattr(ModelRunner, "execute", logged)
    mp.setattr(kv_cache_gpu, "_sync", lambda device: log.append("sync"))
    try:
        rc = kv_cache_gpu.main(_cpu_args(tiny_model, out, "--variants", "auto,fp8", "--hbm-gbs", "100"))
    finally:
        mp.undo()
    return rc, log, json.loads(out.read_text())


def test_timed_window_holds_only_full_batch_decode_steps(cpu_run):
    rc, log, res = cpu_run
    assert rc == 0, res.get("errors")
    marks = [i for i, e in enumerate(log) if e == "sync"]
    assert len(marks) == 4  # start and end of each variant's window
    for before, start, end in ((-1, *marks[0:2]), marks[1:4]):
        window = log[start + 1:end]
        assert len(window) == STEPS
        for step in window:
            assert len(step) == BATCH
            assert all(n == 1 and s >= prompt for n, s, prompt in step), step  # one decode token per sequence
        ramp = log[before + 1:start]  # the variant's warm-up generate, its ramp and its untimed decode steps
        # the scheduler decodes early requests while later ones prefill: steps the window must leave out
        assert any(any(n == 1 for n, _, _ in step) and any(n > 1 for n, _, _ in step) for step in ramp)


def test_rates_are_batch_times_steps_over_window(cpu_run):
    _, _, res = cpu_run
    assert res["complete"] is True and "errors" not in res
    for name in ("auto", "fp8"):
        row = res["variants"][name]
        assert row["decode_tokens"] == BATCH * STEPS and row["window_batch"] == BATCH
        assert row["decode_tok_s"] == pytest.approx(BATCH * STEPS / row["decode_s"])
        assert row["step_ms"] == pytest.approx(1e3 * row["decode_s"] / STEPS)
        assert row["ramp_steps"] >= 2  # the prefill of 4 x 40 tokens over a 64-token budget
        # the floor: weights + every sequence's K/V at its window context, at the given bandwidth
        assert CONTEXT + 1 <= row["window_mean_context"] <= CONTEXT + row["ramp_steps"] + 1 + STEPS
        kv = row["window_mean_context"] * BATCH * row["kv_bytes_per_token"]
        assert row["kv_bytes_per_step"] == pytest.approx(kv)
        assert row["floor_ms"] == pytest.approx(1e3 * (row["weight_bytes"] + kv) / 100e9)
        assert row["hbm_from"] == "--hbm-gbs"
    assert res["variants"]["fp8"]["kv_bytes_per_token"] * 2 == res["variants"]["auto"]["kv_bytes_per_token"]


def test_concurrent_seqs_is_what_the_block_manager_fits(cpu_run):
    from lqe import SamplingParams
    from lqe.engine.block_manager import BlockManager
    from lqe.engine.sequence import Sequence

    _, _, res = cpu_run
    for row in res["variants"].values():
        assert row["capacity_len"] == CONTEXT + STEPS
        bm = BlockManager(row["num_blocks"], row["block_size"], enable_prefix_caching=False)
        fitted = 0
        while True:
            seq = Sequence(fitted, str(fitted), 0, list(range(2, 2 + row["capacity_len"])), SamplingParams(),
                           torch.Generator())
            if not bm.can_allocate(bm.blocks_needed(seq, row["capacity_len"])):
                break
            bm.allocate(seq, row["capacity_len"])
            fitted += 1
        assert row["concurrent_seqs"] == fitted
    assert res["ratios"]["concurrent_seqs"] >= 1.9 and res["ratios"]["concurrent_seqs_same_bytes"] >= 1.9


def test_json_is_written_after_each_variant(tmp_path, monkeypatch):
    out = tmp_path / "kv.json"
    seen = {}

    def fake_run(model_dir, variant, args):
        if variant == "auto":
            return {"variant": "auto", "decode_tok_s": 1.0}
        seen["json"] = json.loads(out.read_text())  # what a timeout here would leave
        raise RuntimeError("device fault")

    monkeypatch.setattr(kv_cache_gpu, "run", fake_run)
    rc = kv_cache_gpu.main(["--device", "cpu", "--model", str(tmp_path), "--variants", "auto,fp8", "--out", str(out)])
    assert rc == 1
    assert seen["json"]["complete"] is False and list(seen["json"]["variants"]) == ["auto"]
    final = json.loads(out.read_text())
    assert final["complete"] is True and list(final["variants"]) == ["auto"]
    assert "device fault" in final["errors"]["fp8"] and "ratios" not in final


@pytest.mark.parametrize("name,gbs", [("NVIDIA H100 80GB HBM3", 3350), ("NVIDIA H200", 4800), ("NVIDIA H200 NVL", 4800)])
def test_bandwidth_comes_from_the_device(monkeypatch, name, gbs):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: name)
    bw, src = kv_cache_gpu.hbm_bytes_per_s(None, "cuda")
    assert bw == pytest.approx(gbs * 1e9) and "peaks_for" in src
    assert kv_cache_gpu.hbm_bytes_per_s(2000.0, "cuda") == (2000e9, "--hbm-gbs")  # the flag overrides


def test_unknown_device_has_no_floor(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Some GPU")
    assert kv_cache_gpu.hbm_bytes_per_s(None, "cuda")[0] is None
    assert kv_cache_gpu.hbm_bytes_per_s(None, "cpu")[0] is None


def test_checkpoint_is_e2e_gpus(tmp_path, monkeypatch):
    import e2e_gpu

    assert kv_cache_gpu.build_random_model is e2e_gpu.build_random_model
    built = []
    monkeypatch.setenv("LQE_BENCH_DIR", str(tmp_path / "bench"))
    monkeypatch.setattr(kv_cache_gpu, "build_random_model", lambda shape, d, seed: built.append((shape, d, seed)) or d)
    monkeypatch.setattr(kv_cache_gpu, "run", lambda model_dir, v, args: {"variant": v, "model_dir": str(model_dir)})
    monkeypatch.setattr(kv_cache_gpu, "summarize", lambda res: None)
    assert kv_cache_gpu.main(["--device", "cpu", "--variants", "auto,fp8"]) == 0
    # e2e_gpu.py's layout: --work-dir (default $LQE_BENCH_DIR) / <shape> / bf16, seed 0
    assert built == [("llama3-8b", tmp_path / "bench" / "llama3-8b" / "bf16", 0)]


def test_no_gpu_exits_2_without_building(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(kv_cache_gpu, "build_random_model", lambda *a: pytest.fail("built a checkpoint"))
    assert kv_cache_gpu.main([]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_default_settings_are_the_issue_targets():
    import argparse

    seen = {}
    orig = argparse.ArgumentParser.parse_args

    def grab(self, argv=None, namespace=None):
        seen["args"] = orig(self, argv, namespace)
        raise SystemExit(0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", grab)
        with pytest.raises(SystemExit):
            kv_cache_gpu.main([])
    a = seen["args"]
    assert (a.context, a.batch, a.shape, a.hbm_gbs, a.device) == (4096, 64, "llama3-8b", None, "cuda")
    # none of the 64 requests finishes inside the window: max_tokens covers the ramp, the warm-up and the window
    ramp = kv_cache_gpu.ramp_steps_bound(a.batch, a.context, a.max_num_batched_tokens)
    assert 33 <= ramp <= 40
    assert os.path.basename(kv_cache_gpu.checkpoint_dir("llama3-8b").parent) == "llama3-8b"
