"""RMSNorm / SiLU-mul fused with the per-token int8 quantization (lqe/kernels/fused_quant.py) and its wiring into
W8A8 models (lqe/layers/act_quant_fusion.py).

The contract is EXACTLY the bits of the unfused path: the float op of lqe/kernels/fused_ops.py (its output rounded to
the activation dtype), then the reference quantizer (``per_token_quant_int8``, evaluated on CPU, where every quotient
is the IEEE one) and, on CUDA, the quantization kernel of csrc/gemm/quant_per_token.cu. Against the torch twins the
kernels agree bit for bit wherever the float activation does (on CPU under Triton's interpreter: everywhere; on a GPU
the Triton norm / silu may differ from torch in the last bit of a few elements, which moves q by at most 1).

The ``check_*`` helpers also run on CPU under ``TRITON_INTERPRET=1`` (tests/test_act_quant_fusion.py). The model
tests: a tiny W8A8 dynamic-symmetric checkpoint gives the same greedy tokens and prompt logprobs with the fusion on
and off (``LQE_FUSED_ACT_QUANT=0``), eager and with CUDA graphs.
"""
from __future__ import annotations

import os

import pytest
import torch

EPS = 1e-6
# weights of the first columns: on a row of +-1 the norm gives exactly +-1, so y = w: absmax 127, inv 1, and these
# products land on .5 ties (round half to even: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2, -0.5 -> 0, 126.5 -> 126)
TIES = [127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, 126.5, -126.5, 0.0]
TIES_Q = [127, 2, 4, -2, 0, 0, 2, 126, -126, 0]
# special rows (when M allows): 0 a tie row, 1 all zeros, 2 large magnitude (x1000), 3 one dominant spike
SPECIAL = 4


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def norm_inputs(m: int, k: int, dtype: torch.dtype, residual: bool, seed: int = 0):
    """``x`` (a strided view), ``residual`` or None, ``weight``: random rows plus the special rows above."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(m, k + 24, generator=g)
    r = torch.randn(m, k, generator=g) if residual else None
    w = 1 + 0.5 * torch.randn(k, generator=g)
    n_ties = min(len(TIES), k)
    w[:n_ties] = torch.tensor(TIES[:n_ties])
    x = wide[:, :k]
    rows = {0: torch.ones(k), 1: torch.zeros(k), 2: x[2] * 1000 if m > 2 else None, 3: torch.full((k,), 0.01)}
    if m > 3:
        rows[3][k // 2] = 3e4
    for i, row in rows.items():
        if i < m and row is not None:
            if residual:  # split the row between x and the residual, exactly (halves of a dtype value)
                x[i] = row.to(dtype).float() / 2
                r[i] = row.to(dtype).float() / 2
            else:
                x[i] = row
    return wide.to(dtype)[:, :k], (r.to(dtype) if residual else None), w.to(dtype)


def silu_inputs(m: int, inter: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """``[gate | up]`` rows: random, plus 0 a tie row (gate 32: silu = 32 exactly; up = TIES / 32), 1 up = 0 (signed
    zeros), 2 large magnitude, 3 one dominant spike."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * inter, generator=g)
    gate, up = x[:, :inter], x[:, inter:]
    n_ties = min(len(TIES), inter)
    if m > 0:
        gate[0] = 32.0
        up[0] = 0.25
        up[0, :n_ties] = torch.tensor(TIES[:n_ties]) / 32
    if m > 1:
        up[1] = 0.0
    if m > 2:
        gate[2] *= 8
        up[2] *= 50
    if m > 3:
        gate[3, inter // 2], up[3, inter // 2] = 20.0, 900.0
    return x.to(dtype)


def _expect_special(q: torch.Tensor, s: torch.Tensor, m: int, k: int, what: str) -> None:
    n_ties = min(len(TIES), k)
    assert s[0].item() == 1.0 and q[0, :n_ties].tolist() == TIES_Q[:n_ties], (what, s[0].item(), q[0, :n_ties].tolist())
    if m > 1:
        assert s[1].item() == 0.0 and not q[1].any(), (what, "zero row", s[1].item())
    assert (q.abs().amax(-1) == 127).sum() == m - (1 if m > 1 else 0), (what, "every nonzero row reaches +-127")


def _cuda_quant(y: torch.Tensor):
    """The CUDA quantization kernel of the unfused path on ``y`` (None when the lqe extension is not built)."""
    from lqe.kernels import gemm
    from lqe.kernels import w8a8 as kw

    if y.device.type != "cuda" or not gemm.available():
        return None
    q, s, _ = kw.quantize_per_token(y.reshape(-1, y.shape[-1]))
    return q, s


def _compare(q, s, y, twin_q, twin_s, twin_y, what: str) -> dict:
    """``(q, s)`` of a fused kernel against the reference quantizer on the unfused op's output ``y`` (exact), the CUDA
    quantization kernel on it (exact), and the torch twin (exact on the rows where ``y`` equals the twin's)."""
    from lqe.quant_layers.reference import per_token_quant_int8

    q, s, y = q.reshape(-1, q.shape[-1]).cpu(), s.reshape(-1, 1).cpu(), y.reshape(-1, y.shape[-1])
    ref_q, ref_s, _ = per_token_quant_int8(y.cpu(), True)
    assert torch.equal(s, ref_s), (what, "scale != reference(unfused)", (s - ref_s).abs().max().item())
    assert torch.equal(q, ref_q), (what, "q != reference(unfused)", int((q != ref_q).sum()))
    cuda = _cuda_quant(y)
    if cuda is not None:
        assert torch.equal(s.reshape(-1), cuda[1].cpu()), (what, "scale != quant_per_token.cu")
        assert torch.equal(q, cuda[0].cpu()), (what, "q != quant_per_token.cu", int((q != cuda[0].cpu()).sum()))
    twin_q, twin_s = twin_q.reshape(q.shape), twin_s.reshape(s.shape)
    same = (y.cpu() == twin_y.reshape(y.shape)).all(-1)
    if _interpreting():
        assert same.all(), (what, "the interpreter's float op should equal torch's", int((~same).sum()))
    assert torch.equal(q[same], twin_q[same]) and torch.equal(s[same], twin_s[same]), (what, "q/scale != twin")
    assert (q.int() - twin_q.int()).abs().max() <= 1, (what, "more than one code off the twin")
    assert ((s - twin_s).abs() <= 2 ** -6 * twin_s).all(), (what, "scale off the twin by more than an ulp or two of bf16")
    return {"rows_like_twin": int(same.sum()), "rows": len(same)}


def check_rms_norm_quant(m: int, k: int, dtype: torch.dtype, device: str, residual: bool = True) -> dict:
    from lqe.kernels import fused_ops as fo
    from lqe.kernels import fused_quant as fq

    x, r, w = norm_inputs(m, k, dtype, residual)
    xd, rd, wd = x.to(device), (r.to(device) if residual else None), w.to(device)
    q, s, new_r = fq.rms_norm_quant_int8(xd, wd, EPS, rd)
    assert q.dtype == torch.int8 and q.shape == (m, k) and s.dtype == torch.float32 and s.shape == (m, 1)
    y = fo.rms_norm(xd, wd, EPS, rd)
    if residual:
        y, ref_r = y
        assert torch.equal(new_r, ref_r), "residual != rms_norm's residual"
        assert new_r.dtype == dtype and new_r.shape == (m, k)
    else:
        assert new_r is None
    tq, ts, tr = fq.rms_norm_quant_int8_torch(x, w, EPS, r)
    ty = fo.rms_norm_torch(x, w, EPS, r)
    if residual:
        ty, _ = ty
        assert torch.equal(new_r.cpu(), tr), "residual != the twin's (x + residual in the activation dtype)"
    what = f"rms_norm_quant_int8 M={m} K={k} {dtype} residual={residual} on {device}"
    _expect_special(q.cpu(), s.cpu(), m, k, what)
    _expect_special(tq, ts, m, k, what + " (twin)")
    return _compare(q, s, y, tq, ts, ty, what)


def check_silu_mul_quant(m: int, inter: int, dtype: torch.dtype, device: str, chunk: int | None = None) -> dict:
    """``chunk``: force that many columns per chunk (the multi-pass path of long rows) by setting SILU_CHUNK."""
    from lqe.kernels import fused_ops as fo
    from lqe.kernels import fused_quant as fq

    x = silu_inputs(m, inter, dtype)
    saved = fq.SILU_CHUNK
    fq.SILU_CHUNK = chunk or saved
    try:
        q, s = fq.silu_mul_quant_int8(x.to(device))
    finally:
        fq.SILU_CHUNK = saved
    assert q.dtype == torch.int8 and q.shape == (m, inter) and s.dtype == torch.float32 and s.shape == (m, 1)
    y = fo.silu_and_mul(x.to(device))
    tq, ts = fq.silu_mul_quant_int8_torch(x)
    what = f"silu_mul_quant_int8 M={m} I={inter} {dtype} chunk={chunk} on {device}"
    _expect_special(q.cpu(), s.cpu(), m, inter, what)
    _expect_special(tq, ts, m, inter, what + " (twin)")
    return _compare(q, s, y, tq, ts, fo.silu_and_mul_torch(x), what)


def probe_inputs(dtype: torch.dtype, rows: int = 12, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU-mul inputs whose activation is EVERY ``dtype`` value ``v`` with ``2^-8 <= |v| <= absmax`` of the row (gate 32:
    silu = 32 exactly; up = v / 32, exact), zero-padded, for ``rows`` values of absmax (127, 508: ties of inv 1 and
    1/4; then random): an exhaustive test of the quantizer's division and rounding. Returns (x, activation)."""
    g = torch.Generator().manual_seed(seed)
    absmaxes = torch.cat([torch.tensor([127.0, 508.0]), torch.exp(torch.rand(rows - 2, generator=g) * 10.5)]).to(dtype)
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).float()
    every = every[torch.isfinite(every) & (every.abs() >= 2 ** -8)].unique()
    vals = [every[every.abs() <= a] for a in absmaxes.float().tolist()]
    inter = max(len(v) for v in vals)
    y = torch.zeros(rows, inter)
    for i, v in enumerate(vals):
        y[i, :len(v)] = v
    return torch.cat([torch.full((rows, inter), 32.0), y / 32], -1).to(dtype), y.to(dtype)


def check_quantizer_exhaustive(dtype: torch.dtype, device: str) -> dict:
    from lqe.kernels import fused_ops as fo
    from lqe.kernels import fused_quant as fq

    x, act = probe_inputs(dtype)
    y = fo.silu_and_mul(x.to(device))
    assert torch.equal(y.cpu(), act) and torch.equal(fo.silu_and_mul_torch(x), act), "probe construction"
    q, s = fq.silu_mul_quant_int8(x.to(device))
    tq, ts = fq.silu_mul_quant_int8_torch(x)
    return _compare(q, s, y, tq, ts, act, f"quantizer probe {dtype} on {device}")


def check_leading_dims_and_empty(device: str) -> None:
    from lqe.kernels import fused_quant as fq

    x, r, w = norm_inputs(6, 96, torch.float16, True)
    q, s, nr = fq.rms_norm_quant_int8(x.to(device).reshape(2, 3, 96), w.to(device), EPS, r.to(device).reshape(2, 3, 96))
    assert q.shape == (2, 3, 96) and s.shape == (2, 3, 1) and nr.shape == (2, 3, 96)
    q0, s0, r0 = fq.rms_norm_quant_int8(x.to(device)[:0], w.to(device), EPS, r.to(device)[:0])
    assert q0.shape == (0, 96) and s0.shape == (0, 1) and r0.shape == (0, 96)
    q0, s0 = fq.silu_mul_quant_int8(torch.zeros(0, 64, dtype=torch.float16, device=device))
    assert q0.shape == (0, 32) and s0.shape == (0, 1)


# ------------------------------------------------------------------------------------------------ GPU tests
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from test_model_matrix import FORMATS, PROMPT, gen_requests, release_memory  # noqa: E402
from test_model_matrix import build_checkpoints as build_matrix  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 26, 257])
@pytest.mark.parametrize("k", [96, 200, 576, 4096, 5120])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_quant_bits(m, k, dtype, residual):
    check_rms_norm_quant(m, k, dtype, "cuda", residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 26, 257])
@pytest.mark.parametrize("inter", [200, 1536, 4864, 14336])
def test_silu_mul_quant_bits(m, inter, dtype):
    check_silu_mul_quant(m, inter, dtype, "cuda")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_quant_multi_chunk_bits(dtype):
    check_silu_mul_quant(7, 1000, dtype, "cuda", chunk=128)


def test_leading_dims_and_empty():
    check_leading_dims_and_empty("cuda")


def test_fused_kernels_capture_in_a_cuda_graph():
    from lqe.kernels import fused_quant as fq

    x, r, w = (t.cuda() for t in norm_inputs(8, 576, torch.bfloat16, True))
    a = silu_inputs(8, 1536, torch.bfloat16).cuda()
    want = fq.rms_norm_quant_int8(x, w, EPS, r), fq.silu_mul_quant_int8(a)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fq.rms_norm_quant_int8(x, w, EPS, r), fq.silu_mul_quant_int8(a)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fq.rms_norm_quant_int8(x, w, EPS, r), fq.silu_mul_quant_int8(a)
    graph.replay()
    torch.cuda.synchronize()
    for g, e in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        assert torch.equal(g, e)


# ------------------------------------------------------------------------------------------------ model
W8A8 = "ct-w8a8-dynamic-sym"
FP8_BLOCK = "fp8-block-dynamic"
# every scheme a producer emits: int8 dynamic sym / asym, int8 static sym / asym, fp8 per token, fp8 per 1x128 group
LINKED = {W8A8: "int8-per-token-sym", "ct-w8a8-dynamic-asym": "int8-per-token-asym",
          "ct-w8a8-static-sym-tensor-weights": "int8-static(sym)", "ct-w8a8-static-asym": "int8-static(asym)",
          "ct-fp8-channel-dynamic": "fp8-per-token", FP8_BLOCK: "fp8-per-group(128)"}
ENGINE = dict(device="cuda", max_num_seqs=8, max_cudagraph_batch=8, num_kv_blocks=80, block_size=8, max_model_len=96)
NUM_REQUESTS = 6


def _fp8_block_checkpoint(root: str) -> str:
    """Llama with 128x128 block-scaled fp8 weights and dynamic activations (every shard and K a multiple of 128)."""
    from helpers import build_tiny_model, write_quantized_checkpoint

    base = build_tiny_model(os.path.join(root, "base-128"), "llama", tokenizer=False, hidden_size=128,
                            intermediate_size=256, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                            vocab_size=1024, initializer_range=0.08)

    def encode(name: str, w: torch.Tensor) -> dict:
        n, k = w.shape
        s = w.reshape(n // 128, 128, k // 128, 128).abs().amax((1, 3)).clamp(min=1e-12) / 448.0
        q = (w / s.repeat_interleave(128, 0).repeat_interleave(128, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": s}

    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                                "block_structure": [128, 128]},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                                   "dynamic": True}}
    return write_quantized_checkpoint(base, os.path.join(root, FP8_BLOCK), encode, {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "config_groups": {"group_0": group}})


def build_checkpoints(root: str, names: list[str] | None = None) -> dict[str, str]:
    """The model-matrix checkpoints of every linked scheme, and the 128x128 block-scaled fp8 one."""
    names = list(LINKED) if names is None else names
    dirs = build_matrix(root, [n for n in names if n != FP8_BLOCK])
    if FP8_BLOCK in names:
        dirs[FP8_BLOCK] = _fp8_block_checkpoint(root)
    return dirs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return build_checkpoints(str(tmp_path_factory.mktemp("fused-act-quant")))


def _fp8_gpu() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


def _generate(model_dir: str, dtype: str, eager: bool, fused: bool, monkeypatch) -> dict:
    from lqe import LLM, SamplingParams
    from lqe.layers.act_quant_fusion import ENV

    with monkeypatch.context() as mp:
        mp.setenv(ENV, "1" if fused else "0")
        llm = LLM(model_dir, dtype=dtype, enforce_eager=eager, **ENGINE)
        runner = llm.llm_engine.runner
        pairs = list(runner.fused_act_quant)
        schemes = {str(m.output_quant) for m in runner.model.modules() if getattr(m, "output_quant", None) is not None}
        assert (runner.graph_runner is None) == eager
        prompts, lengths = gen_requests(NUM_REQUESTS)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in lengths]
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        plp = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)[0].prompt_logprobs
        del llm, runner
    release_memory()
    return {"pairs": pairs, "schemes": schemes, "tokens": [list(o.token_ids) for o in outs],
            "logprobs": torch.tensor([o.logprobs[t][tok].logprob for o in outs for t, tok in enumerate(o.token_ids)]),
            "prompt": torch.tensor([plp[j][PROMPT[j]].logprob for j in range(1, len(PROMPT))])}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("eager", [True, False])
def test_w8a8_model_same_with_and_without_fusion(dtype, eager, checkpoints, monkeypatch):
    assert FORMATS[W8A8].path == "w8a8"
    _same_with_and_without_fusion(W8A8, dtype, eager, checkpoints, monkeypatch)


@pytest.mark.parametrize("name", [n for n in LINKED if n != W8A8])
def test_every_scheme_model_same_with_and_without_fusion(name, checkpoints, monkeypatch):
    """Asymmetric / static int8 and fp8 (per token, per 1x128 group) producers linked into the model, with CUDA
    graphs: the same tokens, the same logprobs up to float noise. On a GPU without FP8 the fp8 layers run weight-only
    and nothing is linked."""
    linked = not name.startswith(("ct-fp8", "fp8")) or _fp8_gpu()
    _same_with_and_without_fusion(name, "bfloat16", False, checkpoints, monkeypatch, linked)


def _same_with_and_without_fusion(name, dtype, eager, checkpoints, monkeypatch, linked=True):
    on = _generate(checkpoints[name], dtype, eager, True, monkeypatch)
    off = _generate(checkpoints[name], dtype, eager, False, monkeypatch)
    if linked:
        assert len(on["pairs"]) == 6 and {p.split(".")[2] for p, _ in on["pairs"]} == {"0", "1"}, on["pairs"]
        assert on["schemes"] == {LINKED[name]}, on["schemes"]
    else:
        assert on["pairs"] == []
    assert off["pairs"] == []
    assert on["tokens"] == off["tokens"]
    # the quantized activations are the same bits, so everything downstream is too; allow only float noise
    assert (on["logprobs"] - off["logprobs"]).abs().max().item() <= 1e-3
    assert (on["prompt"] - off["prompt"]).abs().max().item() <= 1e-3
