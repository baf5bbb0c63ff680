"""Streaming calibration (one decoder layer read from the shards onto the device at a time) writes exactly the
checkpoint of the whole-model path; it never holds two layers; it places every tensor on the calibration device
(checked on a simulated second device); --device cuda without a GPU fails before any model is read."""
import json
import os
import shutil
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from devsim import SIM_DEVICE, DeviceSim
from tools.convert import ConvertError, ExportSpec
from tools.convert.export import linear_names
from tools.convert.quantize import CalibOptions, calibrate, quantize_checkpoint
from tools.convert.streaming import StreamedModel, resolve_device
from tools.convert.writer import CheckpointReader, writer_tensors

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU = torch.device("cpu")
# (architecture, method, ExportSpec fields, CalibOptions fields)
CASES = {
    "llama-gptq": ("llama", "gptq", dict(fmt="gptq", group_size=32), {}),
    "llama-gptq-drift-act": ("llama", "gptq", dict(fmt="gptq", group_size=32, desc_act=True, static_groups=True,
                                                   mse=True, drift_alpha=0.25), {}),
    "llama-awq": ("llama", "awq", dict(fmt="awq", group_size=32, sym=False), dict(awq_clip=True, awq_tokens=40)),
    "llama-smoothquant": ("llama", "smoothquant", dict(fmt="w8a8", bits=8, group_size=-1), {}),
    "llama-rtn": ("llama", "rtn", dict(fmt="gptq", group_size=32), {}),
    "qwen2-gptq-act-lmhead": ("qwen2", "gptq", dict(fmt="gptq_v2", group_size=32, sym=False, desc_act=True,
                                                    quantize_lm_head=True, true_sequential=False), {}),
    "qwen2-gptq-drift": ("qwen2", "gptq", dict(fmt="gptq", group_size=32, drift_alpha=0.5), {}),
    "qwen2-awq-duo": ("qwen2", "awq", dict(fmt="awq", group_size=32, sym=False), dict(awq_duo=True)),
    "qwen2-smoothquant": ("qwen2", "smoothquant", dict(fmt="w8a8", bits=8, group_size=-1), {}),
    "qwen2-rtn-lmhead": ("qwen2", "rtn", dict(fmt="gptq", group_size=32, quantize_lm_head=True), {}),
}


def _ids(n: int = 5, t: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (n, t), generator=torch.Generator().manual_seed(seed))


def _opts(**kw) -> CalibOptions:
    return CalibOptions(num_samples=5, seq_len=24, batch_size=2, device="cpu", **kw)  # 3 batches, the last short


def _tensors(d: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def assert_same_checkpoint(a: str, b: str) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    differ = [k for k in ta if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    assert not differ, f"{len(differ)} tensors differ: {differ[:5]}"
    for f in ("config.json", "model.safetensors.index.json"):
        pa, pb = os.path.join(a, f), os.path.join(b, f)
        assert os.path.exists(pa) == os.path.exists(pb)
        if os.path.exists(pa):
            with open(pa) as fa, open(pb) as fb:
                assert json.load(fa) == json.load(fb)
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))


@pytest.fixture(scope="module")
def models(tiny_llama_dir, tiny_qwen2_dir):
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}


@pytest.mark.parametrize("case", list(CASES))
def test_streaming_writes_the_whole_model_checkpoint(models, tmp_path, case):
    arch, method, spec_kw, opts_kw = CASES[case]
    outs = {}
    for stream in (False, True):
        outs[stream] = str(tmp_path / f"stream-{stream}")
        _, res = quantize_checkpoint(models[arch], outs[stream], method, ExportSpec(**spec_kw), _opts(**opts_kw),
                                     stream=stream, input_ids=_ids())
        layers = 2
        assert len(res.layer_errors) == layers and len(res.layer_seconds) == layers
        assert all(e is not None and 0 < e < 1 for e in res.layer_errors), res.layer_errors
    assert_same_checkpoint(outs[False], outs[True])


def _shard_round_robin(src: str, dst: str, shards: int = 3) -> str:
    """``src`` in bf16, its tensors dealt round-robin over ``shards`` files (so a layer spans several) + index."""
    os.makedirs(dst)
    sd = load_file(os.path.join(src, "model.safetensors"))
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    parts: list[dict] = [{} for _ in names]
    weight_map = {}
    for i, (k, t) in enumerate(sd.items()):
        parts[i % shards][k] = t.to(torch.bfloat16)
        weight_map[k] = names[i % shards]
    for name, part in zip(names, parts):
        save_file(part, os.path.join(dst, name), metadata={"format": "pt"})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f != "config.json":
            shutil.copy(os.path.join(src, f), dst)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def test_multi_shard_bf16_checkpoint_streams(tiny_qwen2_dir, tmp_path):
    """A bf16 checkpoint whose layers span three shards: the same output as the whole-model path, written in bf16
    and split again (--max-shard-size), and with --float-dtype fp16 (bf16 -> fp32 -> fp16 exactly as before)."""
    src = _shard_round_robin(tiny_qwen2_dir, str(tmp_path / "sharded"))
    reader = CheckpointReader(src)
    assert len(set(reader.files.values())) == 3
    layer0 = {reader.files[k] for k in reader.keys() if k.startswith("model.layers.0.")}
    assert len(layer0) == 3  # one layer's tensors come from every shard
    for extra in (dict(max_shard_size=4_000_000, quantize_lm_head=True), dict(float_dtype=torch.float16)):
        outs = {}
        for stream in (False, True):
            outs[stream] = str(tmp_path / f"out-{stream}-{len(extra)}")
            spec = ExportSpec(fmt="gptq", group_size=32, desc_act=True, **extra)
            quantize_checkpoint(src, outs[stream], "gptq", spec, _opts(), stream=stream, input_ids=_ids())
        assert_same_checkpoint(outs[False], outs[True])
    t = _tensors(outs[True])
    assert t["model.embed_tokens.weight"].dtype == torch.float16
    assert len([f for f in os.listdir(str(tmp_path / "out-True-2")) if f.endswith(".safetensors")]) > 1


def _real_layers(source: StreamedModel) -> int:
    return sum(any(not p.is_meta for p in layer.parameters()) for layer in source.layers)


@pytest.mark.parametrize("method,spec_kw", [("gptq", dict(fmt="gptq", group_size=32, drift_alpha=0.25)),
                                            ("awq", dict(fmt="awq", group_size=32, sym=False))])
def test_one_decoder_layer_at_a_time(tiny_qwen2_dir, method, spec_kw):
    """Counted at every forward of every module inside the layers and at every layer load: never more than one
    decoder layer holds real (non-meta) weights; the untied lm_head stays unread until the layers are done."""
    source = StreamedModel(tiny_qwen2_dir, CPU)
    assert _real_layers(source) == 0 and source.model.lm_head.weight.is_meta
    assert not source.model.model.embed_tokens.weight.is_meta
    seen, head_meta = [], []
    hooks = [m.register_forward_pre_hook(lambda *a: seen.append(_real_layers(source)))
             for layer in source.layers for m in layer.modules()]
    load = source._load

    def counted_load(i):
        assert _real_layers(source) == 0, f"layer {i} arrives while another is still materialized"
        head_meta.append(source.model.lm_head.weight.is_meta)
        return load(i)

    source._load = counted_load
    spec = ExportSpec(**spec_kw)
    names = linear_names(source.reader.meta)
    res = calibrate(source, _ids(), method, spec, _opts(), names)
    for h in hooks:
        h.remove()
    assert len(seen) > 10 and max(seen) == 1
    assert _real_layers(source) == 0 and all(head_meta) and not source.model.lm_head.weight.is_meta
    assert set(res.canon) == set(names) and all(cw.codes.device.type == "cpu" for cw in res.canon.values())
    state = source.float_state(res.canon)
    assert not any(k.rpartition(".")[0] in res.canon and k.endswith(".weight") for k in state)
    assert "model.layers.1.input_layernorm.weight" in state and "lm_head.weight" in state


@pytest.mark.parametrize("method,spec_kw", [("gptq", dict(fmt="gptq", group_size=32, drift_alpha=0.25)),
                                            ("awq", dict(fmt="awq", group_size=32, sym=False))])
def test_progress_probe_changes_nothing(tiny_llama_dir, monkeypatch, method, spec_kw):
    """The progress bar's error probe runs the float layer on a few sequences: the method's statistics hooks must not
    see that forward (the codes equal those of a run without the probe)."""
    import tools.convert.streaming as streaming

    spec = ExportSpec(**spec_kw)
    names = linear_names(CheckpointReader(tiny_llama_dir).meta)
    with_probe = calibrate(StreamedModel(tiny_llama_dir, CPU), _ids(), method, spec, _opts(), names)

    class NoProbe:
        def __init__(self, runner):
            pass

        def error(self):
            return None

    monkeypatch.setattr(streaming, "LayerErrorProbe", NoProbe)
    without = calibrate(StreamedModel(tiny_llama_dir, CPU), _ids(), method, spec, _opts(), names)
    assert all(e is not None for e in with_probe.layer_errors) and without.layer_errors == [None, None]
    assert all(torch.equal(cw.codes, without.canon[n].codes) and torch.equal(cw.scales, without.canon[n].scales)
               for n, cw in with_probe.canon.items())


def test_tied_head_is_written_only_when_untied(tiny_llama_dir):
    """The skeleton keeps a tied lm_head tied to the real embedding (nothing extra written); a transform that unties
    it (assigns a new lm_head.weight, as a rotation does) gets it written, and finish() does not tie it again."""
    source = StreamedModel(tiny_llama_dir, CPU)
    model = source.model
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.weight.is_meta
    source.capture_done()
    source.finish()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in writer_tensors(source.reader, source.float_state({}), {})
    emb = model.model.embed_tokens.weight
    model.lm_head.weight = torch.nn.Parameter(emb.detach() * 2, requires_grad=False)
    source.finish()
    assert model.lm_head.weight is not emb
    sd = writer_tensors(source.reader, source.float_state({}), {})
    assert torch.equal(sd["lm_head.weight"], emb.detach() * 2) and torch.equal(sd["model.embed_tokens.weight"], emb)


@pytest.mark.parametrize("arch,method,spec_kw,opts_kw", [
    ("llama", "gptq", dict(fmt="gptq", group_size=32, desc_act=True, static_groups=True, mse=True, drift_alpha=0.25),
     dict(offload_activations=True)),
    ("qwen2", "gptq", dict(fmt="gptq", group_size=32, drift_alpha=0.5), {}),
    ("qwen2", "awq", dict(fmt="awq", group_size=32, sym=False), dict(awq_clip=True, awq_duo=True, awq_tokens=24)),
    ("qwen2", "smoothquant", dict(fmt="w8a8", bits=8, group_size=-1, quantize_lm_head=True),
     dict(offload_activations=True)),
])
def test_every_tensor_lives_on_the_calibration_device(models, arch, method, spec_kw, opts_kw):
    """On a simulated second device (devsim), no op of the streaming calibration meets a tensor made on the host
    (a factory without device=): what CUDA would refuse. The activations offloaded to the host and copied back
    for each forward change nothing: the same codes as a plain CPU run."""
    source = StreamedModel(models[arch], SIM_DEVICE)
    spec = ExportSpec(**spec_kw)
    spec.validate()
    names = linear_names(source.reader.meta, spec.quantize_lm_head)
    with DeviceSim() as sim:
        res = calibrate(source, _ids(), method, spec, _opts(**opts_kw), names)
    assert not sim.mixed, "host tensors met device tensors:\n" + "\n".join(f"{n}x {k}" for k, n in sim.mixed.items())
    plain_kw = {k: v for k, v in opts_kw.items() if k != "offload_activations"}
    plain = calibrate(StreamedModel(models[arch], CPU), _ids(), method, spec, _opts(**plain_kw), names)
    assert all(torch.equal(cw.codes, plain.canon[n].codes) and torch.equal(cw.scales, plain.canon[n].scales)
               for n, cw in res.canon.items())


def test_repeated_kv_attention_matches_sdpa(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from tools.convert.blocks import CALIB_ATTENTION, use_repeated_kv_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    with torch.no_grad():
        want = model(_ids(2, 16)).logits
        use_repeated_kv_attention(model)
        got = model(_ids(2, 16)).logits
    assert model.model.layers[0].self_attn.config._attn_implementation == CALIB_ATTENTION
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_resolve_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == CPU and resolve_device("cpu") == CPU
    with pytest.raises(ConvertError, match="no CUDA GPU is visible"):
        resolve_device("cuda:0")
    with pytest.raises(ConvertError, match="expected auto, cpu, cuda or cuda:N"):
        resolve_device("gpu")
    with pytest.raises(ConvertError, match="calibration runs on"):
        resolve_device("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("auto") == torch.device("cuda", 0) == resolve_device("cuda")
    with pytest.raises(ConvertError, match=r"only 1 CUDA device\(s\)"):
        resolve_device("cuda:3")


def test_device_cuda_without_gpu_fails_before_any_model_is_read(monkeypatch, tmp_path, capsys):
    import tools.convert.quantize as q
    import tools.convert.writer as w
    from tools.convert.cli import main

    def read(*a, **k):
        pytest.fail("a model was read")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(w, "CheckpointReader", read)
    monkeypatch.setattr(q, "quantize_checkpoint", read)
    missing = str(tmp_path / "no-such-model")
    assert main(["quantize", "--model", missing, "--out", str(tmp_path / "o"), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda: no CUDA GPU is visible" in err and "Traceback" not in err
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConvertError, match="no CUDA GPU is visible"):
        quantize_checkpoint(missing, str(tmp_path / "o"), "rtn", ExportSpec(), device="cuda:1")


def test_cli_quantize_on_cpu_streams(tiny_llama_dir, tmp_path):
    """The CLI with --device cpu and calibration text: the same checkpoint as the whole-model path."""
    from tools.convert.cli import main

    calib = tmp_path / "c.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 30)
    out = str(tmp_path / "cli")
    assert main(["quantize", "--model", tiny_llama_dir, "--out", out, "--method", "gptq", "--group-size", "32",
                 "--calib", str(calib), "--num-samples", "3", "--seq-len", "24", "--batch-size", "2",
                 "--device", "cpu"]) == 0
    opts = CalibOptions(calib=str(calib), num_samples=3, seq_len=24, batch_size=2)
    quantize_checkpoint(tiny_llama_dir, str(tmp_path / "ref"), "gptq", ExportSpec(fmt="gptq", group_size=32), opts,
                        stream=False)
    assert_same_checkpoint(out, str(tmp_path / "ref"))
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: still tied


def test_calibration_benchmark_quick_runs_on_cpu(tmp_path):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import calibration_gpu

    out = tmp_path / "calib.json"
    assert calibration_gpu.main(["--quick", "--device", "cpu", "--methods", "gptq-sym,rtn,recipe-asym", "--out",
                                 str(out), "--work-dir", str(tmp_path / "work")]) == 0
    data = json.loads(out.read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert set(rows) == {"gptq-sym", "rtn", "recipe-asym"} and data["env"]["torch"] == torch.__version__
    g = rows["gptq-sym"]
    assert g["layers"] == 2 and g["calib_seconds"] > 0 and g["floor"]["hessian_tflop"] > 0
    assert g["floor"]["gptq_columns"] == 3 * 128 + 128 + 2 * 128 + 256 and g["floor_s_per_layer"] > 0
    assert 0 < g["mean_layer_error"] < 1 and g["device"] == "cpu" and g["flags"] == {}
    # the README's asym recipe, flag for flag, with its extra work in the floor: the float stream's forward and
    # drift sums, two refinement passes over every column, the float64 drift / rotation / refit work
    r = rows["recipe-asym"]
    assert r["quant_method"] == "gptq" and not r["sym"] and r["desc_act"] and r["group_size"] == 64
    assert r["flags"] == {"mse": True, "drift_alpha": 0.25, "rotate": "hadamard", "rotate_heads": True,
                          "refine_passes": 2}
    assert r["floor"]["gptq_columns"] == 3 * g["floor"]["gptq_columns"]
    assert r["floor"]["hessian_tflop"] == pytest.approx(2 * g["floor"]["hessian_tflop"])
    assert r["floor"]["forward_tflop"] > g["floor"]["forward_tflop"]
    assert r["floor"]["fp64_tflop"] > 10 * g["floor"]["fp64_tflop"]
    assert 0 < r["mean_layer_error"] < 1


RESUME_CASES = {
    "gptq-drift-act-offload": ("llama", "gptq", dict(fmt="gptq", group_size=32, desc_act=True, drift_alpha=0.25),
                               dict(offload_activations=True)),
    "recipe-asym-rotated-refined": ("qwen2", "gptq", dict(fmt="gptq_v2", group_size=32, sym=False, desc_act=True,
                                                          mse=True, drift_alpha=0.25),
                                    dict(rotate="hadamard", rotate_heads=True, refine_passes=1)),
    "awq": ("llama", "awq", dict(fmt="awq", group_size=32, sym=False), dict(awq_clip=True, awq_tokens=24)),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_a_calibration_stopped_between_layers_resumes_to_the_same_checkpoint(models, tmp_path, case):
    """A LayerCheckpoint whose deadline has passed stops before every layer but a call's first (and before the
    work after the last layer), saving its state; the same calibration run again continues there. Three calls on a
    two-layer model give the checkpoint of one uninterrupted run, tensor for tensor, and record each call."""
    from tools.convert.resume import CalibrationStopped, LayerCheckpoint, resumable

    arch, method, spec_kw, opts_kw = RESUME_CASES[case]
    ref = str(tmp_path / "ref")
    _, want = quantize_checkpoint(models[arch], ref, method, ExportSpec(**spec_kw), _opts(**opts_kw), input_ids=_ids())
    state, out = tmp_path / "state", str(tmp_path / "out")
    key = {"case": case}
    stops = []
    for call in range(5):
        ckpt = LayerCheckpoint(state, key, deadline=time.monotonic() - 1, tail_s=0.0)
        try:
            with resumable(ckpt):
                _, got = quantize_checkpoint(models[arch], out, method, ExportSpec(**spec_kw), _opts(**opts_kw),
                                             overwrite=True, input_ids=_ids())
            break
        except CalibrationStopped as e:
            stops.append(e.next_layer)
            assert not os.path.exists(os.path.join(out, "config.json"))
            assert (state / "state.json").exists() and (state / "acts.bin").stat().st_size > 0
    assert stops == [1, 2] and call == 2  # before layer 1, before the work after layer 1, then to the end
    assert [c["layers"] for c in ckpt.previous_calls] == [[0, 1], [1, 2]]
    assert got.layer_errors == pytest.approx(want.layer_errors, rel=1e-6) and len(got.layer_seconds) == 2
    assert_same_checkpoint(ref, out)


def test_a_saved_calibration_state_is_refused_for_other_settings(tiny_llama_dir, tmp_path):
    from tools.convert.resume import CalibrationStopped, LayerCheckpoint, resumable

    spec = ExportSpec(fmt="gptq", group_size=32)
    with pytest.raises(CalibrationStopped), resumable(LayerCheckpoint(tmp_path / "s", {"group_size": 32},
                                                                      deadline=time.monotonic() - 1)):
        quantize_checkpoint(tiny_llama_dir, str(tmp_path / "o"), "gptq", spec, _opts(), input_ids=_ids())
    with pytest.raises(ConvertError, match=r"other settings \(group_size\).*remove the directory"), \
            resumable(LayerCheckpoint(tmp_path / "s", {"group_size": 64})):
        quantize_checkpoint(tiny_llama_dir, str(tmp_path / "o"), "gptq", spec, _opts(), input_ids=_ids(),
                            overwrite=True)
    with pytest.raises(ConvertError, match="streams the checkpoint"), \
            resumable(LayerCheckpoint(tmp_path / "s", {"group_size": 32})):
        quantize_checkpoint(tiny_llama_dir, str(tmp_path / "o"), "gptq", spec, _opts(), input_ids=_ids(),
                            overwrite=True, stream=False)


def test_calibration_benchmark_resumes_over_calls(tmp_path):
    """``--stop-after-s`` (here already past): each call calibrates one layer (or the tail), saves, exits 3; the
    same command again continues; a finished method's row is kept and not measured again; the row sums the calls."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import calibration_gpu

    out = tmp_path / "calib.json"
    argv = ["--quick", "--device", "cpu", "--methods", "gptq-sym,rtn", "--out", str(out), "--work-dir",
            str(tmp_path / "work"), "--stop-after-s", "0", "--tail-s", "0"]
    codes = [calibration_gpu.main(argv) for _ in range(7)]
    assert codes == [3, 3, 3, 3, 3, 0, 0], codes  # gptq: 3 calls; rtn: 3 calls (it starts only in a fresh call)
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    for r in rows.values():
        assert r["resumed"] and r["calls"] == 3 and len(r["seconds_per_call"]) == 3 and r["layers"] == 2
        assert r["calib_seconds"] == pytest.approx(sum(r["seconds_per_call"]), abs=0.05)
        assert 0 < r["mean_layer_error"] < 1


def test_calibration_memory_plan_of_the_8b_shape():
    """The counted device bytes of issue 27's runs: 128 x 2048 tokens of the 8B shape store 4 GiB of fp32
    activations (8 with drift correction's float stream), which ``auto`` offloads; GPTQ W4 g128 asym act-order then
    plans under the 12 GiB target, its peak in the GPTQ phase (down_proj's 14336^2 float64 Hessian: 1.53 GiB)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import calibration_gpu as cg

    shape = cg.SHAPES["llama3-8b"]
    plans = {(m, off): cg.memory_plan(shape, 128, 2048, 8, m, off) for m in ("gptq-asym-act", "recipe-asym")
             for off in (False, True)}
    assert plans["gptq-asym-act", False]["activations"] == 4 * 2**30
    assert plans["recipe-asym", False]["activations"] == 8 * 2**30
    assert plans["gptq-asym-act", True]["hessian"] == 14336 ** 2 * 8
    for m in ("gptq-asym-act", "recipe-asym"):
        on, off = plans[m, True], plans[m, False]
        assert off["phases"]["capture"] - on["phases"]["capture"] == off["activations"] - 2 * 8 * 2048 * 4096 * 4
        assert on["peak"] < off["peak"] and on["peak_phase"] == "gptq"
    assert plans["gptq-asym-act", True]["peak"] < 12 * 2**30 < plans["recipe-asym", False]["peak"]
    args = cg.argparse.Namespace(offload_activations="auto", num_samples=128, seq_len=2048, batch_size=8,
                                 group_size=128, activations_budget_gib=2.0, device_type="cuda")
    assert cg.resolve_offload(args, "gptq-asym-act", shape)
    args.num_samples = 16  # 0.5 GiB: kept on the device
    assert not cg.resolve_offload(args, "gptq-asym-act", shape)
