"""Smoke tests of the accuracy, latency and accuracy-vs-throughput benchmarks on a tiny model, and the perplexity
and full-distribution scoring of lqe.eval against HF transformers."""
from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

from helpers import hf_logprobs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

TEXT = ("The tower is 324 metres tall, about the same height as an 81-storey building.\n"
        "It was the first structure to reach a height of 300 metres.\n") * 12


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT)
    return str(path)


@pytest.fixture(scope="module")
def eval_llm(tiny_llama_dir):
    from lqe import LLM

    return LLM(tiny_llama_dir, kv_cache_memory_bytes=32 << 20, max_model_len=256, max_num_batched_tokens=40)


def test_windows_follow_the_protocol(eval_llm, text_file):
    from lqe.eval import load_windows, make_windows

    tok = eval_llm.get_tokenizer()
    ids = tok("\n\n".join(TEXT.splitlines()))["input_ids"]
    ws = load_windows(tok, text_file, 48, None)
    assert len(ws) == len(ids) // 48 and all(len(w) == 48 for w in ws)
    assert sum(ws, []) == ids[:48 * len(ws)]
    assert len(load_windows(tok, text_file, 48, 2)) == 2
    with pytest.raises(ValueError, match="fewer than one window"):
        make_windows([1, 2, 3], 8)


def test_perplexity_matches_hand_computed_hf(eval_llm, tiny_llama_dir, text_file):
    """exp(mean NLL) from the engine's prompt_logprobs equals the value computed independently from HF logits;
    the full distributions of lqe.eval.window_logprobs (prefilled in chunks of 40 tokens) match HF's too."""
    from lqe.eval import compare, load_windows, perplexity, window_logprobs

    ws = load_windows(eval_llm.get_tokenizer(), text_file, 96, 2)
    nll, n = 0.0, 0
    for w in ws:
        lp = hf_logprobs(tiny_llama_dir, w)
        nll -= sum(float(lp[p - 1, w[p]]) for p in range(1, len(w)))
        n += len(w) - 1
    expected = math.exp(nll / n)
    r = perplexity(eval_llm, ws)
    assert (r.tokens, r.windows) == (n, 2)
    assert r.ppl == pytest.approx(expected, rel=1e-4)
    full = window_logprobs(eval_llm.llm_engine, ws[0])
    assert full.shape == (96, eval_llm.llm_engine.model_config.vocab_size)
    torch.testing.assert_close(full, hf_logprobs(tiny_llama_dir, ws[0]), atol=2e-4, rtol=1e-4)
    assert eval_llm.llm_engine.block_manager.num_free_blocks == eval_llm.llm_engine.block_manager.num_blocks
    c = compare(eval_llm.llm_engine, eval_llm.llm_engine, ws)
    assert c.ppl == pytest.approx(r.ppl, rel=1e-6) and c.kl == pytest.approx(0.0, abs=1e-9) and c.top1_agree == 1.0


def test_accuracy_script(tiny_llama_dir, text_file, tmp_path):
    import accuracy

    out = tmp_path / "acc.json"
    res = accuracy.main(["--model", tiny_llama_dir, "--dataset", text_file, "--seq-len", "64", "--max-windows", "2",
                         "--hf-check", "--reference", tiny_llama_dir, "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["windows"] == 2 and data["tokens"] == 2 * 63 and data["seq_len"] == 64
    assert isinstance(data["ppl"], float) and data["ppl"] > 1
    assert data["hf_match_4_significant"] and data["hf_rel_diff"] < 1e-4
    assert data["kl"] == pytest.approx(0.0, abs=1e-9) and data["top1_agree"] == 1.0
    assert data["env"]["torch"] == torch.__version__ and res["ppl"] == data["ppl"]


def test_latency_script(tiny_llama_dir, tmp_path):
    import latency

    out = tmp_path / "lat.json"
    latency.main(["--model", tiny_llama_dir, "--batch-sizes", "1,3", "--prompt-len", "8", "--gen-len", "5",
                  "--reps", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        assert r["ttft_s"] > 0 and r["decode_tok_s"] > 0 and r["weight_gb_s"] > 0 and r["weight_bytes"] > 0


def test_accuracy_vs_throughput_script(tiny_llama_dir, text_file, tmp_path):
    import accuracy_vs_throughput as avt

    args = ["--model", tiny_llama_dir, "--variants", "float,rtn-w4g64-asym,float-kv-fp8-e4m3", "--out", str(tmp_path / "res"),
            "--dataset", text_file, "--max-windows", "2", "--seq-len", "64", "--cache", str(tmp_path / "cache"),
            "--tp-prompts", "2", "--tp-input-len", "8", "16", "--tp-output-len", "4", "8",
            "--latency-prompt-len", "8", "--latency-gen-len", "4"]
    avt.main(args)
    base = tmp_path / "res" / f"{os.path.basename(tiny_llama_dir)}-{avt.device_name()}"
    data = json.loads(base.with_suffix(".json").read_text())
    assert data["model"] == os.path.basename(tiny_llama_dir)
    assert {"torch", "cuda", "lqe_commit", "cpu"} <= data["env"].keys()
    assert data["settings"]["windows"] == 2 and data["settings"]["seq_len"] == 64
    names = [v["name"] for v in data["variants"]]
    assert names == ["float", "rtn-w4g64-asym", "float-kv-fp8-e4m3"]
    for v in data["variants"]:
        for k in ("name", "format", "bits", "ppl", "kl", "top1_agree", "decode_tok_s",
                  "throughput_tok_s", "weight_bytes"):
            assert v[k] is not None, k
    fl, q, kv = data["variants"]
    assert (fl["kv_cache"], kv["kv_cache"], kv["weight_bytes"]) == ("float32", "float8_e4m3fn", fl["weight_bytes"])
    assert kv["kl"] > 0 and any(t["target"].startswith("float-kv-fp8-e4m3") for t in data["targets"])
    assert fl["kl"] == pytest.approx(0.0, abs=1e-9) and fl["top1_agree"] == 1.0
    assert fl["group_size"] is None and q["format"] == "gptq" and q["bits"] == 4 and q["group_size"] == 64 and q["kl"] > 0
    assert q["weight_bytes"] < fl["weight_bytes"]
    assert os.path.getsize(base.with_suffix(".png")) > 1000
    md = base.with_suffix(".md").read_text()
    assert "| rtn-w4g64-asym |" in md and "| float-kv-fp8-e4m3 | float | 32 | – | float8_e4m3fn |" in md
    assert "- `rtn-w4g64-asym`: `--method rtn --format gptq --bits 4 --group-size 64 --asym`" in md
    # the cached checkpoint is reused when the convert command is the same
    ns = avt.argparse.Namespace(cache=str(tmp_path / "cache"), calib=None, calib_samples=16, calib_seq_len=256, seed=0)
    ckpt, convert_s, cmd, calib_s = avt.build_variant("rtn-w4g64-asym", tiny_llama_dir, ns)
    assert convert_s is None and ckpt == str(tmp_path / "cache" / "rtn-w4g64-asym") and "--asym" in cmd


def test_recipe_and_variant_commands():
    import accuracy_vs_throughput as avt

    ns = avt.argparse.Namespace(calib="/data/c.txt", calib_samples=16, calib_seq_len=256, seed=0)
    cmd = avt.convert_command("/m", "/o/x", avt.VARIANTS["gptq-w4g128-sym"], ns)
    assert cmd[1:4] == ["-m", "tools.convert", "quantize"] and "--desc-act" in cmd and "--static-groups" in cmd
    r = avt.recipe(" ".join(cmd[1:]))
    assert r.startswith("--method gptq --format gptq --bits 4 --group-size 128 --sym --desc-act --static-groups")
    assert "/m" not in r and "--calib c.txt" in r
    # the issue-18 accuracy recipes: named (or all as "recipes"), not in the default set; each carries its own
    # calibration size, which the script's --calib-samples / --calib-seq-len do not override
    assert avt.RECIPES == ["gptq-w4g128-sym-rot", "gptq-w4g128-asym-rot", "gptq-w4g64-asym-rot"]
    assert not set(avt.RECIPES) & set(avt.default_variants())
    cmd = avt.convert_command("/m", "/o/x", avt.VARIANTS["gptq-w4g128-asym-rot"], ns)
    assert cmd[cmd.index("--rotate") + 1] == "hadamard" and "--rotate-heads" in cmd
    assert cmd.count("--num-samples") == 1 and cmd[cmd.index("--num-samples") + 1] == "128"
    assert avt.targets([{"name": "float", "ppl": 29.5}, {"name": "gptq-w4g128-sym-rot", "ppl": 33.0}])[0]["met"]
    assert not avt.targets([{"name": "float", "ppl": 29.5}, {"name": "gptq-w4g64-asym-rot", "ppl": 33.0}])[0]["met"]


def test_gptq_reference_names_the_missing_library(monkeypatch, tmp_path):
    """gptqmodel is not an lqe dependency: without it the reference script says how to install it."""
    import sys

    import gptq_reference

    monkeypatch.setitem(sys.modules, "gptqmodel", None)  # import gptqmodel -> ImportError
    with pytest.raises(SystemExit, match="pip install --no-deps gptqmodel"):
        gptq_reference.main(["--out", str(tmp_path / "o")])


@pytest.mark.parametrize("fmt", ["gptq", "w8a8"])
def test_e2e_gpu_quantize_command_runs(fmt, tiny_llama_dir, tmp_path):
    """benchmarks/e2e_gpu.py builds its quantized variants with tools.convert: the command it runs must work
    (it once passed --output where the flag is --out, and every quantized row was skipped)."""
    from pathlib import Path

    import e2e_gpu

    assert e2e_gpu.VARIANTS["w4a16"] == "gptq" and e2e_gpu.VARIANTS["w8a8"] == "w8a8"
    out, why = e2e_gpu.quantize(Path(tiny_llama_dir), fmt, tmp_path / fmt)
    assert out is not None, why
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"], cfg


def test_e2e_gpu_variant_env_is_scoped(monkeypatch):
    """w4a16-mma is the w4a16 checkpoint on dispatch.WNA16_MMA_TABLE: LQE_WNA16_TABLE=mma while that variant's
    engine loads and runs, and what was there before afterwards (the next variant runs the default table)."""
    import e2e_gpu

    from lqe.kernels import dispatch, gemm

    assert e2e_gpu.VARIANTS["w4a16-mma"] == e2e_gpu.VARIANTS["w4a16"]
    monkeypatch.delenv("LQE_WNA16_TABLE", raising=False)
    with e2e_gpu.variant_env("w4a16-mma"):
        assert gemm.active_table() is dispatch.WNA16_MMA_TABLE
    assert "LQE_WNA16_TABLE" not in os.environ and gemm.active_table() is dispatch.WNA16_TABLE
    monkeypatch.setenv("LQE_WNA16_TABLE", "default")
    with pytest.raises(RuntimeError), e2e_gpu.variant_env("w4a16-mma"):
        raise RuntimeError("a failed variant")
    assert os.environ["LQE_WNA16_TABLE"] == "default"
    with e2e_gpu.variant_env("bf16"):
        assert os.environ["LQE_WNA16_TABLE"] == "default"
    with e2e_gpu.variant_env("w4a16-swap"):
        assert gemm.active_table() is dispatch.WNA16_SWAP_TABLE
    assert e2e_gpu.VARIANTS["w4a16-swap"] == "gptq"
    with e2e_gpu.variant_env("w4a16-ring"):
        assert gemm.active_table() is dispatch.WNA16_RING_TABLE
    assert e2e_gpu.VARIANTS["w4a16-ring"] == "gptq"
    with e2e_gpu.variant_env("w4a16-mma-k2"):  # the mma table on the 8-warp k-split GEMM
        assert gemm.active_table() is dispatch.WNA16_MMA_K2_TABLE and gemm.table_uses_mma()
    assert e2e_gpu.VARIANTS["w4a16-mma-k2"] == "gptq"
    monkeypatch.setenv("LQE_WNA16_TABLE", "fastest")
    with pytest.raises(ValueError, match="'mma'.*'mma-k2'.*'swap'"):
        gemm.active_table()


def test_step_host_time_runs_on_cpu(tmp_path):
    """benchmarks/stages/engine.sh's host-time step: it wraps runner methods by name, so a renamed method breaks it
    (it did: ``_sample`` became ``_launch_sample``). A subprocess: the script pins torch to one thread."""
    import subprocess

    out = tmp_path / "host.json"
    subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "step_host_time.py"), "--steps", "2",
                    "--warmup", "1", "--decodes", "4", "--chunk", "32", "--kv-mib", "64", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=300)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["steps_by_path"] == {"decode_graph": 0, "piecewise": 0, "eager": 2}
    assert row["sample_ms"] > 0 and row["forward_ms"] > row["attention_ms"] > 0 and row["schedule_ms"] > 0
    assert row["host_ms_per_step"] >= row["forward_ms"] + row["sample_ms"] and row["ops_per_step"] > 100


def test_serving_benchmark_against_a_tokenizerless_server(tmp_path):
    """benchmarks/serving.py starts ``lqe serve`` and measures TTFT / TPOT; on a checkpoint without a tokenizer (the
    GPU machines have none) every streamed chunk has empty text, and it once counted no token at all."""
    import serving

    from helpers import build_tiny_model

    model = build_tiny_model(str(tmp_path / "model"), tokenizer=False)
    out = tmp_path / "serving.json"
    serving.main(["--model", model, "--num-prompts", "4", "--input-len", "12", "--output-len", "5",
                  "--max-token-id", "250", "--out", str(out), "--startup-timeout", "120",
                  "--server-args", "--kv-cache-memory-bytes", str(16 << 20), "--max-model-len", "64"])
    rep = json.loads(out.read_text())
    assert rep["completed"] == 4 and rep["failed"] == 0, rep["errors"]
    assert all(r["output_tokens"] == 5 and len(r["itl"]) == 4 for r in rep["requests"])
    assert 0 < rep["ttft_ms"]["p50"] <= rep["e2e_ms"]["p50"] and rep["tpot_ms"]["p99"] > 0


def test_e2e_gpu_kernel_busy_glue_on_cpu(tiny_llama_dir):
    """The profiled window of e2e_measure.kernel_busy steps the profiler once per engine step and restores the runner;
    on the CPU there are no CUDA events, so the column is None (on a GPU: kernel union / span)."""
    import e2e_measure

    from lqe import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, max_model_len=128, kv_cache_memory_bytes=16 << 20)
    runner = llm.llm_engine.runner
    from torch.profiler import ProfilerActivity

    row = e2e_measure.kernel_busy(llm, SamplingParams, 2, 200, 0, skip_steps=2, steps=3, lo=10, hi=40,
                                  activities=[ProfilerActivity.CPU])  # a CPU build refuses a CUDA-only profiler
    assert row["gpu_kernel_busy_256"] is None and row["kernel_busy_gpu_events"] == 0 and row["kernel_busy_requests"] == 2
    assert row["kernel_busy_top"] == []  # no CUDA events: nothing to break down
    # one profiler step per engine step, and no step after the window (2 skipped + 2 warm-up + 3 active): the rest of
    # the 2 requests (10-40 new tokens) is aborted
    assert row["kernel_busy_steps_run"] == 7 and not llm.llm_engine.has_unfinished()
    assert "execute" not in vars(runner) and "execute_async" not in vars(runner)  # the class methods again


def _host_time_args(**kw):
    import argparse

    return argparse.Namespace(**{"device": "cpu", "dtype": "float32", "decodes": 3, "chunk": 13, "steps": 2,
                                 "warmup": 1, "kv_mib": 16, "path": "eager", **kw})


@pytest.fixture(scope="module")
def host_time_model(tmp_path_factory):
    """step_host_time's smollm2 shape at 1/8 of its widths (30 layers, as on the GPU)."""
    import step_host_time

    from common import write_random_checkpoint

    cfg, model_cls = step_host_time.scaled_config("smollm2-135m", 8)
    return str(write_random_checkpoint(cfg, model_cls, tmp_path_factory.mktemp("host") / "model", seed=0))


def test_step_host_time_splits_the_piecewise_step(host_time_model, monkeypatch):
    """On the piecewise path the forward is PiecewiseRunner.run (neither model.forward nor Attention.forward runs): its
    replay is forward_ms, attention_ms its Attention.attend calls, not other_ms (both were 0 before). The pieces are
    recorded on the CPU (RecordingBackend); every request is greedy (the sampler's random path syncs on CUDA)."""
    import step_host_time

    from lqe.engine.graph_backends import RecordingBackend
    from lqe.engine.llm_engine import LLMEngine

    temps = []
    add = LLMEngine.add_request
    monkeypatch.setattr(LLMEngine, "add_request",
                        lambda self, rid, prompt, params, *a, **k: temps.append(params.temperature)
                        or add(self, rid, prompt, params, *a, **k))
    row = step_host_time.measure(host_time_model, _host_time_args(path="piecewise"), RecordingBackend())
    assert row["steps_by_path"] == {"decode_graph": 0, "piecewise": 2, "eager": 0}
    assert row["piecewise_buckets"] == [16] and row["seqs_per_step"] == [4] and row["tokens_per_step"] == [16]
    assert row["forward_ms"] > row["attention_ms"] > 0 and row["forward_rest_ms"] > 0
    assert row["other_ms"] < row["forward_ms"] / 4, row  # the replay is no longer left in other_ms
    assert temps and set(temps) == {0}, temps
    eager = step_host_time.measure(host_time_model, _host_time_args())
    assert eager["steps_by_path"]["eager"] == 2 and eager["forward_ms"] > eager["attention_ms"] > 0


def test_step_host_time_256_row_config():
    """engine.sh's 256-row step (--decodes 255 beside the 224-token prompt): 256 sequences and 479 tokens a step,
    the decodes' KV (qwen2.5-0.5b: 12 KiB a token) well inside the default 512 MiB."""
    import step_host_time

    cfg = step_host_time.engine_config("unused", _host_time_args(decodes=255, chunk=224, kv_mib=512))
    assert cfg.max_num_seqs == 256 and cfg.max_num_batched_tokens == 479 and cfg.max_cudagraph_batch >= 256
    kv_token = 24 * 2 * 2 * 64 * 2  # layers x (K, V) x kv heads x head_dim x bf16
    blocks = (512 << 20) // (16 * kv_token)
    assert blocks >= 255 * -(-(16 + 1 + 20 + 2 + 8) // 16) + -(-225 // 16)


class _FakeEvent:
    """A CUDA event on the CPU: ``record`` notes its place in the call log and a clock that advances 1 ms a call."""
    log: list = []

    def record(self) -> None:
        self.t = len(_FakeEvent.log)
        _FakeEvent.log.append("event")

    def elapsed_time(self, end: "_FakeEvent") -> float:
        return float(end.t - self.t)


def test_e2e_gpu_busy_spans_start_after_the_inputs(tiny_llama_dir):
    """gpu_busy_256's events, with fake events on the CPU: each step's span starts after its inputs are enqueued
    (StepInputBuilder.fill returned) and ends after its sampled tokens' device-to-host copy (to_host_start), so the
    host's input building and bookkeeping are outside; one span per step; the runner's methods are restored."""
    import e2e_measure

    from lqe import LLM, SamplingParams

    llm = LLM(tiny_llama_dir, max_model_len=128, kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=32)
    runner = llm.llm_engine.runner
    log = _FakeEvent.log
    log.clear()
    fill, to_host = runner.inputs.fill, runner.to_host_start
    runner.inputs.fill = lambda *a, **k: (log.append("fill"), fill(*a, **k))[1]
    runner.to_host_start = lambda *a, **k: (log.append("to_host"), to_host(*a, **k))[1]
    mine = runner.inputs.fill, runner.to_host_start
    t = e2e_measure.throughput_256(llm, SamplingParams, 3, 200, 0, lo=40, hi=60, event=_FakeEvent)
    assert (vars(runner.inputs)["fill"], vars(runner)["to_host_start"]) == mine  # what was there before
    assert not {"execute", "execute_async"} & set(vars(runner))  # the class's methods again
    assert t["out_tokens"] == sum(r.output_len for r in t["requests"]) and t["steps"] > 20
    steps = "".join({"fill": "f", "event": "e", "to_host": "h"}[x] for x in log)
    # per step: fill, start event, (prefill chunks that sample nothing: end event at return) or to_host, end event
    assert steps.count("e") == 2 * t["steps"] and steps.replace("fehe", "").replace("fee", "") == "", steps
    assert "fee" in steps and "fehe" in steps  # 40-60-token prompts in 32-token steps: a first chunk samples nothing
    assert t["gpu_s"] == pytest.approx((2 * steps.count("fehe") + steps.count("fee")) / 1e3)  # 1 ms a log entry


def test_benchmark_commit_from_the_environment(monkeypatch):
    """A GPU machine's copy of the tree may have no .git: LQE_COMMIT names the commit measured."""
    import common

    monkeypatch.setenv("LQE_COMMIT", "abc1234")
    assert common.commit() == "abc1234" and common.env_info()["lqe_commit"] == "abc1234"
    monkeypatch.delenv("LQE_COMMIT")
    assert common.commit() != "abc1234"


def test_e2e_gpu_quick_run_keeps_the_rows_it_does_not_measure(tmp_path, monkeypatch, capsys):
    """``e2e_gpu.py --quick`` runs no llama3-8b row. Writing into an empty --out-dir (the GPU scripts' $OUT), it starts
    from the committed file of the same name, so its file still holds every committed row it did not measure (each
    with its own commit) and the measured ones replaced, stamped with LQE_COMMIT; the run lists the kept rows."""
    import e2e_gpu

    name = "e2e-nvidia-h100-80gb-hbm3.json"
    with open(os.path.join(REPO, "benchmarks", "results", name)) as f:
        committed = json.load(f)
    monkeypatch.setattr(e2e_gpu.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(e2e_gpu.torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(e2e_gpu, "environment", lambda: {"lqe_commit": e2e_gpu.commit()})
    monkeypatch.setattr(e2e_gpu, "build_random_model", lambda shape, out_dir, seed: out_dir)
    monkeypatch.setattr(e2e_gpu, "run_variant", lambda model_dir, args, vocab, shape: {"decode_tok_s_bs1": 1.0})
    monkeypatch.setenv("LQE_COMMIT", "feed123")
    out = tmp_path / "out"
    assert e2e_gpu.main(["--quick", "--variants", "bf16", "--out-dir", str(out), "--work-dir", str(tmp_path)]) == 0
    doc = json.loads((out / name).read_text())
    rows = {(r["model_shape"], r["variant"]): r for r in doc["rows"]}
    old = {(r["model_shape"], r["variant"]): r for r in committed["rows"]}
    assert set(rows) == set(old)
    for key, r in rows.items():
        if key in (("smollm2-135m", "bf16"), ("qwen2.5-0.5b", "bf16")):
            assert r["decode_tok_s_bs1"] == 1.0 and r["commit"] == "feed123" and r["num_requests"] == 32
        else:
            assert r == old[key]  # kept whole: the llama3-8b row of the --quick run among them
    assert doc["env"]["lqe_commit"] == "feed123" and doc["notes"] == committed["notes"]
    assert "not measured in this run: llama3-8b/bf16" in capsys.readouterr().out


def test_e2e_gpu_goes_on_after_a_device_fault(tmp_path, monkeypatch):
    """A variant whose kernel loses the CUDA context: its failure and the fault are written, and the run goes on in
    a fresh process (here: main called again with the --done list the restart passes) with the variants after it,
    leaving out those finished."""
    import json

    import e2e_gpu

    lost, ran, restarts = [], [], []
    monkeypatch.setattr(e2e_gpu.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(e2e_gpu.torch.cuda, "get_device_name", lambda *a: "Stub GPU")
    monkeypatch.setattr(e2e_gpu, "environment", lambda: {"gpu": "Stub GPU"})
    monkeypatch.setattr(e2e_gpu, "build_random_model", lambda shape, out, seed: tmp_path / shape / "bf16")
    monkeypatch.setattr(e2e_gpu, "quantize", lambda src, fmt, out: (out, ""))
    monkeypatch.setattr(e2e_gpu, "cuda_fault", lambda: "AcceleratorError: CUDA error: an illegal memory access"
                        if lost else None)

    def restart(extra):  # the real one replaces the process (os.execv) and never returns
        restarts.append(extra)
        raise SystemExit("restarted")

    monkeypatch.setattr(e2e_gpu, "restart", restart)

    def run_variant(model_dir, args, vocab, shape):
        variant = model_dir.name
        ran.append(f"{shape}/{variant}")
        if lost:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if variant == "gptq" and shape == "smollm2-135m":
            lost.append(1)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {"decode_bs1_tok_s": 1.0}

    monkeypatch.setattr(e2e_gpu, "run_variant", run_variant)
    argv = ["--shapes", "smollm2-135m,qwen2.5-0.5b", "--variants", "bf16,w4a16", "--out-dir", str(tmp_path),
            "--work-dir", str(tmp_path / "work")]
    with pytest.raises(SystemExit, match="restarted"):
        e2e_gpu.main(argv)
    out = tmp_path / "e2e-stub-gpu.json"
    assert restarts == [["--done", "smollm2-135m/bf16,smollm2-135m/w4a16"]]
    assert json.loads(out.read_text())["device_faults"][0]["variant"] == "w4a16"  # written before the restart
    lost.clear()
    ran.clear()
    assert e2e_gpu.main(argv + restarts[0]) == 1  # the run lost a row: its last process fails
    assert ran == ["qwen2.5-0.5b/bf16", "qwen2.5-0.5b/gptq"]  # the fresh process: only what was not done
    # (a variant's checkpoint folder is named after its format: w4a16 is the gptq checkpoint)
    doc = json.loads(out.read_text())
    got = {(r["model_shape"], r["variant"]) for r in doc["rows"]}
    assert {("smollm2-135m", "bf16"), ("qwen2.5-0.5b", "bf16"), ("qwen2.5-0.5b", "w4a16")} <= got
    assert ("smollm2-135m", "w4a16") not in got
    assert [(f["model_shape"], f["variant"]) for f in doc["device_faults"]][0] == ("smollm2-135m", "w4a16")
