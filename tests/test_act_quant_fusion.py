"""CPU tests of the RMSNorm / SiLU-mul -> int8 fusion for W8A8 layers.

* The Triton kernels (lqe/kernels/fused_quant.py) under Triton's interpreter, bit for bit against the unfused path
  and the torch twins (the checks of tests/gpu/test_fused_act_quant.py, on awkward shapes, ties, zero and large rows,
  and an exhaustive sweep of the quantizer over every fp16 / bf16 value).
* The twins against the layers' own unfused CPU path.
* The post-load pass (lqe/layers/act_quant_fusion.py): it links exactly the three pairs per decoder layer of a W8A8
  model (dynamic sym / asym, static sym / asym activations) whose layers have a CUDA kernel plan, and nothing for
  float or GPTQ, without a plan, with ``LQE_FUSED_ACT_QUANT=0`` or with two tensor-parallel ranks. The plan is faked
  on CPU (the layers take the CUDA path's code with a torch GEMM), so a whole engine runs the fused path and must give
  the same tokens and logprobs, bit for bit, as the unfused one. (FP8 consumers: tests/test_act_quant_link.py.)
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers import build_tiny_model, write_quantized_checkpoint
from lqe.quant_layers import reference as ref
from triton_compat import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None

SCRIPT = """
    triton_compat.patch_bf16_rounding()  # round fp32 -> bf16 to nearest even, as the GPU does
    import torch
    import test_fused_act_quant as F

    for dt in (torch.float16, torch.bfloat16):
        for m, k in ((1, 96), (7, 200), (26, 576)):
            for residual in (False, True):
                F.check_rms_norm_quant(m, k, dt, "cpu", residual)
        for m, inter in ((1, 200), (7, 1000), (26, 96)):
            F.check_silu_mul_quant(m, inter, dt, "cpu")
        F.check_silu_mul_quant(7, 200, dt, "cpu", chunk=64)  # the two-pass path, ragged last chunk
        F.check_quantizer_exhaustive(dt, "cpu")
    F.check_leading_dims_and_empty("cpu")
    print("FUSED-QUANT-INTERPRET-OK")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
def test_fused_quant_kernels_under_interpreter():
    run_interpreted(SCRIPT, "FUSED-QUANT-INTERPRET-OK", timeout=600)


# ------------------------------------------------------------------------------------------------ twins
def _specs():
    from lqe.quant_layers import quantized_activation as qa

    return {"sym": qa.ActQuant(qa.INT8_PER_TOKEN_SYM), "asym": qa.ActQuant(qa.INT8_PER_TOKEN_ASYM),
            "static": qa.ActQuant(qa.INT8_STATIC, scale=torch.tensor([0.03])),
            "static-azp": qa.ActQuant(qa.INT8_STATIC, scale=torch.tensor([0.05]), zero_point=torch.tensor([-9], dtype=torch.int32)),
            "fp8": qa.ActQuant(qa.FP8_PER_TOKEN), "fp8-g32": qa.ActQuant(qa.FP8_PER_GROUP, group=32)}


def _unfused_quant(spec, y: torch.Tensor):
    """What the consumer computes from the float activation ``y`` when it quantizes for itself."""
    from lqe.kernels import w8a8 as kw
    from lqe.kernels.fused_quant_fp8 import quant_fp8_ref

    y2 = y.reshape(-1, y.shape[-1])
    if spec.scheme == "int8-static":
        return ref.static_quant_int8(y2, spec.scale, spec.zero_point), spec.scale, spec.zero_point
    if spec.scheme == "fp8-per-token":
        return (*kw.fp8_quantize_per_token(y2), None)
    if spec.scheme == "fp8-per-group":
        return (*quant_fp8_ref(y2, spec.group), None)
    return ref.per_token_quant_int8(y2, spec.scheme == "int8-per-token-sym")


@pytest.mark.parametrize("scheme", ["sym", "asym", "static", "static-azp", "fp8", "fp8-g32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_layers_quantized_output_is_the_unfused_path(dtype, scheme):
    """RMSNorm / SiluAndMul with ``output_quant`` set give, on CPU, exactly the quantizer of the consumer applied to
    their float output (what the W8A8 / FP8 layer computes when it quantizes itself); the residual is unchanged."""
    from lqe.layers.activation import SiluAndMul
    from lqe.layers.norm import RMSNorm
    from lqe.quant_layers.quantized_activation import QuantizedActivation

    spec = _specs()[scheme]
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(7, 96, generator=g) * 3).to(dtype), torch.randn(7, 96, generator=g).to(dtype)
    x[2] = 0
    r[2] = 0
    norm = RMSNorm(96, 1e-6, dtype)
    norm.weight.data = (1 + torch.randn(96, generator=g)).to(dtype)
    act = SiluAndMul()
    a = (torch.randn(7, 2 * 64, generator=g) * 4).to(dtype)
    y, new_r = norm(x, r)
    y0 = norm(x)
    f = act(a)
    norm.output_quant = act.output_quant = spec
    qy, qr = norm(x, r)
    qy0, qf = norm(x), act(a)
    assert torch.equal(qr, new_r)
    for got, float_out in ((qy, y), (qy0, y0), (qf, f)):
        assert isinstance(got, QuantizedActivation) and got.dtype == dtype and got.shape == float_out.shape
        assert got.scheme == spec.scheme
        q, s, z = _unfused_quant(spec, float_out)
        gq, gs, gz = got.rows()
        assert torch.equal(gq.view(torch.uint8) if gq.is_floating_point() else gq,
                           q.view(torch.uint8) if q.is_floating_point() else q)
        assert torch.equal(gs, s.reshape(gs.shape)) and (z is None) == (gz is None)
        assert z is None or torch.equal(gz, z.reshape(gz.shape))
        assert got.dequantize().dtype == dtype
        err = (got.dequantize().float() - float_out.float()).abs()
        if scheme.startswith("static"):  # a calibrated range saturates beyond it
            err = err[(got.q > -128) & (got.q < 127)]
        assert err.max() <= 0.07 * float_out.float().abs().max() + 0.05, (scheme, err.max())
    if scheme in ("sym", "asym", "fp8"):
        assert qy.rows()[1].shape == (7,)
    # a zero row: q 0 (scale 0, the fp8 1e-12 floor or the static scale), the zero point where there is one
    assert torch.equal(qy.q[2].float(), torch.full((96,), -9.0 if scheme == "static-azp" else 0.0))


def test_act_quant_spec_is_validated():
    from lqe.quant_layers import quantized_activation as qa

    with pytest.raises(ValueError, match="not one of"):
        qa.ActQuant("int4-per-token")
    with pytest.raises(ValueError, match="group"):
        qa.ActQuant(qa.FP8_PER_TOKEN, group=128)
    with pytest.raises(ValueError, match="group"):
        qa.ActQuant(qa.FP8_PER_GROUP)
    with pytest.raises(ValueError, match="needs one"):
        qa.ActQuant(qa.INT8_STATIC)
    s = _specs()
    assert s["static-azp"].same_as(qa.ActQuant(qa.INT8_STATIC, scale=torch.tensor([0.05]),
                                               zero_point=torch.tensor([-9], dtype=torch.int32)))
    assert not s["static-azp"].same_as(s["static"]) and not s["sym"].same_as(s["asym"]) and not s["fp8"].same_as(None)


# ------------------------------------------------------------------------------------------------ the pass
VOCAB = 512
PROMPT = [1, 300, 17, 45, 260, 3, 99, 411, 8, 150]
ENGINE = dict(device="cpu", kv_cache_memory_bytes=16 << 20, max_model_len=128)
PAIRS = ("input_layernorm -> self_attn.qkv_proj", "post_attention_layernorm -> mlp.gate_up_proj",
         "mlp.act_fn -> mlp.down_proj")


def _ct(sym: bool, dynamic: bool) -> tuple:
    def encode(name: str, w: torch.Tensor) -> dict:
        q, s = ref.quantize_int8_per_channel(w)
        t = {"weight": q, "weight_scale": s}
        if not dynamic:
            t["input_scale"] = torch.tensor([0.04])
            if not sym:
                t["input_zero_point"] = torch.tensor([3], dtype=torch.int8)
        return t

    acts = {"num_bits": 8, "type": "int", "symmetric": sym, "strategy": "token" if dynamic else "tensor",
            "dynamic": dynamic}
    return encode, {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
                    "quantization_status": "compressed", "config_groups": {"group_0": {
                        "targets": ["Linear"], "input_activations": acts,
                        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}}}


def _gptq() -> tuple:
    return (lambda name, w: ref.encode_gptq(ref.rtn_quantize(w, 4, 32, True), "gptq_v2"),
            {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False,
             "checkpoint_format": "gptq_v2"})


FORMATS = {"w8a8-dynamic-sym": lambda: _ct(True, True), "w8a8-dynamic-asym": lambda: _ct(False, True),
           "w8a8-static-sym": lambda: _ct(True, False), "w8a8-static-asym": lambda: _ct(False, False),
           "gptq": _gptq}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fused-act-quant")
    dirs = {}
    for arch in ("llama", "qwen3"):
        base = build_tiny_model(str(root / f"{arch}-float"), arch, tokenizer=False, vocab_size=VOCAB,
                                hidden_size=64, intermediate_size=96, initializer_range=0.1)
        dirs[f"{arch}-float"] = base
        for name, make in FORMATS.items():
            if arch == "llama" or name == "w8a8-dynamic-sym":
                encode, qcfg = make()
                dirs[f"{arch}-{name}"] = write_quantized_checkpoint(base, str(root / f"{arch}-{name}"), encode, qcfg)
    return dirs


def _load(model_dir: str, monkeypatch, fused: bool = True, dtype: str = "float32", **kwargs):
    from lqe import LLM
    from lqe.layers.act_quant_fusion import ENV

    monkeypatch.setenv(ENV, "1" if fused else "0")
    return LLM(model_dir, dtype=dtype, **ENGINE, **kwargs)


def _producers(model) -> dict[str, str | None]:
    return {name: m.output_quant for name, m in model.named_modules() if hasattr(m, "supported_output_quant")}


def _run(llm) -> tuple[list[int], torch.Tensor]:
    from lqe import SamplingParams

    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1,
                                                logprobs=1), use_tqdm=False)[0]
    o = out.outputs[0]
    lps = [out.prompt_logprobs[j][PROMPT[j]].logprob for j in range(1, len(PROMPT))]
    lps += [o.logprobs[t][tok].logprob for t, tok in enumerate(o.token_ids)]
    return list(o.token_ids), torch.tensor(lps, dtype=torch.float64)


SCHEME_OF = {"w8a8-dynamic-sym": "int8-per-token-sym", "w8a8-dynamic-asym": "int8-per-token-asym",
             "w8a8-static-sym": "int8-static(sym)", "w8a8-static-asym": "int8-static(asym)"}


@pytest.mark.parametrize("arch,dtype,online,fmt", [("llama", "float32", False, "w8a8-dynamic-sym"),
                                                   ("llama", "bfloat16", False, "w8a8-dynamic-sym"),
                                                   ("qwen3", "float32", False, "w8a8-dynamic-sym"),
                                                   ("llama", "float32", True, "w8a8-dynamic-sym"),
                                                   ("llama", "bfloat16", False, "w8a8-dynamic-asym"),
                                                   ("llama", "float16", False, "w8a8-static-sym"),
                                                   ("llama", "bfloat16", False, "w8a8-static-asym")])
def test_pass_links_the_w8a8_pairs_and_changes_no_bit(arch, dtype, online, fmt, checkpoints, fake_cuda_plan,
                                                      monkeypatch):
    """``online``: a float checkpoint quantized on load (``quantization="int8"``: dynamic symmetric per token)."""
    model_dir, kwargs = (checkpoints[f"{arch}-float"], {"quantization": "int8"}) if online else \
        (checkpoints[f"{arch}-{fmt}"], {})
    llm = _load(model_dir, monkeypatch, True, dtype, **kwargs)
    runner = llm.llm_engine.runner
    want = [(f"model.layers.{i}.{p}", f"model.layers.{i}.{c}") for i in range(2)
            for p, c in (pair.split(" -> ") for pair in PAIRS)]
    assert runner.fused_act_quant == want
    linked = {n: s for n, s in _producers(runner.model).items() if s is not None}
    assert set(linked) == {p for p, _ in want}  # not the final norm, not qwen3's q/k norms
    assert {str(s) for s in linked.values()} == {SCHEME_OF[fmt]}
    if fmt.startswith("w8a8-static"):  # each producer reads its own consumer's calibrated scale (and zero point)
        for p, c in want:
            assert linked[p].scale is runner.model.get_submodule(c).in_scale
    assert all("fake plan" in m.quant_method.describe(m) for _, c in want for m in [runner.model.get_submodule(c)])
    fused = _run(llm)
    # every linked consumer took its input pre-quantized, once per layer and forward
    assert set(fake_cuda_plan) == {"qkv_proj", "gate_up_proj", "down_proj"} and len(set(fake_cuda_plan.values())) == 1
    del llm, runner
    fake_cuda_plan.clear()
    llm = _load(model_dir, monkeypatch, False, dtype, **kwargs)
    assert llm.llm_engine.runner.fused_act_quant == [] and not fake_cuda_plan
    unfused = _run(llm)
    assert not fake_cuda_plan
    assert fused[0] == unfused[0] and torch.equal(fused[1], unfused[1]), (fused, unfused)


@pytest.mark.parametrize("name", ["float", "gptq"])
def test_pass_links_nothing_for_other_formats(name, checkpoints, fake_cuda_plan, monkeypatch):
    llm = _load(checkpoints[f"llama-{name}"], monkeypatch)
    runner = llm.llm_engine.runner
    assert runner.fused_act_quant == []
    assert not any(_producers(runner.model).values())
    _run(llm)
    assert not fake_cuda_plan


def test_pass_links_nothing_without_a_cuda_plan(checkpoints, monkeypatch):
    llm = _load(checkpoints["llama-w8a8-dynamic-sym"], monkeypatch)
    assert llm.llm_engine.runner.fused_act_quant == []
    assert not any(_producers(llm.llm_engine.runner.model).values())


def test_pass_off_with_tensor_parallel_ranks_and_by_env(checkpoints, fake_cuda_plan, monkeypatch, caplog):
    from lqe.layers.act_quant_fusion import ENV, _LOGGED, link_act_quant

    llm = _load(checkpoints["llama-w8a8-dynamic-sym"], monkeypatch)
    model = llm.llm_engine.runner.model
    assert len(llm.llm_engine.runner.fused_act_quant) == 6
    _LOGGED.clear()
    with caplog.at_level("INFO", logger="lqe"):
        assert link_act_quant(model, tp_size=2) == []
        assert not any(_producers(model).values())  # cleared, not left from the first pass
        assert len(link_act_quant(model)) == 6
        link_act_quant(model)  # the same outcome is logged once
        monkeypatch.setenv(ENV, "0")
        assert link_act_quant(model) == []
    lines = [r.getMessage() for r in caplog.records if "fused activation quantization" in r.getMessage()]
    assert len(lines) == 3, lines
    assert "tensor_parallel_size=2" in lines[0] and "disabled by LQE_FUSED_ACT_QUANT=0" in lines[2]
    assert all(f"{p} (int8-per-token-sym) x2" in lines[1] for p in PAIRS), lines[1]


def test_quantized_input_refused_where_not_offered(checkpoints, fake_cuda_plan, monkeypatch):
    from lqe.quant_layers.quantized_activation import INT8_STATIC, QuantizedActivation

    llm = _load(checkpoints["llama-w8a8-static-sym"], monkeypatch)
    layer = llm.llm_engine.runner.model.model.layers[0].self_attn.qkv_proj
    qa = QuantizedActivation(torch.zeros(3, 64, dtype=torch.int8), torch.ones(3, 1), torch.float32)
    with pytest.raises(ValueError, match=r"int8-per-token-sym activation but this layer takes int8-static\(sym\)"):
        layer(qa)
    other_scale = QuantizedActivation(torch.zeros(3, 64, dtype=torch.int8), layer.in_scale.clone(), torch.float32,
                                      INT8_STATIC)
    with pytest.raises(ValueError, match="int8-static"):  # a static input quantized with another layer's scale
        layer(other_scale)


def test_static_zero_point_beyond_the_exact_range_is_not_offered(checkpoints, fake_cuda_plan, monkeypatch):
    llm = _load(checkpoints["llama-w8a8-static-asym"], monkeypatch)
    layer = llm.llm_engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert str(layer.quant_method.input_quant(layer)) == "int8-static(asym)"
    layer.in_zp_fusable = False  # what process_weights_after_loading sets for |zero point| > 2^15
    assert layer.quant_method.input_quant(layer) is None
