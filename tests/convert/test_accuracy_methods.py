"""Post-GPTQ refinement (tools/convert/refine.py), block-output tuning (tools/convert/blocktune.py) and the
accuracy flags' bad inputs."""
import pytest
import torch

from tools.convert.blocktune import tune_layer
from tools.convert.cli import main
from tools.convert.gptq import gptq_quantize
from tools.convert.refine import refine_codes, refit_scales, row_errors
from tools.convert.rtn import rtn_canonical


@pytest.fixture(scope="module")
def layer_problem():
    """A linear ``[96, 160]`` with correlated, outlier-heavy inputs (what makes GPTQ's Hessian matter)."""
    gen = torch.Generator().manual_seed(0)
    k, n, t = 160, 96, 1024
    x = torch.randn(t, k, generator=gen) @ (torch.randn(k, k, generator=gen) * 0.2 + torch.eye(k))
    x[:, 7] *= 15
    w = torch.randn(n, k, generator=gen) * 0.05
    return w, 2 * x.t() @ x / t


def _damped(h, damp=0.01):
    h = h.double().clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    return h


@pytest.mark.parametrize("sym,act", [(True, False), (False, False), (False, True)])
def test_refit_never_increases_the_hessian_error(layer_problem, sym, act):
    w, h = layer_problem
    cw = gptq_quantize(w, h, 4, 32, sym, act_order=act)
    before = row_errors(cw.dequantize().t(), w, h)
    out, rep = refit_scales(cw, w, h, zeros=not sym)
    after = row_errors(out.dequantize().t(), w, h)
    assert (after <= before + 1e-12).all() and rep.after < rep.before
    assert torch.equal(out.codes, cw.codes) and (out.g_idx is None) == (cw.g_idx is None)
    assert torch.equal(out.scales, out.scales.half().float())  # stored as fp16 exactly


@pytest.mark.parametrize("sym,act", [(True, False), (False, True)])
def test_refine_codes_never_increases_the_hessian_error(layer_problem, sym, act):
    w, h = layer_problem
    cw = gptq_quantize(w, h, 4, 32, sym, act_order=act)
    hd = _damped(h)
    errs = [float(row_errors(cw.dequantize().t(), w, hd).sum())]
    for passes in (1, 2):
        out, rep = refine_codes(cw, w, h, passes)
        errs.append(float(row_errors(out.dequantize().t(), w, hd).sum()))
        assert rep.after == pytest.approx(errs[-1]) and rep.before == pytest.approx(errs[0])
        assert out.codes.max() <= 15 and (out.g_idx is None) == (cw.g_idx is None)
    assert errs[2] <= errs[1] < errs[0]


@pytest.fixture(scope="module")
def layer_data(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from tools.convert.blocks import BlockRunner

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval().requires_grad_(False)
    ids = torch.randint(0, 4000, (8, 32), generator=torch.Generator().manual_seed(0))
    runner = BlockRunner(model, ids, batch_size=4)
    layer = model.model.layers[0]
    targets = runner.run(layer, keep_outputs=True)
    return layer, runner, targets


@pytest.mark.parametrize("rounding", [False, True])
def test_block_tuning_lowers_the_layer_output_error(layer_data, rounding):
    layer, runner, targets = layer_data
    lins = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    canon = {n: rtn_canonical(m.weight, 4, 32, False) for n, m in lins.items()}
    trace = []
    tuned, rep = tune_layer(layer, canon, runner.inputs, runner.kwargs, targets, iters=12, lr=1e-2, seqs=2,
                            rounding=rounding, trace=trace)
    assert rep.kept and rep.after < rep.before and len(trace) == 12
    assert set(tuned) == set(canon)
    for n, cw in tuned.items():
        assert torch.equal(cw.zeros, canon[n].zeros) and cw.codes.max() <= 15
        moved = (cw.codes.int() - canon[n].codes.int()).abs()
        assert moved.max() <= (1 if rounding else 0)
    assert torch.equal(lins["self_attn.q_proj"].weight, layer.self_attn.q_proj.weight)  # the layer is not changed


def test_block_tuning_keeps_the_start_when_it_cannot_improve(layer_data):
    layer, runner, targets = layer_data
    lins = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    canon = {n: rtn_canonical(m.weight, 4, 32, False) for n, m in lins.items()}
    tuned, rep = tune_layer(layer, canon, runner.inputs, runner.kwargs, targets, iters=3, lr=10.0, seqs=1,
                            rounding=False)  # a huge step: the error goes up, the start is kept
    assert not rep.kept and tuned is canon and rep.after == rep.before


@pytest.mark.parametrize("args,msg", [
    (["--method", "gptq", "--rotate-heads"], "--rotate-heads needs --rotate"),
    (["--method", "rtn", "--awq-scale"], "--awq-scale applies to --method gptq"),
    (["--method", "awq", "--format", "awq", "--tune-iters", "5"], "--tune-iters applies to --method gptq"),
    (["--method", "gptq", "--refine-passes", "-1"], "--refine-passes must be >= 0"),
    (["--method", "gptq", "--tune-iters", "4", "--tune-seqs", "0"], "--tune-seqs must be >= 1"),
    (["--method", "gptq", "--tune-iters", "4", "--tune-lr", "0"], "--tune-lr > 0"),
])
def test_accuracy_flag_limits(tiny_llama_dir, tmp_path, capsys, args, msg):
    assert main(["quantize", "--model", tiny_llama_dir, "--out", str(tmp_path / "out"), "--device", "cpu",
                 *args]) == 2
    assert msg in capsys.readouterr().err


def test_rotate_choice_is_checked(tiny_llama_dir, tmp_path):
    with pytest.raises(SystemExit):
        main(["quantize", "--model", tiny_llama_dir, "--out", str(tmp_path / "out"), "--rotate", "givens"])
