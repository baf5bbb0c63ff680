"""fp8 KV cache (``kv_cache_dtype``, issue 29) on CPU: the option, the allocator's byte count, quantized store and
in-place dequantizing reads of the torch reference path, per-layer scales from the first prefill (vLLM's rule)
or from a checkpoint in llm-compressor's ``kv_cache_scheme`` layout, and prefix caching / preemption / the
padded decode path on an fp8 cache."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from lqe import LLM, SamplingParams
from lqe.config import EngineConfig
from lqe.kernels import attention_ref as ref
from lqe.layers.attention import Attention, kv_scale_targets, resolve_kv_cache_dtype

from helpers import build_tiny_model

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
PROMPT = [(7 * i + 3) % 4000 + 5 for i in range(60)]


def _attn(llm) -> list[Attention]:
    return [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, Attention)]


def _prompt_logprobs(llm, prompt=PROMPT) -> torch.Tensor:
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([next(iter(d.values())).logprob for d in out[0].prompt_logprobs[1:]])


def _write_kv_scheme(model_dir: str, scales: dict[int, tuple[float, float]], names=("k_scale", "v_scale")) -> None:
    """Turn ``model_dir`` into a KV-cache-quantized checkpoint as llm-compressor saves one: ``kv_cache_scheme`` in a
    compressed-tensors ``quantization_config`` and ``model.layers.N.self_attn.{k,v}_scale`` tensors."""
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "dense", "quantization_status": "compressed",
        "config_groups": {}, "ignore": ["lm_head"], "kv_cache_scheme": KV_SCHEME, "version": "0.12.0"}
    with open(path, "w") as f:
        json.dump(cfg, f)
    st = os.path.join(model_dir, "model.safetensors")
    sd = load_file(st)
    for i, (k, v) in scales.items():
        sd[f"model.layers.{i}.self_attn.{names[0]}"] = torch.tensor([k], dtype=torch.float32)
        sd[f"model.layers.{i}.self_attn.{names[1]}"] = torch.tensor([v], dtype=torch.float32)
    save_file(sd, st, metadata={"format": "pt"})


@pytest.fixture
def text(tmp_path):
    """A small text file for the accuracy benchmarks' windows."""
    path = tmp_path / "t.txt"
    path.write_text(" ".join(f"word{i % 37} and more text {i}" for i in range(400)))
    return path


@pytest.fixture(scope="module")
def kv_scheme_dir(tmp_path_factory) -> str:
    d = build_tiny_model(str(tmp_path_factory.mktemp("tiny-kv-fp8")), "llama", tokenizer=False)
    _write_kv_scheme(d, {0: (0.03, 0.035), 1: (0.032, 0.04)})
    return d


def test_option_validation():
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'.*fp8_e4m3"):
        EngineConfig(model="m", kv_cache_dtype="int8")
    for name in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
        assert EngineConfig(model="m", kv_cache_dtype=name).kv_cache_dtype == name
    assert resolve_kv_cache_dtype("fp8", {}, torch.bfloat16) == E4M3
    assert resolve_kv_cache_dtype("auto", {}, torch.bfloat16) == torch.bfloat16
    scheme = {"quantization_config": {"kv_cache_scheme": KV_SCHEME}}
    assert resolve_kv_cache_dtype("auto", scheme, torch.bfloat16) == E4M3  # the checkpoint asks for fp8
    assert resolve_kv_cache_dtype("fp8_e5m2", scheme, torch.bfloat16) == E5M2
    from lqe.entrypoints.cli import build_parser

    for cmd in ("generate", "chat", "serve"):
        extra = ["m"] if cmd == "serve" else []
        assert build_parser().parse_args([cmd, *extra, "--kv-cache-dtype", "fp8_e5m2"]).kv_cache_dtype == "fp8_e5m2"
        with pytest.raises(SystemExit):
            build_parser().parse_args([cmd, *extra, "--kv-cache-dtype", "int8"])
        a = build_parser().parse_args([cmd, *extra, "--no-kv-cache-key-rotation", "--cudagraph-mode", "none",
                                       "--async-scheduling"])
        assert (a.kv_cache_key_rotation, a.cudagraph_mode, a.async_scheduling) == (False, "NONE", True)
    with pytest.raises(ValueError, match="strategy 'tensor'"):
        resolve_kv_cache_dtype("auto", {"quantization_config": {"kv_cache_scheme": dict(KV_SCHEME, strategy="attn_head")}},
                               torch.bfloat16)


def test_quantize_saturates_and_round_trips():
    x = torch.randn(64, 2, 32) * 3
    x[0, 0, 0], x[1, 1, 1] = 1e5, -1e5
    scale = torch.tensor([0.05])
    for dt, rel in ((E4M3, 2 ** -4), (E5M2, 2 ** -3)):
        q = ref.quantize_kv(x, scale, dt)
        assert q.dtype == dt and torch.isfinite(q.float()).all()
        m = ref.fp8_max(dt)
        assert float(q[0, 0, 0]) == m and float(q[1, 1, 1]) == -m  # saturated, not inf
        back = ref.dequantize_kv(q, scale)
        inner = (x.abs() < m * 0.05) & (x.abs() > 0.05)  # in range and normal
        assert ((back - x).abs()[inner] <= rel * x.abs()[inner] + 1e-6).all()


@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_reference_reads_fp8_cache_in_place(kv_dtype):
    """Store quantizes; attention over the fp8 cache (decode rows batched, prefill rows over a cached prefix)
    equals attention over a float cache holding the dequantized values."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "gpu"))
    from test_triton_attention import make_case

    q, k, v, cache, meta = make_case([(1, 40), (1, 7), (9, 20), (3, 0)], 6, 2, 32, torch.float32, "cpu", pad_tokens=2)
    ks, vs = torch.tensor([0.013]), torch.tensor([0.021])
    c8 = ref.quantize_kv(cache, ks, kv_dtype)
    before = c8.clone()
    ref.store_kv(k, v, c8, meta.slot_mapping, ks, vs)
    slots = meta.slot_mapping[meta.slot_mapping >= 0]
    flat = c8.view(2, -1, 2, 32)
    assert torch.equal(flat[0, slots].view(torch.uint8), ref.quantize_kv(k[:len(slots)], ks, kv_dtype).view(torch.uint8))
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched].view(torch.uint8), before.view(2, -1, 2, 32)[:, untouched].view(torch.uint8))
    n = meta.query_start_loc_cpu[-1]  # rows past n are padding (never written)
    got = ref.paged_attention_ref(q, c8, meta, 0.17, ks, vs)[:n]
    deq = torch.stack([c8[0].float() * ks, c8[1].float() * vs])
    torch.testing.assert_close(got, ref.paged_attention_ref(q, deq, meta, 0.17)[:n], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, ref.paged_attention_ref(q, c8, meta, 0.17, ks * 2, vs)[:n])  # the scale is used


def test_capacity_counts_bytes(tiny_llama_dir):
    """At the same KV budget an fp8 cache holds >= 1.9x the blocks of a bf16 one (scales' bytes counted)."""
    budget = 3 << 20
    blocks = {}
    for kv in ("auto", "fp8"):
        llm = LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory_bytes=budget, max_model_len=256)
        r = llm.llm_engine.runner
        blocks[kv] = r.num_blocks
        assert r.kv_cache.numel() * r.kv_cache.element_size() + r.kv_spec.fixed_bytes() <= budget
        assert r.kv_cache.dtype == (torch.bfloat16 if kv == "auto" else E4M3)
    assert blocks["fp8"] >= 1.9 * blocks["auto"], blocks
    assert llm.llm_engine.block_manager.num_blocks == blocks["fp8"]


def test_scales_from_first_prefill(tiny_llama_dir):
    """vLLM's calculate_kv_scales: k_scale = max|k'| / 200 (k' the rotated keys the cache stores) and
    v_scale = max|v| / 100 of the first prefill, then fixed; e4m3 (3 mantissa bits) stays closer to the 16-bit
    cache than e5m2 (2 bits); scales that make the writes saturate wreck the outputs, so the kernels use them."""
    kw = dict(kv_cache_memory_bytes=4 << 20, max_model_len=256)
    base = _prompt_logprobs(LLM(tiny_llama_dir, **kw))
    llm = LLM(tiny_llama_dir, kv_cache_dtype="fp8", **kw)
    layers = _attn(llm)
    seen = {}

    def hook(m, a, i):
        if i not in seen:
            k = a[1].view(a[1].shape[0], m.num_kv_heads, m.head_dim).float()
            seen[i] = ((k @ m.rot_k).abs().max(), k.abs().max(), a[2].abs().max())
    hooks = [m.register_forward_pre_hook(lambda m, a, i=i: hook(m, a, i)) for i, m in enumerate(layers)]
    assert all(float(m.k_scale) == 1.0 for m in layers)
    lp = _prompt_logprobs(llm)
    for h in hooks:
        h.remove()
    for i, m in enumerate(layers):
        torch.testing.assert_close(m.k_scale, (seen[i][0] / 200).reshape(1))
        torch.testing.assert_close(m.v_scale, (seen[i][2] / 100).reshape(1))
        assert seen[i][0] <= seen[i][1]  # |k M / D| <= max|k|: a checkpoint's k_scale cannot saturate
    first = [(m.k_scale.clone(), m.v_scale.clone()) for m in layers]
    _prompt_logprobs(llm, [x + 11 for x in PROMPT[:30]])
    assert all(torch.equal(m.k_scale, k) and torch.equal(m.v_scale, v) for m, (k, v) in zip(layers, first))
    err_e4m3 = (lp - base).abs().mean().item()
    err_e5m2 = (_prompt_logprobs(LLM(tiny_llama_dir, kv_cache_dtype="fp8_e5m2", **kw)) - base).abs().mean().item()
    assert 0 < err_e4m3 < err_e5m2, (err_e4m3, err_e5m2)
    for m in layers:  # max|k| now lands on 20 * 448: the store saturates
        m.k_scale.div_(20), m.v_scale.div_(20)
    assert (_prompt_logprobs(llm) - base).abs().mean().item() > 3 * err_e4m3


def test_checkpoint_kv_cache_scheme_scales(kv_scheme_dir):
    """A checkpoint in llm-compressor's kv_cache_scheme layout: the cache turns fp8 on 'auto', the tensors
    ``model.layers.N.self_attn.k_scale / v_scale`` reach the attention layers, and they change the outputs."""
    llm = LLM(kv_scheme_dir, kv_cache_memory_bytes=4 << 20, max_model_len=256)
    assert llm.llm_engine.runner.kv_cache.dtype == E4M3
    got = [float(s) for m in _attn(llm) for s in (m.k_scale, m.v_scale)]
    assert got == pytest.approx([0.03, 0.035, 0.032, 0.04])
    lp = _prompt_logprobs(llm)
    assert [float(s) for m in _attn(llm) for s in (m.k_scale, m.v_scale)] == got  # not recomputed by the prefill
    base = _prompt_logprobs(LLM(kv_scheme_dir, kv_cache_dtype="fp8", quantization=None, kv_cache_memory_bytes=4 << 20,
                                max_model_len=256))  # same checkpoint, same scales
    assert torch.equal(lp, base)
    for m in _attn(llm):  # the checkpoint's scales, not unit ones, are what the kernels read
        m.k_scale.fill_(1.0), m.v_scale.fill_(1.0)
    assert not torch.allclose(_prompt_logprobs(llm), lp, atol=1e-4)


def test_scale_names_from_checkpoints(tmp_path):
    assert kv_scale_targets("model.layers.3.self_attn.k_scale") == ["model.layers.3.self_attn.attn.k_scale"]
    assert kv_scale_targets("model.layers.3.self_attn.v_proj.output_scale") == ["model.layers.3.self_attn.attn.v_scale"]
    assert kv_scale_targets("model.layers.0.self_attn.kv_scale") == [
        "model.layers.0.self_attn.attn.k_scale", "model.layers.0.self_attn.attn.v_scale"]
    assert kv_scale_targets("model.layers.0.self_attn.k_proj.weight_scale") is None
    # an FP8 checkpoint's single kv_scale feeds both K and V
    d = build_tiny_model(str(tmp_path / "m"), "llama", tokenizer=False)
    sd = load_file(f"{d}/model.safetensors")
    sd.update({f"model.layers.{i}.self_attn.kv_scale": torch.tensor(0.05 + i) for i in range(2)})
    save_file(sd, f"{d}/model.safetensors", metadata={"format": "pt"})
    llm = LLM(d, kv_cache_dtype="fp8_e5m2", kv_cache_memory_bytes=2 << 20, max_model_len=128)
    assert [float(s) for m in _attn(llm) for s in (m.k_scale, m.v_scale)] == pytest.approx([0.05, 0.05, 1.05, 1.05])
    assert llm.llm_engine.runner.kv_calibrate == []
    sd["model.layers.1.self_attn.kv_scale"] = torch.tensor([0.1, 0.2])
    save_file(sd, f"{d}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="per head"):
        LLM(d, kv_cache_dtype="fp8", kv_cache_memory_bytes=2 << 20, max_model_len=128)


def test_prefix_caching_preemption_and_padded_decode_on_fp8(kv_scheme_dir):
    """Fixed checkpoint scales make every run comparable: a batch with shared prefixes, preemption forced by a
    16-block cache of 4-token blocks, and decode steps on the padded graph-bucket path gives each request its tokens alone."""
    from lqe.engine.cuda_graph import EagerPaddedRunner

    shared = PROMPT[:20]
    prompts = [(shared if i % 2 else []) + [(13 * i + j) % 3000 + 9 for j in range(5 + 3 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True) for i in range(6)]
    kw = dict(kv_cache_memory_bytes=4 << 20, max_model_len=64, block_size=4, max_num_seqs=4, max_cudagraph_batch=4)
    alone_llm = LLM(kv_scheme_dir, enable_prefix_caching=False, **kw)
    alone = [alone_llm.generate([{"prompt_token_ids": p}], [sp], use_tqdm=False)[0].outputs[0].token_ids
             for p, sp in zip(prompts, params)]
    llm = LLM(kv_scheme_dir, num_kv_blocks=16, **kw)
    llm.llm_engine.runner.capture_cuda_graphs(EagerPaddedRunner)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    eng = llm.llm_engine
    assert eng.scheduler.num_preemptions > 0 and eng.block_manager.hits > 0


def test_accuracy_benchmark_kv_cache_flag(tiny_llama_dir, text):
    import accuracy

    res = {kv: accuracy.main(["--model", tiny_llama_dir, "--dataset", str(text), "--seq-len", "48", "--max-windows", "2",
                              "--kv-cache-dtype", kv]) for kv in ("auto", "fp8_e5m2")}
    assert (res["auto"]["kv_cache_torch_dtype"], res["fp8_e5m2"]["kv_cache_torch_dtype"]) == ("float32", "float8_e5m2")
    assert res["auto"]["tokens"] == res["fp8_e5m2"]["tokens"] and res["auto"]["ppl"] != res["fp8_e5m2"]["ppl"]


def test_accuracy_benchmark_key_rotation_and_calibrated_scales(tiny_llama_dir, text):
    """``--no-kv-cache-key-rotation`` and ``--kv-scales calibrated`` (a calibrated checkpoint's max / 448 of the
    unrotated keys and values, measured on a 16-bit twin) reach the engine and change the perplexity."""
    import accuracy

    base = ["--model", tiny_llama_dir, "--dataset", str(text), "--seq-len", "48", "--max-windows", "2",
            "--kv-cache-dtype", "fp8"]
    rot, plain = accuracy.main(base), accuracy.main(base + ["--no-kv-cache-key-rotation"])
    assert (rot["kv_cache_key_rotation"], plain["kv_cache_key_rotation"]) == (True, False)
    assert rot["ppl"] != plain["ppl"]
    cal = accuracy.main(base + ["--kv-scales", "calibrated"])
    assert cal["kv_scales"] == "calibrated" and cal["ppl"] != rot["ppl"]
    assert accuracy.main(["--model", tiny_llama_dir, "--dataset", str(text), "--seq-len", "48", "--max-windows", "1",
                          "--kv-scales", "calibrated"])["kv_scales"] is None  # a 16-bit cache has no scales


def test_calibrated_scales_are_max_over_448(tiny_llama_dir):
    import accuracy

    llm = LLM(tiny_llama_dir, kv_cache_dtype="fp8", kv_cache_memory_bytes=4 << 20, max_model_len=256)
    seen = {}
    ref_llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=4 << 20, max_model_len=256)
    for i, m in enumerate(_attn(ref_llm)):
        m.register_forward_pre_hook(lambda m, a, i=i: seen.setdefault(i, (a[1].abs().max(), a[2].abs().max())) and None)
    _prompt_logprobs(ref_llm)
    accuracy.set_calibrated_kv_scales(llm, PROMPT)
    for i, m in enumerate(_attn(llm)):
        torch.testing.assert_close(m.k_scale, (seen[i][0] / 448).reshape(1))
        torch.testing.assert_close(m.v_scale, (seen[i][1] / 448).reshape(1))
    assert llm.llm_engine.runner.kv_calibrate == []


def test_kv_cache_accuracy_benchmark_rows(tiny_llama_dir, text, tmp_path):
    import kv_cache_accuracy

    out = tmp_path / "kv.json"
    res = kv_cache_accuracy.main(["--model", tiny_llama_dir, "--dtype", "float32", "--dataset", str(text),
                                  "--seq-len", "48", "--max-windows", "1", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == res["rows"]
    assert [(r["kv_cache_dtype"], r["kv_cache_key_rotation"], r["kv_scales"]) for r in res["rows"]] == [
        ("auto", False, None), ("fp8_e4m3", True, "prefill"), ("fp8_e4m3", True, "calibrated"),
        ("fp8_e4m3", False, "prefill"), ("fp8_e4m3", False, "calibrated"),
        ("fp8_e5m2", True, "prefill"), ("fp8_e5m2", False, "prefill")]
    assert res["rows"][0]["ppl_increase_vs_16bit"] == 0 and len({r["ppl"] for r in res["rows"]}) == 7
    assert [t["goal"] for t in res["targets"]] == ["<= 0.01", "<= 0.01", "<= 0.03"]


def test_checkpoint_with_only_one_scale_keeps_it(tmp_path):
    """A checkpoint that gives a layer only ``k_scale`` (or only ``v_scale``): the first prefill computes the
    missing one and keeps the given one."""
    d = build_tiny_model(str(tmp_path / "m"), "llama", tokenizer=False)
    sd = load_file(f"{d}/model.safetensors")
    sd["model.layers.0.self_attn.k_scale"] = torch.tensor(0.07)
    sd["model.layers.1.self_attn.v_scale"] = torch.tensor(0.09)
    save_file(sd, f"{d}/model.safetensors", metadata={"format": "pt"})
    llm = LLM(d, kv_cache_dtype="fp8", kv_cache_memory_bytes=2 << 20, max_model_len=128)
    l0, l1 = _attn(llm)
    assert llm.llm_engine.runner.kv_calibrate == [l0, l1]
    _prompt_logprobs(llm)
    assert float(l0.k_scale) == pytest.approx(0.07) and float(l1.v_scale) == pytest.approx(0.09)
    assert float(l0.v_scale) not in (1.0, pytest.approx(0.07)) and float(l1.k_scale) != 1.0  # computed
