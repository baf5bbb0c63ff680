"""GPU calibration (issue 18): ``tools.convert`` calibrating on CUDA, streaming one decoder layer at a time, writes
the checkpoint the CPU writes, up to rounding: same tensors, shapes, dtypes and config; codes equal where GPTQ's
error feedback and AWQ's grid did not turn on a float tie (a flipped rounding travels along its row); calibration
error as low as the CPU's. Peak CUDA memory stays within a bound computed from one decoder layer's size, far below
the model's. Checkpoints are built without a tokenizer (token-id calibration), so no demo model is needed."""
from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from helpers import build_tiny_model  # noqa: E402

SMALL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
             num_hidden_layers=2, initializer_range=0.08, tie_word_embeddings=False)
# many layers, each bigger than everything else the calibration holds at once: a whole-model path could not fit the
# bound of test_peak_memory_is_about_one_layer
DEEP = dict(hidden_size=384, intermediate_size=768, num_attention_heads=6, num_key_value_heads=2, vocab_size=256,
            num_hidden_layers=24, initializer_range=0.05, tie_word_embeddings=False)
# name: (method, ExportSpec fields, codes compared: the fraction that must be equal or None = quality only,
#        CalibOptions fields of the CUDA run)
CASES = {
    "gptq-sym": ("gptq", dict(fmt="gptq", group_size=32), 0.9, {}),
    "gptq-sym-offload": ("gptq", dict(fmt="gptq", group_size=32), 0.9, dict(offload_activations=True)),
    "gptq-asym-drift": ("gptq", dict(fmt="gptq_v2", group_size=32, sym=False, drift_alpha=0.25), 0.9, {}),
    "gptq-act-static-mse": ("gptq", dict(fmt="gptq", group_size=32, desc_act=True, static_groups=True, mse=True),
                            None, {}),
    "awq": ("awq", dict(fmt="awq", group_size=32, sym=False), 0.9, dict(awq_clip=True)),
    "smoothquant": ("smoothquant", dict(fmt="w8a8", bits=8, group_size=-1), 0.99, dict(offload_activations=True)),
    "rtn-lmhead": ("rtn", dict(fmt="gptq", group_size=32, quantize_lm_head=True), 0.999, {}),
}


def build_checkpoints(root: str, names: list[str] | None = None) -> dict[str, str]:
    """The float checkpoints this module calibrates (fp32 safetensors, no tokenizer)."""
    shapes = {"small": SMALL, "deep": DEEP}
    return {name: build_tiny_model(os.path.join(root, name), "llama", tokenizer=False, **shape)
            for name, shape in shapes.items() if not names or name in names}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(str(tmp_path_factory.mktemp("calib-gpu")))


def _ids(vocab: int, n: int, t: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(0))


def _quantize(model_dir: str, out: str, method: str, spec_kw: dict, device: str, ids: torch.Tensor, batch: int = 4,
              **opts_kw):
    from tools.convert import ExportSpec
    from tools.convert.quantize import CalibOptions, quantize_checkpoint

    opts = CalibOptions(num_samples=ids.shape[0], seq_len=ids.shape[1], batch_size=batch, device=device, **opts_kw)
    return quantize_checkpoint(model_dir, out, method, ExportSpec(**spec_kw), opts, overwrite=True, input_ids=ids)[1]


def _tensors(d: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_calibration_matches_cpu(checkpoints, tmp_path, case):
    method, spec_kw, min_equal, opts_kw = CASES[case]
    ids = _ids(SMALL["vocab_size"], 8, 64)
    same = {k: v for k, v in opts_kw.items() if k != "offload_activations"}
    res = {dev: _quantize(checkpoints["small"], str(tmp_path / dev), method, spec_kw, dev, ids,
                          **(opts_kw if dev == "cuda" else same)) for dev in ("cpu", "cuda")}
    cpu, gpu = _tensors(str(tmp_path / "cpu")), _tensors(str(tmp_path / "cuda"))
    assert sorted(cpu) == sorted(gpu)
    assert all(cpu[k].shape == gpu[k].shape and cpu[k].dtype == gpu[k].dtype for k in cpu)
    for f in ("config.json",):
        with open(tmp_path / "cpu" / f) as a, open(tmp_path / "cuda" / f) as b:
            assert json.load(a) == json.load(b)
    unquantized = [k for k in cpu if not any(k.startswith(n + ".") for n in res["cpu"].canon)]
    for k in unquantized if method != "awq" else []:  # embeddings, norms (SmoothQuant's folded scales: close)
        # SmoothQuant folds max|X|^alpha into a layer's norms; past layer 0, X comes through the int8 layers before,
        # whose codes may differ on a float tie (min_equal), and their max moves by up to a code step (rtol 2e-2;
        # 1e-3 failed for layer 1 on the H200 at 3382fc4)
        later = method == "smoothquant" and not k.startswith(("model.embed_tokens.", "model.layers.0."))
        rel = ((gpu[k].float() - cpu[k].float()).abs() / cpu[k].float().abs().clamp_min(1e-6)).max().item()
        torch.testing.assert_close(gpu[k].float(), cpu[k].float(), rtol=2e-2 if later else 1e-3, atol=1e-5,
                                   msg=lambda m, k=k, rel=rel: f"{k}: max relative difference {rel:.2e}\n{m}")
    assert set(res["cpu"].canon) == set(res["cuda"].canon)
    for cw in res["cuda"].canon.values():
        assert cw.codes.device.type == "cpu" and cw.scales.device.type == "cpu"
    if min_equal is not None:
        equal = sum(int((res["cpu"].canon[n].codes == cw.codes).sum()) for n, cw in res["cuda"].canon.items())
        total = sum(cw.codes.numel() for cw in res["cuda"].canon.values())
        assert equal / total >= min_equal, f"{case}: only {equal / total:.4f} of the codes agree with the CPU"
    if method != "rtn":  # the same objective met as well: the mean relative error of the layers' outputs
        e_cpu, e_gpu = statistics.mean(res["cpu"].layer_errors), statistics.mean(res["cuda"].layer_errors)
        assert e_gpu <= 1.5 * e_cpu + 1e-6, (e_cpu, e_gpu)


def _layer_bytes(cfg: dict) -> tuple[int, int]:
    """fp32 bytes of one decoder layer and the largest input width of its linears."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    params = h * h * 2 + 2 * kv * h + 3 * h * inter + 2 * h
    return 4 * params, max(h, inter)


def _warm_up(dev: torch.device) -> None:
    """Allocate cuBLAS / cuSOLVER workspaces before the baseline: they stay, whoever uses them first."""
    a = torch.randn(256, 256, device=dev)
    (a @ a).sum().item()
    h = (a.double() @ a.double().t()) + 256 * torch.eye(256, device=dev, dtype=torch.float64)
    torch.linalg.cholesky(h).sum().item()
    q = torch.randn(1, 4, 64, 64, device=dev)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().item()


def test_peak_memory_is_about_one_layer(checkpoints, tmp_path):
    dev = torch.device("cuda", torch.cuda.current_device())
    n, t, batch = 4, 64, 4
    layer, kmax = _layer_bytes(DEEP)
    whole = layer * DEEP["num_hidden_layers"]
    non_layer = 4 * (2 * DEEP["vocab_size"] * DEEP["hidden_size"] + DEEP["hidden_size"])
    acts = 4 * n * t * DEEP["hidden_size"]
    batch_mlp = 4 * batch * t * DEEP["intermediate_size"]
    # one layer (+ its dequantized copies), GPTQ's float64 Hessian work (the accumulator, H, two Cholesky steps, with
    # room), the calibration activations and one batch's MLP temporaries, the embedding / lm_head, 8 MiB of slack
    bound = 2 * layer + 5 * kmax * kmax * 8 + 4 * acts + 3 * batch_mlp + non_layer + (8 << 20)
    assert bound < whole / 2, "the model is too small for the bound to mean anything"
    gc.collect()
    torch.cuda.empty_cache()
    _warm_up(dev)
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    res = _quantize(checkpoints["deep"], str(tmp_path / "out"), "gptq", dict(fmt="gptq", group_size=128), "cuda",
                    _ids(DEEP["vocab_size"], n, t), batch)
    peak = torch.cuda.max_memory_allocated(dev) - base
    assert len(res.layer_seconds) == DEEP["num_hidden_layers"]
    assert peak <= bound, (f"peak {peak / 2**20:.1f} MiB above the start, bound {bound / 2**20:.1f} MiB (one layer "
                           f"{layer / 2**20:.1f} MiB, the whole model {whole / 2**20:.1f} MiB)")
    assert torch.cuda.memory_allocated(dev) - base < layer, "calibration left tensors on the GPU"


def test_random_reader_draws_on_the_gpu_and_calibrates_from_it(tmp_path):
    """Issue 27's one-call source: benchmarks/common.RandomCheckpointReader draws each tensor on the GPU in bf16, the
    same at every read (a resumed calibration reads layers again), and a CUDA calibration reads every float tensor
    from it: nothing but config.json on disk."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "benchmarks"))
    import calibration_gpu as cg
    from common import RandomCheckpointReader

    config, model_cls = cg.llama_config(dict(cg.TINY))
    reader = RandomCheckpointReader(config, model_cls, seed=0)
    assert reader.draw_device.type == "cuda"
    keys = reader.keys()
    a = reader.get_many(keys, "cuda", torch.float32)
    b = reader.get_many(list(reversed(keys)), "cpu")
    for k in keys:
        assert a[k].device.type == "cuda" and a[k].dtype == torch.float32 and b[k].dtype == torch.bfloat16
        assert torch.equal(a[k].cpu(), b[k].float()), k
    cfg_dir = reader.save_config(str(tmp_path / "cfg"))
    ids = _ids(config.vocab_size, 4, 32)
    from tools.convert import ExportSpec
    from tools.convert.quantize import CalibOptions, quantize_checkpoint

    opts = CalibOptions(num_samples=4, seq_len=32, batch_size=2, device="cuda")
    _, res = quantize_checkpoint(cfg_dir, str(tmp_path / "out"), "gptq",
                                 ExportSpec(fmt="gptq_v2", sym=False, desc_act=True, group_size=64), opts,
                                 overwrite=True, input_ids=ids, reader=reader)
    assert sorted(os.listdir(cfg_dir)) == ["config.json"] and len(res.layer_seconds) == config.num_hidden_layers
    assert 0 < statistics.mean(res.layer_errors) < 1


# fp32 matmuls of a TF32 process: (A @ B) against fp64, as mean |error| over mean |A @ B|. TF32 rounds each input to
# 10 mantissa bits (~3e-4 relative); IEEE fp32 accumulation over K = 1024 stays below 1e-6 (3.2e-7
# with these inputs on the CPU). The bound sits between.
TF32_GUARD = """
import sys, torch
from tools.convert.streaming import fp32_matmuls
if sys.argv[1] == "legacy":
    torch.set_float32_matmul_precision("high")
else:
    torch.backends.cuda.matmul.fp32_precision = "tf32"
g = torch.Generator(device="cuda").manual_seed(0)
a = torch.randn(512, 1024, device="cuda", generator=g)
b = torch.randn(1024, 512, device="cuda", generator=g)
ref = a.double() @ b.double()
def err():
    return ((a @ b).double() - ref).abs().mean().item() / ref.abs().mean().item()
outside = err()
with fp32_matmuls():
    inside = err()
after = err()
print(f"outside {outside:.2e} inside {inside:.2e} after {after:.2e}")
"""


@pytest.mark.parametrize("api", ["legacy", "new"])
def test_fp32_matmuls_turns_tf32_off_on_cuda(api):
    """Calibration's Hessians are fp32 sums: inside ``fp32_matmuls`` a CUDA matmul of a process that chose TF32 (by
    either torch API) is IEEE fp32, and TF32 is back after it. Run in a fresh interpreter: the API state is
    process-wide."""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", TF32_GUARD, api], capture_output=True, text=True, cwd=str(repo),
                          env=dict(os.environ, PYTHONPATH=str(repo)), timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    outside, inside, after = (float(words[i]) for i in (1, 3, 5))
    bound = 3e-5
    assert outside > bound and after > bound, proc.stdout  # TF32 was on, so the check below can fail
    assert inside < bound, proc.stdout
