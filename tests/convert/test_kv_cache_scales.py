"""``tools.convert quantize --kv-cache fp8``: calibrated KV-cache scales written in llm-compressor's layout
(``kv_cache_scheme`` + ``model.layers.N.self_attn.k_scale / v_scale``), then loaded by the engine's fp8 cache."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file

E4M3_MAX = 448.0
TEXT = " ".join(f"The {w} of the river runs past number {i} toward the quiet sea." for i, w in
                enumerate(["edge", "song", "color", "sound", "weight", "light"] * 12))


def test_quantize_writes_kv_cache_scales(tiny_llama_dir, tmp_path):
    from lqe import LLM, SamplingParams
    from lqe.layers.attention import Attention
    from tools.convert.cli import main

    calib = tmp_path / "c.txt"
    calib.write_text(TEXT)
    out = str(tmp_path / "w8a8-kv")
    assert main(["quantize", "--model", tiny_llama_dir, "--out", out, "--method", "rtn", "--format", "w8a8",
                 "--calib", str(calib), "--num-samples", "3", "--seq-len", "24", "--kv-cache", "fp8"]) == 0
    with open(os.path.join(out, "config.json")) as f:
        scheme = json.load(f)["quantization_config"]["kv_cache_scheme"]
    assert (scheme["num_bits"], scheme["type"], scheme["strategy"], scheme["dynamic"]) == (8, "float", "tensor", False)
    scales = load_file(os.path.join(out, "kv_cache_scales.safetensors"))
    assert sorted(scales) == [f"model.layers.{i}.self_attn.{kv}_scale" for i in range(2) for kv in "kv"]

    # the scales are max|k| / 448 and max|v| / 448 of what the engine stores for the calibration windows
    from tools.convert.calib_data import calibration_ids

    ids = calibration_ids(tiny_llama_dir, str(calib), 3, 24, 0)
    llm = LLM(out, kv_cache_dtype="fp8", kv_cache_memory_bytes=8 << 20, max_model_len=64)  # loads the scales
    layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, Attention)]
    for i, m in enumerate(layers):
        assert float(m.k_scale) == float(scales[f"model.layers.{i}.self_attn.k_scale"])
        assert float(m.v_scale) == float(scales[f"model.layers.{i}.self_attn.v_scale"])
    assert llm.llm_engine.runner.kv_calibrate == []  # nothing left to compute at the first prefill
    plain = LLM(out, kv_cache_dtype="auto", kv_cache_memory_bytes=8 << 20, max_model_len=64)
    assert plain.llm_engine.runner.kv_cache.dtype == torch.float8_e4m3fn  # 'auto' follows the kv_cache_scheme
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, i=i: seen.update(
        {i: torch.maximum(seen.get(i, torch.zeros(2)), torch.stack([a[1].abs().max(), a[2].abs().max()]))}))
        for i, m in enumerate(layers)]
    llm.generate([{"prompt_token_ids": r.tolist()} for r in ids], SamplingParams(max_tokens=1), use_tqdm=False)
    for h in hooks:
        h.remove()
    # layer 0's K/V do not depend on the cache's dtype: exact; layer 1 reads layer 0's fp8 cache here, while the
    # calibration ran on a 16-bit cache: close
    for i, tol in ((0, 1e-6), (1, 0.05)):
        for j, kv in enumerate("kv"):
            torch.testing.assert_close(scales[f"model.layers.{i}.self_attn.{kv}_scale"],
                                       (seen[i][j] / E4M3_MAX).reshape(1), rtol=tol, atol=0)


def test_kv_cache_option_needs_a_compressed_tensors_format(tiny_llama_dir, tmp_path, capsys):
    from tools.convert.cli import main

    assert main(["quantize", "--model", tiny_llama_dir, "--out", str(tmp_path / "o"), "--method", "rtn",
                 "--format", "gptq", "--kv-cache", "fp8"]) == 2
    assert "--format w8a8 or w4a16-ct" in capsys.readouterr().err
