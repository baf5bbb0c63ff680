"""GPU: the engine on an fp8 KV cache (issue 29) through the Triton backend: CUDA-graph decode equals eager decode,
with checkpoint scales (llm-compressor's ``kv_cache_scheme`` layout) and with scales computed at the first prefill
after the graphs were captured (the graphs read the scale tensors, not values frozen at capture); prefix caching
and preemption on; the fp8 engine stays close to the bf16 one; the allocator doubles the blocks."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from helpers import build_tiny_model  # noqa: E402
from test_kv_cache_fp8 import _write_kv_scheme  # noqa: E402
from test_model_matrix import check_same_greedy, gen_requests, release_memory  # noqa: E402

ENGINE = dict(device="cuda", dtype="bfloat16", max_num_seqs=8, max_cudagraph_batch=8, block_size=8, max_model_len=96,
              enable_prefix_caching=True)


def build_checkpoints(root: str, names: list[str] | None = None) -> dict[str, str]:
    """A float llama, and the same with llm-compressor kv_cache_scheme k/v scales (fp32 safetensors, no tokenizer)."""
    out = {}
    for name in ("plain", "scheme"):
        if names and name not in names:
            continue
        out[name] = build_tiny_model(os.path.join(root, name), "llama", tokenizer=False, initializer_range=0.05)
    if "scheme" in out:
        _write_kv_scheme(out["scheme"], {0: (0.01, 0.012), 1: (0.011, 0.013)})
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    return build_checkpoints(str(tmp_path_factory.mktemp("fp8kv")))


def _run(model_dir: str, eager: bool, **kw):
    from lqe import LLM, SamplingParams

    prompts, lengths = gen_requests()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in lengths]
    llm = LLM(model_dir, enforce_eager=eager, **ENGINE, **kw)
    runner = llm.llm_engine.runner
    assert (runner.graph_runner is None) == eager
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0] for p, sp in zip(prompts[:4], params[:4])]
    batched = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    info = {"kv_dtype": runner.kv_cache.dtype, "backend": runner.attention_backend, "blocks": runner.num_blocks,
            "scales": [(float(m.k_scale), float(m.v_scale)) for m in runner.model.modules() if hasattr(m, "k_scale")],
            "preemptions": llm.llm_engine.scheduler.num_preemptions, "hits": llm.llm_engine.block_manager.hits,
            "paths": dict(runner.steps_by_path)}
    del llm, runner
    release_memory()
    return alone, batched, info


@pytest.mark.parametrize("case", ["scheme", "first-prefill", "first-prefill-piecewise"])
def test_fp8_graphs_equal_eager(dirs, case):
    """``first-prefill-piecewise``: mixed and prefill steps replay piecewise graphs too; the step that computes the
    scales runs eagerly, and the graphs captured before it read the scales it wrote."""
    kw = dict(num_kv_blocks=20) if case == "scheme" else dict(num_kv_blocks=20, kv_cache_dtype="fp8")
    if case.endswith("piecewise"):
        kw["cudagraph_mode"] = "FULL_AND_PIECEWISE"
    model = dirs["scheme" if case == "scheme" else "plain"]
    g_alone, g_batched, g = _run(model, eager=False, **kw)
    e_alone, e_batched, e = _run(model, eager=True, **kw)
    if case.endswith("piecewise"):
        assert g["paths"]["piecewise"] > 0 and g["paths"]["decode_graph"] > 0, g["paths"]
    assert g["kv_dtype"] == e["kv_dtype"] == torch.float8_e4m3fn and g["backend"] in ("triton", "flash_attn")
    assert g["scales"] == e["scales"] and all(k != 1.0 and v != 1.0 for k, v in g["scales"])
    if case.endswith("piecewise"):
        # piecewise graphs run a prefill's GEMMs at the token bucket (M padded), eager at its length: bf16 GEMM tiles
        # differ, so a near tie may flip (as in test_piecewise_gpu); the first request's prefill is eager in both
        assert list(e_alone[0].token_ids) == list(g_alone[0].token_ids)
        check_same_greedy(e_alone, g_alone, 0.15, 0.25)
    else:
        for i, (a, b) in enumerate(zip(e_alone, g_alone)):
            assert list(a.token_ids) == list(b.token_ids), \
                f"request {i} alone: graphs {b.token_ids} != eager {a.token_ids}"
    counts = check_same_greedy(e_batched, g_batched, 0.15, 0.25)
    assert counts["exact"] >= len(e_batched) // 2, counts
    assert g["preemptions"] > 0 and g["hits"] > 0


def test_fp8_close_to_bf16_and_twice_the_blocks(dirs):
    budget = dict(kv_cache_memory_bytes=4 << 20)
    _, bf16, b = _run(dirs["plain"], eager=False, **budget)
    _, fp8, f = _run(dirs["plain"], eager=False, kv_cache_dtype="fp8", **budget)
    assert b["kv_dtype"] == torch.bfloat16 and f["blocks"] >= 1.9 * b["blocks"]
    counts = check_same_greedy(bf16, fp8, 0.5, 0.6)
    assert counts["exact"] >= len(bf16) // 2, counts
