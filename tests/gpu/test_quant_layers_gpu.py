"""GPU: quant layers on CUDA run the lqe kernels (W4A16/W8A16, W8A8 int8, FP8 via torch._scaled_mm) and match the
CPU reference path; a SmolLM2-shaped random model gives the same prompt logprobs on GPU as on CPU."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

import lqe.kernels as kernels  # noqa: E402
from helpers import build_tiny_model, write_quantized_checkpoint  # noqa: E402
from lqe.quant_layers import reference as ref  # noqa: E402
from lqe.quant_layers import wna16_kernels  # noqa: E402
from test_kernel_selection import awq_layer, fp8_layer, gptq_layer, w8a8_layer  # noqa: E402  (builders; tests/ is on sys.path)

DTYPES = [torch.float16, torch.bfloat16]
MS = [1, 7, 33, 200]  # 200 > LARGE_M_THRESHOLD: the dequantize + cuBLAS branch of the W4A16 kernel


@pytest.fixture(scope="module", autouse=True)
def built():
    if not kernels.available():
        pytest.fail(f"lqe CUDA kernels did not build: {kernels.unavailable_reason()}")


def tol(dtype):
    return 2e-2 if dtype == torch.bfloat16 else 5e-3


def rel_err(a, b):
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def compare(cpu_layer, gpu_layer, k, dtype, ms=MS, bound=None):
    """GPU output in ``dtype`` against the fp32 CPU path on the same (``dtype``-rounded) activations."""
    for m in ms:
        x = torch.randn(m, k).to(dtype)
        want = cpu_layer(x.float())
        got = gpu_layer(x.cuda())
        torch.cuda.synchronize()
        assert got.dtype == dtype and got.is_cuda and not torch.isnan(got).any()
        err = rel_err(got, want)
        assert err < (bound or tol(dtype)), (m, err)


WNA16_CASES = [  # bits, gs, sym, act, k, sizes
    (4, 128, True, False, 576, (576, 192, 192)),  # SmolLM2 qkv: 5 groups, the last one short
    (4, 128, False, True, 576, (576, 192, 192)),
    (4, 32, False, False, 256, (128, 64, 64)),
    (8, -1, True, False, 256, (128, 64, 64)),
    (8, 64, False, True, 512, (128, 64, 64)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,gs,sym,act,k,sizes", WNA16_CASES)
def test_gptq_layer_on_kernel(dtype, bits, gs, sym, act, k, sizes):
    cpu, _, _ = gptq_layer(bits, gs, sym, act, k, sizes)
    gpu, _, _ = gptq_layer(bits, gs, sym, act, k, sizes, dtype=dtype, device="cuda")
    desc = gpu.quant_method.describe(gpu)
    assert "cuda w4a16 kernel (lqe-wna16" in desc, desc
    assert isinstance(gpu.qkernel, wna16_kernels.CudaWNA16) and gpu.qkernel.qweight.is_cuda
    n = sum(sizes)
    assert all(t.numel() < k * n or t.dtype == torch.int32 for t in gpu.buffers())  # no float copy of W
    compare(cpu, gpu, k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_awq_layer_on_kernel(dtype):
    cpu, _ = awq_layer(576, (1536, 1536), 128)
    gpu, _ = awq_layer(576, (1536, 1536), 128, dtype=dtype, device="cuda")
    assert "cuda w4a16 kernel" in gpu.quant_method.describe(gpu)
    compare(cpu, gpu, 576, dtype)


def test_disabled_kernels_use_torch_path_on_gpu(monkeypatch):
    monkeypatch.setenv("LQE_DISABLE_CUDA_KERNELS", "1")
    monkeypatch.setattr(wna16_kernels, "_LOGGED", set())
    cpu, _, _ = gptq_layer()
    gpu, _, _ = gptq_layer(dtype=torch.bfloat16, device="cuda")
    desc = gpu.quant_method.describe(gpu)
    assert "dequant-matmul (cuda; disabled by LQE_DISABLE_CUDA_KERNELS)" in desc, desc
    compare(cpu, gpu, 576, torch.bfloat16, ms=[1, 33])


def test_unsupported_shape_falls_back_on_gpu(caplog):
    cpu, _, _ = gptq_layer(4, 32, False, False, 128, (48,), kind="plain")  # N=48: not a multiple of 64
    gpu, _, _ = gptq_layer(4, 32, False, False, 128, (48,), dtype=torch.float16, device="cuda", kind="plain")
    desc = gpu.quant_method.describe(gpu)
    assert "dequant-matmul (cuda; lqe-wna16 unavailable" in desc and "multiples of 64" in desc, desc
    compare(cpu, gpu, 128, torch.float16, ms=[1, 5])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static,sym", [(False, True), (False, False), (True, True), (True, False)])
def test_w8a8_layer_on_kernel(dtype, static, sym):
    cpu, w, b = w8a8_layer(static, sym)
    gpu, _, _ = w8a8_layer(static, sym, dtype=dtype, device="cuda")
    desc = gpu.quant_method.describe(gpu)
    assert "activations, cuda " in desc and "int8 GEMM (K=" in desc, desc  # a kernel of W8A8_TABLE, not torch._int_mm
    assert not hasattr(gpu, "w_int8_t") and any(t is not None and t.is_cuda for t in (gpu.w8a8_w, gpu.w8a8_qweight))
    # activation quantization differs only by rounding (asym: the kernel keeps 0 inside the range)
    compare(cpu, gpu, 256, dtype, bound=2e-2 if sym else 4e-2)
    x = torch.randn(9, 256).to(dtype)
    assert rel_err(gpu(x.cuda()), x.float() @ w.t() + b) < 0.05


@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a16_layer_on_kernel(dtype):
    cpu, _, _ = w8a8_layer(acts=False)
    gpu, _, _ = w8a8_layer(acts=False, dtype=dtype, device="cuda")
    assert "cuda w4a16 kernel" in gpu.quant_method.describe(gpu)
    compare(cpu, gpu, 256, dtype)


@pytest.mark.skipif(torch.cuda.is_available() and kernels.fp8_rowwise_reason("cuda") is not None,
                    reason="needs row-wise FP8 torch._scaled_mm (sm89+/Hopper)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strategy,static", [("channel", False), ("tensor", True)])
def test_fp8_layer_on_scaled_mm(dtype, strategy, static):
    cpu, _ = fp8_layer(strategy, static)
    gpu, _ = fp8_layer(strategy, static, dtype=dtype, device="cuda")
    assert "torch._scaled_mm (cuda)" in gpu.quant_method.describe(gpu)
    compare(cpu, gpu, 256, dtype, bound=0.1)  # fp8 activations against the weight-only CPU path


# --------------------------------------------------------------------------------------------- model level
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = [1, 520, 3100, 28, 9874, 41, 1023, 77, 4500, 12, 650, 3, 17, 905]
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=2,
               initializer_range=0.05)  # the helper's default 0.25 gives -30-nat logprobs that bf16 moves by ~1 nat
# max |logprob - fp32 CPU| allowed. The torch path on CPU measured (initializer_range 0.05): weight-only formats
# bf16 0.036-0.047, fp16 0.005-0.006; w8a8 0.13 either dtype (activation rounding flips int8 codes).
BOUND = {("float16", False): 0.05, ("bfloat16", False): 0.2, ("float16", True): 0.4, ("bfloat16", True): 0.4}


def _ct(weights, acts, fmt):
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


def _gptq(w):
    cw = ref.rtn_quantize(w, 4, 128, True)
    return ref.encode_gptq(cw, "gptq")


def _w8a8(w):
    q, s = ref.quantize_int8_per_channel(w)
    return {"weight": q, "weight_scale": s}


FORMATS = {
    "gptq-4bit-g128-sym": (_gptq, {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
                                   "checkpoint_format": "gptq"}),
    "awq-g128": (lambda w: ref.encode_awq(ref.rtn_quantize(w, 4, 128, False)),
                 {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "GEMM"}),
    "ct-w8a8-dynamic": (_w8a8, _ct({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                                   {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
                                   "int-quantized")),
}


def build_smollm2_shaped(path: str) -> str:
    return build_tiny_model(path, "llama", tokenizer=False, **SMOLLM2)  # token ids only: no demo model on GPU machines


def build_checkpoints(root: str, names: list[str] | None = None) -> dict[str, str]:
    """The checkpoints the model-level tests below load (tests/test_gpu_test_deps.py builds them without the demo
    model or any package a GPU machine lacks)."""
    base = build_smollm2_shaped(os.path.join(root, "smollm2-shaped"))
    dirs = {"smollm2-shaped": base}
    for fmt in names if names is not None else list(FORMATS):
        torch.manual_seed(0)
        dirs[fmt] = os.path.join(root, fmt)
        _write_quantized(base, dirs[fmt], *FORMATS[fmt])
    return dirs


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory):
    return build_smollm2_shaped(str(tmp_path_factory.mktemp("smollm2-shaped")))


def _write_quantized(base: str, out: str, encode, qcfg) -> None:
    write_quantized_checkpoint(base, out, lambda _name, w: encode(w), qcfg)


def _prompt_logprobs(model_dir: str, device: str, dtype: str) -> tuple[torch.Tensor, str]:
    from lqe import LLM, SamplingParams

    llm = LLM(model_dir, device=device, dtype=dtype, kv_cache_memory_bytes=64 << 20, max_model_len=256)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    desc = llm.llm_engine.quant_description() if hasattr(llm, "llm_engine") else ""
    lp = torch.tensor([out.prompt_logprobs[j][PROMPT[j]].logprob for j in range(1, len(PROMPT))])
    del llm
    torch.cuda.empty_cache()
    return lp, desc


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_smollm2_shaped_model_gpu_matches_cpu(fmt, dtype, smollm2_dir, tmp_path, monkeypatch):
    encode, qcfg = FORMATS[fmt]
    qdir = str(tmp_path / fmt)
    torch.manual_seed(0)
    _write_quantized(smollm2_dir, qdir, encode, qcfg)
    want, _ = _prompt_logprobs(qdir, "cpu", "float32")  # the CPU reference path
    got, desc = _prompt_logprobs(qdir, "cuda", dtype)  # lqe kernels
    if desc:
        assert ("cuda w4a16 kernel" in desc) if fmt != "ct-w8a8-dynamic" else ("activations, cuda " in desc), desc
        assert "torch path" not in desc and "unavailable" not in desc, desc
    monkeypatch.setenv("LQE_DISABLE_CUDA_KERNELS", "1")
    torch_gpu, _ = _prompt_logprobs(qdir, "cuda", dtype)  # the torch path in the same dtype, for scale
    err_kernel = (got - want).abs().max().item()
    err_torch = (torch_gpu - want).abs().max().item()
    # the kernels must be about as close to the fp32 CPU path as torch's own fp16/bf16 path, and close in absolute terms
    assert err_kernel <= 2 * err_torch + 0.1, (err_kernel, err_torch)
    assert err_kernel < BOUND[dtype, fmt == "ct-w8a8-dynamic"], (err_kernel, err_torch)
