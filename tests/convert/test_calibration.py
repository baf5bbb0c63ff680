"""Calibration methods beat their baselines on the layer-wise reconstruction error of calibration activations."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from lqe.quant_layers import reference as ref
from tools.convert.awq import linear_loss, search_scale
from tools.convert.blocks import BlockRunner, input_hooks
from tools.convert.calib_data import calibration_ids
from tools.convert.gptq import HessianAccumulator, gptq_quantize
from tools.convert.rtn import fake_quant
from tools.convert.smoothquant import smooth_factors

TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is the capital of "
        "Germany. Quantization maps floating point weights to a small set of integers with a scale per group. ") * 20


@pytest.fixture(scope="module")
def layer0(tiny_llama_dir, tmp_path_factory):
    """Tiny Llama (outlier channels in layer 0's input norm) and its calibration runner."""
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(TEXT)
    ids = calibration_ids(tiny_llama_dir, str(path), 8, 64, seed=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval().requires_grad_(False)
    model.model.layers[0].input_layernorm.weight[:4] *= 20
    return model, BlockRunner(model, ids, 4)


@pytest.fixture(scope="module")
def acts(layer0):
    """Layer-0 inputs of q_proj and down_proj on calibration text, with the layer's weights."""
    model, runner = layer0
    got = {"self_attn.q_proj": [], "mlp.down_proj": []}
    layer = model.model.layers[0]
    with input_hooks(layer, list(got), lambda n, x: got[n].append(x.reshape(-1, x.shape[-1]))):
        runner.run(layer)
    return {n: (torch.cat(v), dict(layer.named_modules())[n].weight.clone()) for n, v in got.items()}


def _err(x, w, wq):
    return float(((x @ (wq - w).t()) ** 2).mean())


@pytest.mark.parametrize("name", ["self_attn.q_proj", "mlp.down_proj"])
@pytest.mark.parametrize("sym,act", [(True, False), (False, True)])
def test_gptq_beats_rtn(acts, name, sym, act):
    x, w = acts[name]
    h = HessianAccumulator(w.shape[1])
    h.add(x)
    g = gptq_quantize(w, h.hessian(), 4, 32, sym, act_order=act).dequantize().t()
    assert _err(x, w, g) < 0.9 * _err(x, w, fake_quant(w, 4, 32, sym))


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_mse_clipping_lowers_error(acts, sym):
    x, w = acts["mlp.down_proj"]
    w = w.clone()
    w[:, ::7] *= 4  # heavy-tailed groups: the full range wastes resolution on a few weights
    h = HessianAccumulator(w.shape[1])
    h.add(x)
    plain = gptq_quantize(w, h.hessian(), 4, 32, sym).dequantize().t()
    clipped = gptq_quantize(w, h.hessian(), 4, 32, sym, mse=True)
    assert _err(x, w, clipped.dequantize().t()) < _err(x, w, plain)
    # the searched ranges are real clipping: some scales are below the full-range ones
    full = gptq_quantize(w, h.hessian(), 4, 32, sym).scales
    assert bool((clipped.scales < full - 1e-6).any())


def test_awq_beats_rtn(acts):
    x, w = acts["self_attn.q_proj"]
    s, best, base = search_scale(linear_loss(x, [w]), x.abs().mean(0), [w], 4, 32, False, duo=False)
    assert base == pytest.approx(_err(x, w, fake_quant(w, 4, 32, False)), rel=1e-4)
    assert best < 0.9 * base
    assert _err(x, w, fake_quant(w * s, 4, 32, False) / s) == pytest.approx(best, rel=1e-4)


def test_smoothquant_beats_plain_w8a8():
    torch.manual_seed(0)
    x = torch.randn(256, 128)
    x[:, :3] *= 60  # outlier channels
    w = torch.randn(96, 128) * 0.05

    def w8a8_err(x, w):
        q, s = ref.quantize_int8_per_channel(w)
        return float(((ref.w8a8_linear_ref(x, q, s) - x @ w.t()) ** 2).mean())

    s = smooth_factors(x.abs().amax(0), [w], 0.5)
    assert torch.allclose((x / s) @ (w * s).t(), x @ w.t(), atol=1e-3)
    assert w8a8_err(x / s, w * s) < 0.5 * w8a8_err(x, w)


def test_quantize_cli_end_to_end(tiny_llama_dir, tmp_path):
    """quantize --method gptq writes a checkpoint that verify accepts and the engine loads."""
    from cutil import engine_logprobs
    from tools.convert.cli import main

    calib = tmp_path / "c.txt"
    calib.write_text(TEXT)
    for method, fmt, extra in (("gptq", "gptq", ["--desc-act"]), ("awq", "awq", ["--awq-clip"]), ("smoothquant", "w8a8", [])):
        out = str(tmp_path / method)
        assert main(["quantize", "--model", tiny_llama_dir, "--out", out, "--method", method, "--format", fmt,
                     "--calib", str(calib), "--num-samples", "4", "--seq-len", "32", *extra]
                    + ([] if fmt == "w8a8" else ["--group-size", "32"])) == 0
        assert main(["verify", out]) == 0
    assert torch.isfinite(engine_logprobs(str(tmp_path / "gptq"))).all()


def test_stop_at_sees_the_same_inputs(layer0):
    """A forward abandoned at o_proj gives o_proj the same inputs as a whole forward, and never reaches the MLP."""
    model, runner = layer0
    layer = model.model.layers[0]
    whole, cut, mlp = [], [], []
    with input_hooks(layer, ["self_attn.o_proj"], lambda n, x: whole.append(x)):
        runner.run(layer)
    with input_hooks(layer, ["self_attn.o_proj", "mlp.gate_proj"], lambda n, x: (cut if "o_proj" in n else mlp).append(x)):
        runner.run(layer, stop_at="self_attn.o_proj")
    assert len(whole) == len(cut) == len(runner.inputs) and not mlp
    assert all(torch.equal(a, b) for a, b in zip(whole, cut))
    with pytest.raises(ValueError, match="keep_outputs"):
        runner.run(layer, keep_outputs=True, stop_at="self_attn.o_proj")


def test_slice_batch_cuts_batch_tensors_only():
    from tools.convert.quantize import _slice_batch

    mask, pos, cache = torch.zeros(4, 1, 8, 8), (torch.ones(1, 8, 2), torch.ones(4, 8, 2)), torch.arange(4)
    out = _slice_batch({"attention_mask": mask, "position_embeddings": pos, "cache_position": cache, "x": None}, 2, 4)
    assert out["attention_mask"].shape[0] == 2 and out["position_embeddings"][0].shape[0] == 1
    assert out["position_embeddings"][1].shape[0] == 2 and out["cache_position"].shape[0] == 4 and out["x"] is None


@pytest.mark.parametrize("duo", [False, True])
def test_awq_module_loss_beats_rtn_on_the_layer_output(layer0, duo):
    """AWQ's scales (searched on the attention / MLP outputs) lower the decoder layer's output error against the
    float layer, compared with RTN of the same weights; the folded float layer computes the same function."""
    import copy

    from tools.convert.awq import AWQ_MAPPINGS, awq_layer
    from tools.convert.quantize import _slice_batch

    model, runner = layer0
    ref = copy.deepcopy(model.model.layers[0])
    firsts = [m[1][0] for m in AWQ_MAPPINGS]
    xs = {n: [] for n in firsts}
    with input_hooks(ref, firsts, lambda n, x: xs[n].append(x.float())):
        runner.run(ref)
    kws = [_slice_batch(kw, x.shape[0], x.shape[0]) for kw, x in zip(runner.kwargs, runner.inputs)]
    means = {n: torch.cat([x.reshape(-1, x.shape[-1]) for x in v]).abs().mean(0) for n, v in xs.items()}

    def out(layer):
        ys = [layer(x, **kw) for x, kw in zip(runner.inputs, runner.kwargs)]
        return torch.cat([y[0] if isinstance(y, tuple) else y for y in ys])

    def quantize_all(layer):
        for m in layer.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(fake_quant(m.weight, 4, 32, False))
        return layer

    with torch.no_grad():
        want = out(ref)
        awq = copy.deepcopy(ref)
        report = awq_layer(awq, xs, kws, means, 4, 32, False, duo=duo)
        # v_proj -> o_proj cannot fold under grouped-query attention (the tiny model has 2 KV heads for 4)
        assert set(report) == set(firsts) - {"self_attn.o_proj"} and all(0 < r <= 1 for r in report.values())
        assert torch.allclose(out(awq), want, rtol=1e-4, atol=1e-3)  # scales folded: same float function
        rtn_err = float(((out(quantize_all(copy.deepcopy(ref))) - want) ** 2).mean())
        awq_err = float(((out(quantize_all(awq)) - want) ** 2).mean())
    assert awq_err < 0.8 * rtn_err


def test_drift_target_is_the_least_squares_fit_to_the_float_outputs():
    from tools.convert.gptq import drift_target

    torch.manual_seed(0)
    x_fp = torch.randn(512, 24, dtype=torch.float64)
    # the quantized stream drifted from the float one: mostly a linear distortion (which a weight can undo), plus noise
    x = x_fp @ (torch.eye(24, dtype=torch.float64) + 0.2 * torch.randn(24, 24, dtype=torch.float64)) \
        + 0.01 * torch.randn_like(x_fp)
    w = torch.randn(8, 24, dtype=torch.float64)
    acc = HessianAccumulator(24)
    acc.add(x, x_fp)
    # the accumulator sums in fp32 (its rounding is the CPU's SIMD width's): its sums are the float64 ones to fp32
    # precision; the solve is checked on the exact sums, which makes it independent of that rounding
    hess, drift = 2 / 512 * x.t() @ x, 2 / 512 * (x_fp - x).t() @ x
    assert torch.allclose(acc.hessian(), hess, rtol=1e-5, atol=1e-5 * float(hess.abs().max()))
    assert torch.allclose(acc.drift(), drift, rtol=1e-5, atol=1e-5 * float(drift.abs().max()))
    target = drift_target(w, hess, drift, 1.0, damp=0.0)
    lstsq = torch.linalg.lstsq(x, x_fp @ w.t()).solution.t()  # argmin_W' |x W'^T - x_fp W^T|
    assert torch.allclose(target, lstsq, atol=1e-8)
    fit = lambda v: float(((x @ v.t() - x_fp @ w.t()) ** 2).sum())  # noqa: E731
    assert fit(drift_target(w, acc.hessian(), acc.drift(), 1.0, damp=0.0)) < 0.01 * fit(w)
    half = drift_target(w, hess, drift, 0.5, damp=0.0)
    assert torch.allclose(half, (w + target) / 2, atol=1e-8)


def test_run_paired_matches_plain_run_on_identical_streams(layer0):
    """At layer 0 both streams are the same tokens: the paired Hessian equals the plain one and the drift is 0."""
    import copy

    model, _ = layer0
    runner = BlockRunner(model, calibration_ids_for(model), 4, track_float=True)
    layer = model.model.layers[0]
    k = layer.mlp.down_proj.in_features
    plain, paired = HessianAccumulator(k), HessianAccumulator(k)
    with input_hooks(layer, ["mlp.down_proj"], lambda n, x: plain.add(x)):
        runner.run(layer)
    runner.run_paired(layer, copy.deepcopy(layer), ["mlp.down_proj"], lambda n, x, xf: paired.add(x, xf),
                      stop_at="mlp.down_proj")
    assert torch.allclose(plain.hessian(), paired.hessian()) and float(paired.drift().abs().max()) == 0.0
    with pytest.raises(ValueError, match="track_float"):
        BlockRunner(model, calibration_ids_for(model), 4).run_paired(layer, layer, ["mlp.down_proj"], print)


def calibration_ids_for(model):
    return torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))


def test_quantize_static_groups_and_drift_cli(tiny_llama_dir, tmp_path):
    """Act-order with static groups keeps g_idx trivial: GPTQ writes none that differs from the plain order and
    compressed-tensors says actorder "weight" (no weight_g_idx); the drift option is recorded; both load."""
    import json

    from cutil import engine_logprobs
    from safetensors.torch import load_file
    from tools.convert.cli import main

    calib = tmp_path / "c.txt"
    calib.write_text(TEXT)
    common = ["--calib", str(calib), "--num-samples", "4", "--seq-len", "32", "--group-size", "32", "--sym",
              "--desc-act", "--static-groups", "--mse", "--drift-alpha", "0.25"]
    for fmt in ("gptq", "w4a16-ct"):
        out = tmp_path / fmt
        assert main(["quantize", "--model", tiny_llama_dir, "--out", str(out), "--method", "gptq", "--format", fmt,
                     *common]) == 0
        assert main(["verify", str(out)]) == 0
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        sd = load_file(str(out / "model.safetensors"))
        if fmt == "gptq":
            assert qc["desc_act"] and qc["static_groups"] and qc["meta"]["drift_alpha"] == 0.25
            g = sd["model.layers.0.mlp.down_proj.g_idx"]
            assert torch.equal(g, torch.arange(g.numel(), dtype=g.dtype) // 32)
        else:
            assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
            assert not any(k.endswith("weight_g_idx") for k in sd)
        assert torch.isfinite(engine_logprobs(str(out))).all()
