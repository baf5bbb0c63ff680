"""benchmarks/e2e_gpu.py's run discipline, on the CPU (a tiny model, or stubs where a GPU would be): a variant that
fails makes the run fail (its rows that succeed kept), a failed engine is shut down and collected before the next
variant, every M bucket is compiled before anything is timed, the profiled kernel-busy run stops after its window,
and benchmarks/compare_e2e.py fails a requested row that this run did not measure."""
import gc
import json
import os
import sys
import weakref
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import compare_e2e  # noqa: E402
import e2e_gpu  # noqa: E402
import e2e_measure  # noqa: E402


# ------------------------------------------------------------------------------------------------ main, stubbed
@pytest.fixture
def stub_gpu(monkeypatch, tmp_path):
    """main() with no GPU: a stub device, no checkpoints built or converted, no CUDA fault; the argv it takes."""
    monkeypatch.setattr(e2e_gpu.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(e2e_gpu.torch.cuda, "get_device_name", lambda *a: "Stub GPU")
    monkeypatch.setattr(e2e_gpu, "environment", lambda: {"gpu": "Stub GPU"})
    monkeypatch.setattr(e2e_gpu, "build_random_model", lambda shape, out, seed: tmp_path / shape / "bf16")
    monkeypatch.setattr(e2e_gpu, "quantize", lambda src, fmt, out: (out, ""))
    monkeypatch.setattr(e2e_gpu, "cuda_fault", lambda: None)
    monkeypatch.setenv("LQE_COMMIT", "feed123")
    return ["--shapes", "smollm2-135m,qwen2.5-0.5b", "--variants", "bf16,w4a16", "--out-dir", str(tmp_path / "out"),
            "--work-dir", str(tmp_path / "work")]


def _doc(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "e2e-stub-gpu.json").read_text())


def test_main_fails_when_a_variant_raises_and_keeps_the_other_rows(stub_gpu, tmp_path, monkeypatch, capsys):
    def run_variant(model_dir, args, vocab, shape):
        if shape == "smollm2-135m" and model_dir.name == "gptq":
            raise RuntimeError("a broken kernel")
        return {"decode_tok_s_bs1": 1.0, "phase_s": {"load": 1.0, "throughput": 2.0}}

    monkeypatch.setattr(e2e_gpu, "run_variant", run_variant)
    assert e2e_gpu.main(stub_gpu) == 1
    doc = _doc(tmp_path)
    got = {(r["model_shape"], r["variant"]) for r in doc["rows"] if r.get("commit") == "feed123"}
    assert got == {("smollm2-135m", "bf16"), ("qwen2.5-0.5b", "bf16"), ("qwen2.5-0.5b", "w4a16")}
    (f,) = doc["failures"]
    assert (f["model_shape"], f["variant"], f["kind"]) == ("smollm2-135m", "w4a16", "failed")
    assert "a broken kernel" in f["error"] and f["commit"] == "feed123"
    assert len(doc["requested"]) == 4 and {"model_shape": "smollm2-135m", "variant": "w4a16"} in doc["requested"]
    out = capsys.readouterr().out
    assert "[smollm2-135m/w4a16] failed after" in out and "FAILED: 1 requested row(s)" in out
    assert "[qwen2.5-0.5b/bf16] done in" in out and "load 1.0s, throughput 2.0s" in out  # per-row time in the log

    # every variant measured: 0, and a new run forgets the last one's failures
    monkeypatch.setattr(e2e_gpu, "run_variant", lambda model_dir, args, vocab, shape: {"decode_tok_s_bs1": 2.0})
    assert e2e_gpu.main(stub_gpu) == 0
    assert "failures" not in _doc(tmp_path)


def test_main_fails_when_a_variant_is_skipped(stub_gpu, tmp_path, monkeypatch):
    monkeypatch.setattr(e2e_gpu, "quantize", lambda src, fmt, out: (None, "tools.convert exited 1"))
    monkeypatch.setattr(e2e_gpu, "run_variant", lambda model_dir, args, vocab, shape: {"decode_tok_s_bs1": 1.0})
    assert e2e_gpu.main(stub_gpu) == 1
    doc = _doc(tmp_path)
    assert [(f["model_shape"], f["variant"], f["kind"]) for f in doc["failures"]] == [
        ("smollm2-135m", "w4a16", "skipped"), ("qwen2.5-0.5b", "w4a16", "skipped")]


def test_a_failed_variant_is_collected_before_the_next_one_loads(stub_gpu, monkeypatch):
    """Reference cycles in a failed engine hold its weights and KV cache until collected: main collects them (and
    empties the CUDA cache) before the next variant starts, with the failure's frames cleared."""
    events, refs = [], []
    monkeypatch.setattr(e2e_gpu.torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(e2e_gpu.torch.cuda, "empty_cache", lambda: events.append("empty_cache"))

    class Engine:  # a failed engine: a reference cycle (hooks, fused-layer links) holds it
        def __init__(self):
            self.me = self

    def run_variant(model_dir, args, vocab, shape):
        events.append(("start", shape, model_dir.name, all(r() is None for r in refs)))
        if model_dir.name == "gptq":
            engine = Engine()
            refs.append(weakref.ref(engine))
            raise MemoryError("CUDA out of memory")
        return {"decode_tok_s_bs1": 1.0}

    monkeypatch.setattr(e2e_gpu, "run_variant", run_variant)
    was_enabled = gc.isenabled()
    gc.disable()  # only an explicit collection frees the cycle
    try:
        rc = e2e_gpu.main(stub_gpu)
    finally:
        if was_enabled:
            gc.enable()
    starts = [e for e in events if e != "empty_cache"]
    assert [e[1:3] for e in starts] == [("smollm2-135m", "bf16"), ("smollm2-135m", "gptq"), ("qwen2.5-0.5b", "bf16"),
                                        ("qwen2.5-0.5b", "gptq")]
    assert all(e[3] for e in starts), events  # each variant started with every failed engine collected
    assert events[events.index(starts[1]) + 1] == "empty_cache"  # the cache emptied right after the failure
    assert rc == 1


class _FakeLLM:
    def __init__(self):
        self.closed = 0
        runner = type("Runner", (), {"attention_backend": "stub", "graph_runner": None, "piecewise": None})()
        self.llm_engine = type("Engine", (), {"runner": runner, "quant_description": lambda self: "224 x bf16"})()

    def shutdown(self):
        self.closed += 1


def test_run_variant_shuts_its_engine_down_when_a_measurement_raises(monkeypatch):
    import argparse

    made = []
    monkeypatch.setattr(e2e_gpu, "_llm", lambda model_dir, args, eager: made.append(_FakeLLM()) or made[-1])

    def broken(*a, **k):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(e2e_gpu, "_decode_columns", broken)
    args = argparse.Namespace(no_eager=False, no_kernel_busy=True, label="smollm2-135m/bf16")
    with pytest.raises(RuntimeError, match="out of memory"):
        e2e_gpu.run_variant(Path("/nonexistent"), args, 100, "smollm2-135m")
    assert [m.closed for m in made] == [1]


# ------------------------------------------------------------------------------------------------ tiny CPU engine
def _recording(runner, log: list) -> None:
    """Log each step's (flat tokens, running warm-up decodes) on the runner (sync and async paths)."""
    for name in ("execute", "execute_async"):
        fn = getattr(runner, name)

        def run(sched, *a, _fn=fn, **k):
            log.append((sched.num_batched_tokens,
                        sum(s.seq.request_id.startswith("warm-up-decode") for s in sched.scheduled)))
            return _fn(sched, *a, **k)
        setattr(runner, name, run)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_warm_up_compiles_every_bucket_before_the_timed_runs(tiny_llama_dir, monkeypatch, async_scheduling):
    """Before its first timed measurement, _decode_columns runs one step at each M bucket bound up to a
    max_num_batched_tokens step beside running decodes (the throughput run's largest steps: their Triton GEMM
    configurations compile there, not inside a timed run), and leaves the engine empty."""
    import argparse

    from lqe import LLM

    llm = LLM(tiny_llama_dir, max_model_len=128, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=96,
              max_num_seqs=16, async_scheduling=async_scheduling)
    log = []
    _recording(llm.llm_engine.runner, log)
    timed = lambda *a, **k: log.append("timed") or 1.0  # noqa: E731
    monkeypatch.setattr(e2e_gpu, "decode_tok_s", timed)
    monkeypatch.setattr(e2e_gpu, "host_ms_per_step", lambda *a, **k: {"host_ms_step_bs1": timed()})
    args = argparse.Namespace(seed=0, max_num_batched_tokens=96, label="tiny/bf16")
    e2e_gpu._decode_columns(llm, args, 200, "")
    before = log[:log.index("timed")]
    sizes = {n for n, _ in before}
    assert any(n == 96 and decodes >= 8 for n, decodes in before), before  # the full step, beside decodes
    assert {1, 15, 16, 63, 64, 95, 96} <= sizes, before
    assert set(e2e_measure.warmup_token_counts(96)) <= sizes, before
    assert len(before) < 40  # a few steps
    assert not llm.llm_engine.has_unfinished() and not llm.llm_engine.requests


def test_host_ms_per_step_splits_out_the_graph_launch_and_the_pauses(monkeypatch):
    """host_ms_step_bs1 is a step's wall time minus its GPU wait, averaged; _p50 / _max per step; gc_ms_step_bs1 the
    collector's time inside the timed steps (through gc.callbacks, removed after); graph_launch_ms_step_bs1 the part
    inside the decode graph's replay() (the runner's launch_s over the timed steps only), absent without graphs."""
    import gc
    import random
    import types

    clock = {"t": 0.0}
    monkeypatch.setattr(e2e_measure.time, "perf_counter", lambda: clock["t"])

    class Engine:
        def __init__(self, graphs):
            self.runner = types.SimpleNamespace(graph_runner=graphs, measure_gpu_wait=False, gpu_wait_s=0.0)
            self.left, self.calls = 0, 0

        def add_request(self, rid, prompt, params):
            self.left = params.max_tokens

        def step(self):  # 3 ms per step, 1 of them waiting for the GPU, 0.5 inside the graph's launch
            clock["t"] += 3e-3
            self.left, self.calls = self.left - 1, self.calls + 1
            if self.calls == 11:  # the 10th timed step: a 5 ms collection
                for cb in list(gc.callbacks):
                    cb("start", {"generation": 2})
                clock["t"] += 5e-3
                for cb in list(gc.callbacks):
                    cb("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
            if self.runner.measure_gpu_wait:
                self.runner.gpu_wait_s += 1e-3
            if self.runner.graph_runner is not None:
                self.runner.graph_runner.launch_s += 0.5e-3

        def has_unfinished(self):
            return self.left > 0

    sp = lambda **k: types.SimpleNamespace(**k)  # noqa: E731
    callbacks = list(gc.callbacks)
    engine = Engine(types.SimpleNamespace(launch_s=7.0))  # (launches before the timed steps do not count)
    cols = e2e_measure.host_ms_per_step(types.SimpleNamespace(llm_engine=engine), sp, 100, random.Random(0))
    assert abs(cols["host_ms_step_bs1"] - (63 * 2.0 + 7.0) / 64) < 1e-9
    assert abs(cols["host_ms_step_bs1_p50"] - 2.0) < 1e-9 and abs(cols["host_ms_step_bs1_max"] - 7.0) < 1e-9
    assert abs(cols["gc_ms_step_bs1"] - 5.0 / 64) < 1e-9 and abs(cols["graph_launch_ms_step_bs1"] - 0.5) < 1e-9
    assert gc.callbacks == callbacks and not engine.runner.measure_gpu_wait
    cols = e2e_measure.host_ms_per_step(types.SimpleNamespace(llm_engine=Engine(None)), sp, 100, random.Random(0))
    assert "graph_launch_ms_step_bs1" not in cols and abs(cols["host_ms_step_bs1_p50"] - 2.0) < 1e-9


def test_ttft_times_each_fresh_prompt_alone(monkeypatch):
    """ttft_times_ms gives one time per repetition, each a generate() of one fresh prompt_len-token prompt asking
    for one token, timed on its own (the row keeps their median as ttft_ms and the list as ttft_ms_reps)."""
    import random
    import types

    clock = {"t": 0.0}
    monkeypatch.setattr(e2e_measure.time, "perf_counter", lambda: clock["t"])
    calls = []

    class Llm:
        def generate(self, prompts, params, use_tqdm):
            calls.append((prompts, params.max_tokens))
            clock["t"] += (30e-3, 50e-3, 31e-3)[len(calls) - 1]  # one slow repetition

    sp = lambda **k: types.SimpleNamespace(**k)  # noqa: E731
    times = e2e_measure.ttft_times_ms(Llm(), sp, 1000, random.Random(0), prompt_len=64, reps=3)
    assert [round(t, 6) for t in times] == [30.0, 50.0, 31.0]
    assert [(len(p), len(p[0]), n) for p, n in calls] == [(1, 64, 1)] * 3
    assert len({tuple(p[0]) for p, _ in calls}) == 3  # fresh prompts: no prefix-cache hit between repetitions


def test_warmup_token_counts_cover_the_kernel_tables():
    from lqe.kernels import dispatch, triton_w8a8, triton_wna16

    counts = e2e_measure.warmup_token_counts(8192)
    assert counts[-2:] == [8191, 8192]  # the throughput run's max_num_batched_tokens steps, both 16-divisibilities
    for table in (dispatch.WNA16_TABLE, dispatch.W8A8_TABLE, triton_wna16.CONFIG_TABLE, triton_w8a8.CONFIGS):
        for max_m, _ in table:
            if max_m is not None:
                assert max_m in counts and (max_m == 1 or max_m - 1 in counts)
    assert e2e_measure.warmup_token_counts(96, bounds={64, 256}) == [63, 64, 95, 96]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_kernel_busy_stops_after_its_window(tiny_llama_dir, async_scheduling):
    """The profiled run steps only its window (skip + 2 profiler warm-up + active steps), then aborts the requests
    left through the engine; the engine is empty and serves the next request as usual."""
    from torch.profiler import ProfilerActivity

    from lqe import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, max_model_len=128, kv_cache_memory_bytes=16 << 20, async_scheduling=async_scheduling)
    runner = llm.llm_engine.runner
    log = []
    _recording(runner, log)
    recorder = dict(vars(runner))
    row = e2e_measure.kernel_busy(llm, SamplingParams, 4, 200, 0, skip_steps=2, steps=3, lo=30, hi=60,
                                  activities=[ProfilerActivity.CPU])
    assert row["kernel_busy_steps_run"] == 7 and len(log) == 7, log  # 4 requests of 30-60 new tokens: ~60 steps
    assert row["kernel_busy_requests"] == 4 and row["kernel_busy_window_steps"] == 3
    assert not llm.llm_engine.has_unfinished() and not llm.llm_engine.requests
    assert vars(runner)["execute"] is recorder["execute"]  # our recorder again, the profiler's wrapper removed
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


# ------------------------------------------------------------------------------------------------ compare_e2e
def _row(shape="qwen2.5-0.5b", variant="bf16", scale=1.0, **extra) -> dict:
    return {"model_shape": shape, "variant": variant, "decode_tok_s_bs1": 700.0 * scale,
            "decode_tok_s_bs16": 8000.0 * scale, "ttft_ms": 20.0, **extra}


def _files(tmp_path, old_rows, new_rows, **new_extra) -> tuple[str, str]:
    old, new = tmp_path / "old.json", tmp_path / "e2e-stub-gpu.json"
    old.write_text(json.dumps({"rows": old_rows}))
    new.write_text(json.dumps({"rows": new_rows, **new_extra}))
    return str(new), str(old)


REQ = [{"model_shape": "qwen2.5-0.5b", "variant": "bf16"}, {"model_shape": "qwen2.5-0.5b", "variant": "w4a16"}]


def test_compare_requested_fails_a_row_carried_over(tmp_path, capsys):
    llama = _row(shape="llama3-8b")
    w4 = _row(variant="w4a16")
    # w4a16 was asked for, but the file holds the committed row unchanged (the variant crashed): a failure
    new, old = _files(tmp_path, [_row(), w4, llama], [_row(scale=1.01), w4, llama], requested=REQ)
    assert compare_e2e.main([new, "--old", old]) == 0  # without --requested: only listed, as before
    assert compare_e2e.main([new, "--old", old, "--requested"]) == 1
    out = capsys.readouterr().out.split("== e2e rows")[-1]
    assert "qwen2.5-0.5b/w4a16" in out and "FAIL: no new measurement (carried over unchanged)" in out
    assert "llama3-8b/bf16                   not measured" in out  # not requested: listed, not failed
    assert compare_e2e.main([new, "--old", old, "--shapes", "qwen2.5-0.5b", "--variants", "bf16,w4a16"]) == 1
    assert compare_e2e.main([new, "--old", old, "--shapes", "qwen2.5-0.5b", "--variants", "bf16"]) == 0
    both = [_row(scale=1.01), _row(variant="w4a16", scale=1.02), llama]
    new, old = _files(tmp_path, [_row(), w4, llama], both, requested=REQ)
    assert compare_e2e.main([new, "--old", old, "--requested"]) == 0


def test_compare_requested_fails_a_failed_or_absent_row(tmp_path, capsys):
    failures = [{"model_shape": "qwen2.5-0.5b", "variant": "w4a16", "kind": "failed", "error": "RuntimeError: x"}]
    # a stale w4a16 row from an earlier run in the same folder: the failure recorded by this run decides
    new, old = _files(tmp_path, [_row()], [_row(scale=1.01), _row(variant="w4a16")], requested=REQ, failures=failures)
    assert compare_e2e.main([new, "--old", old, "--requested"]) == 1
    assert "FAIL: requested, not measured in this run (failed in this run: RuntimeError: x)" in capsys.readouterr().out
    new, old = _files(tmp_path, [_row()], [_row(scale=1.01)], requested=REQ)  # absent, no committed row
    assert compare_e2e.main([new, "--old", old, "--requested"]) == 1
    assert "(absent)" in capsys.readouterr().out
    assert compare_e2e.main([new, "--old", old, "--strict"]) == 0  # strict: committed rows only (bf16 is new)
    new, old = _files(tmp_path, [_row()], [_row(scale=1.01)])  # an e2e file without the requested list
    assert compare_e2e.main([new, "--old", old, "--requested"]) == 2
    assert compare_e2e.main([new, "--old", old, "--shapes", "qwen2.5-0.5b"]) == 2  # --variants missing


def test_e2e_file_feeds_compare_requested(stub_gpu, tmp_path, monkeypatch):
    """The two together, as run_gpu.sh runs them: a crashed variant fails e2e_gpu.py and compare_e2e --requested."""
    def run_variant(model_dir, args, vocab, shape):
        if model_dir.name == "gptq":
            raise RuntimeError("boom")
        return {"decode_tok_s_bs1": 1000.0, "decode_tok_s_bs16": 9000.0, "ttft_ms": 10.0}

    monkeypatch.setattr(e2e_gpu, "run_variant", run_variant)
    committed = tmp_path / "committed.json"
    committed.write_text(json.dumps({"rows": [_row(), _row(variant="w4a16"), _row(shape="smollm2-135m"),
                                              _row(shape="smollm2-135m", variant="w4a16")]}))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "e2e-stub-gpu.json").write_text(committed.read_text())  # e2e starts from the committed rows
    assert e2e_gpu.main(stub_gpu) == 1
    new = str(tmp_path / "out" / "e2e-stub-gpu.json")
    assert compare_e2e.main([new, "--old", str(committed)]) == 0  # the w4a16 rows only listed as not measured
    assert compare_e2e.main([new, "--old", str(committed), "--requested"]) == 1
    assert os.path.exists(new)


def test_a_table_variant_refuses_layers_that_fell_back(monkeypatch):
    """w4a16-mma / w4a16-swap rows must measure their table's kernels: a layer that fell back (extension unbuilt)
    fails the variant, naming what runs, instead of reporting another kernel's numbers under its name."""
    import e2e_gpu

    mma_desc = "224 x gptq 4-bit, lqe-w4a16-mma (bits=4, group_size=128, sym, K=4096, N=6144; M<=256: lqe-w4a16-mma)"
    wna_desc = "224 x gptq 4-bit, lqe-wna16 (bits=4, group_size=128, sym, K=4096, N=6144; M<=256: triton-wna16)"
    monkeypatch.delenv("LQE_WNA16_TABLE", raising=False)
    e2e_gpu.check_table_honoured(wna_desc)  # the default table: nothing to check
    with e2e_gpu.variant_env("w4a16-mma"):
        e2e_gpu.check_table_honoured(mma_desc)
        with pytest.raises(RuntimeError, match="LQE_WNA16_TABLE=mma: no layer runs lqe-w4a16-mma; the layers run: 224"):
            e2e_gpu.check_table_honoured(wna_desc)
    with e2e_gpu.variant_env("w4a16-mma-k2"):  # its layers' table rows name the k2 GEMM, not the 4-warp one
        with pytest.raises(RuntimeError, match="mma-k2"):
            e2e_gpu.check_table_honoured(mma_desc)
        e2e_gpu.check_table_honoured(mma_desc.replace("M<=256: lqe-w4a16-mma)", "M<=256: lqe-w4a16-mma-k2)"))
    with e2e_gpu.variant_env("w4a16-swap"):
        with pytest.raises(RuntimeError, match="swap"):
            e2e_gpu.check_table_honoured(wna_desc)
        e2e_gpu.check_table_honoured(wna_desc.replace("triton-wna16)", "triton-wna16-swap)"))
    from lqe.kernels import device_info

    for variant in ("bf16-pdl", "w4a16-pdl", "w4a16-ring-pdl", "w8a8-pdl", "fp8-pdl"):  # -pdl rows run with PDL
        assert e2e_gpu.VARIANTS[variant] == e2e_gpu.VARIANTS[variant.removesuffix("-pdl")]
        with e2e_gpu.variant_env(variant):
            assert os.environ["LQE_PDL"] == "1"
            desc = wna_desc.replace("triton-wna16)", "lqe-wna16-ring)") if "ring" in variant else wna_desc
            monkeypatch.setattr(device_info, "pdl_supported", lambda device: False)
            with pytest.raises(RuntimeError, match="LQE_PDL=1: programmatic dependent launch needs"):
                e2e_gpu.check_table_honoured(desc)
            monkeypatch.setattr(device_info, "pdl_supported", lambda device: True)
            e2e_gpu.check_table_honoured(desc)
        assert "LQE_PDL" not in os.environ
    monkeypatch.setattr(device_info, "pdl_supported", lambda device: True)  # (an sm_90+ GPU, where PDL is the default)
    assert device_info.pdl_enabled(e2e_gpu.torch.device("cuda"))
    for variant in ("bf16-nopdl", "w4a16-nopdl", "w8a8-nopdl", "fp8-nopdl"):  # -nopdl rows: the default turned off
        assert e2e_gpu.VARIANTS[variant] == e2e_gpu.VARIANTS[variant.removesuffix("-nopdl")]
        with e2e_gpu.variant_env(variant):
            assert os.environ["LQE_PDL"] == "0" and not device_info.pdl_enabled(e2e_gpu.torch.device("cuda"))
            e2e_gpu.check_table_honoured(wna_desc)
        assert "LQE_PDL" not in os.environ
