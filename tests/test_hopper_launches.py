"""Every Triton launch the kernel wrappers make for the configurations a model runs (the dispatch tables' configs per
M bucket, each format's variants), compiled for sm_90 on a machine without a GPU (tests/hopper_compile.py): the
launch compiles, its PTX has no local memory and ptxas spills nothing. The interpreter tests check what the kernels
compute; this checks that the GPU compiler takes them as the wrappers launch them (the interpreter accepts code the
compiler refuses).

The GPU machine has Triton 3.6; CI may have a newer one. Run this file under the device's version too (README,
"GPU"): ``python -m venv --system-site-packages /tmp/t36 && /tmp/t36/bin/pip install --no-deps triton==3.6.0 &&
PYTHONPATH=$PWD /tmp/t36/bin/python -m pytest tests/test_hopper_launches.py``.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import re

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="compiling for a GPU needs triton's real JIT (not the interpreter)")

F8 = getattr(torch, "float8_e4m3fn", None)
SHAPE = (4096, 4096)  # K x N of a Llama-3-8B o_proj: every table config resolves on it as on the model's layers


def _compile_all(call, check_ptx=None) -> list[str]:
    """Compile every launch ``call()`` makes; the kernel names, after checking each one's PTX and spills (and
    ``check_ptx(name, ptx)`` when given)."""
    from hopper_compile import captured_launches, compile_launch, spill_bytes

    with captured_launches() as launches:
        call()
    assert launches, "the wrapper launched no Triton kernel"
    names = []
    for launch in launches:
        kernel = compile_launch(launch)
        ptx = kernel.asm["ptx"]
        assert ".local" not in ptx, f"{launch.name}: local memory in the PTX"
        assert spill_bytes(ptx) == 0, f"{launch.name}: ptxas spills registers"
        if check_ptx is not None:
            check_ptx(launch.name, ptx)
        names.append(launch.name)
    return names


def _ms(table) -> list[int]:
    """One M per row of a ``(max_m, config)`` table: each row's largest M (the last row: twice the one before)."""
    bounds = [m for m, _ in table if m is not None]
    return bounds + ([2 * bounds[-1] if bounds else 64] if table[-1][0] is None else [])


@pytest.fixture
def cpu_launches(monkeypatch):
    """The float ops take the Triton path for CPU tensors only under the interpreter; here their launches are
    captured, never run."""
    from lqe.kernels import fused_ops

    monkeypatch.setattr(fused_ops, "_INTERPRET", True)


def _int8(m, k, n):
    g = torch.Generator().manual_seed(m)
    return (torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g), torch.rand(m, 1) + 0.1,
            torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(n) + 0.1)


def _w8a8_ms():
    from lqe.kernels import triton_w8a8 as tw

    return _ms(tw.CONFIGS)


@pytest.mark.parametrize("m", _w8a8_ms())
@pytest.mark.parametrize("asym", [False, True])
def test_w8a8_gemm(m, asym):
    from lqe.kernels import triton_w8a8 as tw

    k, n = SHAPE
    xq, sa, w, sw = _int8(m, k, n)
    azp = torch.randint(-8, 8, (m, 1), dtype=torch.int32) if asym else None
    colsum = w.sum(1, dtype=torch.int32) if asym else None
    names = _compile_all(lambda: tw.w8a8_mm(xq, sa, w, sw, azp=azp, colsum=colsum,
                                            bias=torch.rand(n, dtype=torch.bfloat16) if asym else None))
    assert "_w8a8_mm_kernel" in names


def test_w8a8_epilogue_after_int_mm():
    from lqe.kernels import triton_w8a8 as tw

    m, n = 64, SHAPE[1]
    acc = torch.randint(-1000, 1000, (m, n), dtype=torch.int32)
    assert _compile_all(lambda: tw.w8a8_epilogue(acc, torch.rand(m, 1), torch.rand(n), azp=torch.ones(m, 1, dtype=torch.int32),
                                                 colsum=torch.ones(n, dtype=torch.int32))) == ["_epilogue_kernel"]


def _gemv_ms():
    from lqe.kernels import triton_gemv_w8a8 as tg

    return _ms(tg.CONFIGS)


@pytest.mark.parametrize("m", _gemv_ms())
@pytest.mark.parametrize("fp8", [False, True])
def test_gemv(m, fp8):
    from lqe.kernels import triton_gemv_w8a8 as tg

    if fp8 and F8 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    k, n = SHAPE
    xq, sa, w, sw = _int8(m, k, n)
    if fp8:
        xq, w = xq.float().div(8).to(F8), w.float().div(8).to(F8)
    assert _compile_all(lambda: tg.gemv_w8a8(xq, sa, w, sw)) == ["_gemv_kernel"]


def _fp8_ms():
    from lqe.kernels import triton_fp8 as tf

    return sorted(set(_ms(tf.CONFIGS)) | set(_ms(tf.BLOCK_CONFIGS)))


@pytest.mark.skipif(F8 is None, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("m", _fp8_ms())
@pytest.mark.parametrize("block", [False, True])
def test_fp8_gemm(m, block):
    from lqe.kernels import triton_fp8 as tf

    k, n = SHAPE
    xq = torch.randn(m, k).div(4).to(F8)
    w = torch.randn(n, k).div(4).to(F8)
    if block:
        sa, sw = torch.rand(m, k // 128) + 0.1, torch.rand(n // 128, k // 128) + 0.1
    else:
        sa, sw = torch.rand(m, 1) + 0.1, torch.rand(n) + 0.1
    assert _compile_all(lambda: tf.fp8_mm(xq, sa, w, sw, bias=torch.rand(n, dtype=torch.bfloat16),
                                          block_scale=block)) == ["_fp8_mm_kernel"]


@pytest.mark.skipif(F8 is None, reason="this torch has no float8_e4m3fn")
def test_fp8_gemm_split_k_reduction_fits_three_programs_per_sm(monkeypatch):
    """M = 64 on the o_proj shape with an H100 / H200's 132 SMs: split 5. Its last program summed the 5 partial
    64 x 64 tiles unrolled, every one live at once: 188 registers, 2 programs of 128 threads per SM (320 programs,
    1.21 waves). Pipelined (triton_fp8.red_stages) the same sums take <= 168: 3 per SM, one wave."""
    from hopper_compile import captured_launches, compile_launch, ptxas_usage
    from lqe.kernels import triton_fp8 as tf

    monkeypatch.setattr(tf, "sm_count", lambda device=None, cpu_default=8: 132)
    k, n = SHAPE
    xq, w = torch.randn(64, k).div(4).to(F8), torch.randn(n, k).div(4).to(F8)
    with captured_launches() as launches:
        tf.fp8_mm(xq, torch.rand(64, 1) + 0.1, w, torch.rand(n) + 0.1)
    (launch,) = launches
    assert launch.kwargs["SPLIT_K"] == 5 and launch.kwargs["RED_STAGES"] > 0, launch.kwargs
    regs, spills = ptxas_usage(compile_launch(launch).asm["ptx"])
    assert spills == 0 and regs * 128 * 3 <= 65536, regs


@pytest.mark.skipif(F8 is None, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("m", [1, 16])
def test_swapped_8bit_gemms_run_hopper_wgmma(m):
    """The swap_ab candidates (fp8 GEMM at M <= 16, the GEMV's tensor-core path, fp8 and int8): the weight tile is
    wgmma's M operand, so the 8-bit operands reach the tensor cores as they are (no e4m3 -> f16 conversion)."""
    from lqe.kernels import triton_fp8 as tf
    from lqe.kernels import triton_gemv_w8a8 as tg

    k, n = SHAPE
    xq, w = torch.randn(m, k).div(4).to(F8), torch.randn(n, k).div(4).to(F8)
    sa, sw = torch.rand(m, 1) + 0.1, torch.rand(n) + 0.1

    def check(name, ptx):
        assert "wgmma.mma_async" in ptx and "cvt.rn.f16x2.e4m3x2" not in ptx, name

    for precise in (True, False):  # fp32 promotion every BLOCK_K or Hopper's own fp8 accumulation
        cfg8 = tf.Fp8Config(16, 64, 128, 4, 4, 0, swap_ab=True, precise_acc=precise)
        assert _compile_all(lambda: tf.fp8_mm(xq, sa, w, sw, config=cfg8), check) == ["_fp8_mm_kernel"]
        cfg = tg.GemvConfig(64, 128, use_dot=True, swap_ab=True, precise_acc=precise)
        assert _compile_all(lambda: tg.gemv_w8a8(xq, sa, w, sw, config=cfg), check) == ["_gemv_kernel"]
    xi, wi = torch.randint(-127, 128, (m, k), dtype=torch.int8), torch.randint(-127, 128, (n, k), dtype=torch.int8)
    cfg = tg.GemvConfig(64, 128, use_dot=True, swap_ab=True)  # int8: IGMMA (no accumulation choice)
    assert _compile_all(lambda: tg.gemv_w8a8(xi, sa, wi, sw, config=cfg), check) == ["_gemv_kernel"]


def _wna16_cases():
    from lqe.kernels import triton_wna16 as tw

    cases = [(m, False, 4, True, torch.bfloat16) for m in _ms(tw.CONFIG_TABLE)]
    cases += [(m, True, 4, True, torch.bfloat16) for m in _ms(tw.SWAP_CONFIG_TABLE)]
    cases += [(16, swap, 8, False, torch.float16) for swap in (False, True)]  # W8A16 sym, fp16
    # symmetric 4-bit swapped: the inline-PTX magic-number dequantization (ASM_DQ=1), bf16 and fp16
    cases += [(m, True, 4, False, dt) for m in (16, 64) for dt in (torch.bfloat16, torch.float16)]
    return cases


@pytest.mark.parametrize("m,swap,bits,asym,dtype", _wna16_cases())
def test_wna16_gemm(m, swap, bits, asym, dtype):
    from lqe.kernels import repack, triton_wna16 as tw
    from lqe.kernels.canonical import CanonicalWeight

    k, n = SHAPE
    g = torch.Generator().manual_seed(m)
    cw = CanonicalWeight(torch.randint(0, 2**bits, (k, n), dtype=torch.uint8, generator=g),
                         torch.rand(k // 128, n, generator=g) * 0.01 + 0.001,
                         torch.randint(0, 2**bits, (k // 128, n), dtype=torch.uint8, generator=g) if asym else None,
                         None, bits, 128)
    p = repack.repack_wna16(cw, dtype)
    x = torch.randn(m, k, dtype=dtype)
    cfg = tw.pick_config(m, n, k, swap_ab=swap)
    names = _compile_all(lambda: tw.gemm(x, p, bias=torch.rand(n, dtype=dtype), config=cfg))
    assert names[0] == "_wna16_gemm_kernel"


def test_wna16_dequantize():
    from lqe.kernels import repack, triton_wna16 as tw
    from lqe.kernels.canonical import CanonicalWeight

    k, n = SHAPE
    cw = CanonicalWeight(torch.randint(0, 16, (k, n), dtype=torch.uint8), torch.rand(k // 128, n) + 0.01,
                         torch.randint(0, 16, (k // 128, n), dtype=torch.uint8), None, 4, 128)
    p = repack.repack_wna16(cw, torch.bfloat16)
    assert _compile_all(lambda: tw.dequantize(p)) == ["_wna16_dequant_kernel"]
    x = torch.randn(64, k, dtype=torch.bfloat16)  # triton-dequant-l2+cublas: one dequantize per column chunk
    assert _compile_all(lambda: tw.dequant_matmul(x, p, chunk_cols=1536)) == ["_wna16_dequant_kernel"] * 3


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_store_kv(cache):
    from lqe.kernels import triton_kv_store as tkv

    if cache == "fp8" and F8 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    t, kvh, d, blocks, page = 37, 8, 128, 16, 16
    key, value = torch.randn(t, kvh, d, dtype=torch.bfloat16), torch.randn(t, kvh, d, dtype=torch.bfloat16)
    kv = torch.empty(2, blocks, page, kvh, d, dtype=torch.bfloat16 if cache == "bf16" else F8)
    scales = (torch.ones(1), torch.ones(1)) if cache == "fp8" else (None, None)
    slots = torch.arange(t, dtype=torch.int64)
    assert _compile_all(lambda: tkv.store_kv(key, value, kv, slots, *scales)) == ["_store_kv_kernel"]
    if cache == "fp8":  # the quotient x / scale correctly rounded, as torch's (not div.full): the same fp8 codes
        from hopper_compile import captured_launches, compile_launch

        with captured_launches() as launches:
            tkv.store_kv(key, value, kv, slots, *scales)
        ptx = compile_launch(launches[0]).asm["ptx"]
        assert "div.rn.f32" in ptx and "div.full.f32" not in ptx
        # the saturating clamp keeps a NaN (plain min.f32 / max.f32 return the other operand: NaN -> -448)
        assert re.search(r"\b(min|max)\.NaN\.", ptx) and not re.search(r"\b(min|max)\.f32", ptx), \
            sorted(set(re.findall(r"\b(?:min|max)\.[\w.]+", ptx)))


@pytest.mark.parametrize("hidden", [576, 4096])
def test_float_ops(hidden, cpu_launches):
    from lqe.kernels import fused_ops as fo

    x = torch.randn(33, hidden, dtype=torch.bfloat16)
    w = torch.ones(hidden, dtype=torch.bfloat16)
    assert _compile_all(lambda: fo.rms_norm(x, w, 1e-5, residual=x.clone(), use_triton=True)) == ["_rms_norm_kernel"]
    assert _compile_all(lambda: fo.silu_and_mul(torch.randn(33, 2 * hidden, dtype=torch.bfloat16),
                                                use_triton=True)) == ["_silu_and_mul_kernel"]
    heads, d = hidden // 64, 64
    q, k = torch.randn(33, heads * d, dtype=torch.bfloat16), torch.randn(33, 2 * d, dtype=torch.bfloat16)
    cos_sin = torch.randn(512, d)
    pos = torch.arange(33)
    assert _compile_all(lambda: fo.rotary_embedding(pos, q, k, cos_sin, d, use_triton=True)) == ["_rotary_kernel"] * 2


@pytest.mark.parametrize("head_dim,group,cache", [(64, 3, "bf16"), (128, 4, "bf16"), (128, 4, "fp8"), (80, 3, "bf16"),
                                                   (64, 3, "f32"), (128, 4, "f32"), (80, 1, "f32")])
def test_paged_attention_mixed_step(head_dim, group, cache):
    """A mixed step (two prefill chunks beside three decodes, one of them long enough to split): the prefill tiles,
    the split decode and its reduction, as paged_attention launches them for the head dim and GQA group."""
    from lqe.forward_context import AttentionMetadata
    from lqe.kernels import triton_attention as ta

    if cache == "fp8" and F8 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    page, kvh = 16, 2
    specs = [(1, 4000), (37, 0), (1, 20), (70, 30), (1, 300)]  # (query tokens, cached tokens) per sequence
    qsl, lens = [0], []
    for q, c in specs:
        qsl.append(qsl[-1] + q)
        lens.append(q + c)
    blocks = -(-max(lens) // page)
    tables = torch.arange(len(specs) * blocks, dtype=torch.int32).view(len(specs), blocks)
    meta = AttentionMetadata(slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64),
                             query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
                             max_query_len=max(q for q, _ in specs), max_seq_len=max(lens), query_start_loc_cpu=qsl,
                             seq_lens_cpu=lens, block_size=page)
    dt = torch.float32 if cache == "f32" else torch.bfloat16  # f32: a float32 model (its cache is float32 too)
    query = torch.randn(qsl[-1], kvh * group, head_dim, dtype=dt)
    kv = torch.zeros(2, tables.numel(), page, kvh, head_dim, dtype=F8 if cache == "fp8" else dt)
    scales = (torch.ones(1), torch.ones(1)) if cache == "fp8" else (None, None)
    names = _compile_all(lambda: ta.paged_attention(query, kv, meta, head_dim ** -0.5, k_scale=scales[0],
                                                    v_scale=scales[1]))
    assert names == ["_prefill_kernel", "_decode_kernel", "_decode_reduce_kernel"], names


def _pdl_order(name: str, kernel) -> None:
    """A PDL kernel's PTX waits (griddepcontrol.wait) before its first global load or store in text order and lets
    the next kernel be scheduled (griddepcontrol.launch_dependents); in its SASS every path from the entry passes the
    wait (ACQBULK) before any global access or exit (.ci/sass_check.py's control-flow check: text order alone would
    miss a branch laid out before the wait, or ptxas moving a load)."""
    import subprocess
    import tempfile

    from triton.tools.disasm import path_to_cuobjdump

    ptx = kernel.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert wait >= 0 and "griddepcontrol.launch_dependents" in ptx, f"{name}: no griddepcontrol in the PTX"
    first = re.search(r"\b(ld|st|atom|red)\.global|\bcp\.async", ptx)
    assert first is not None and first.start() > wait, f"{name}: global memory touched before griddepcontrol.wait"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([path_to_cuobjdump(), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    assert "ACQBULK" in sass, f"{name}: no griddepcontrol.wait in the SASS"
    problems = _sass_check().check_pdl(sass)
    assert problems == [], f"{name}: {problems[:3]}"


@functools.cache
def _sass_check():
    spec = importlib.util.spec_from_file_location("sass_check", os.path.join(os.path.dirname(__file__), "..", ".ci",
                                                                             "sass_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pdl_launches_wait_before_any_global_access(monkeypatch, cpu_launches):
    """With LQE_PDL=1 on sm_90 (lqe.kernels.triton_pdl) each Triton kernel of a decode step (RMSNorm, SiLU-mul, the
    rotary, the KV store, the decode attention and its reduction) launches with launch_pdl and PDL=True, and its
    sm_90 PTX waits for the kernel before it ahead of every global load and store (a load hoisted above the wait
    would read the previous kernel's output before it is written). Without it, no griddepcontrol at all (sm_80
    has none)."""
    from lqe.forward_context import AttentionMetadata
    from lqe.kernels import fused_ops as fo, triton_attention as ta, triton_kv_store as tkv, triton_pdl
    from hopper_compile import captured_launches, compile_launch

    hidden, heads, d, page, kvh = 4096, 32, 128, 16, 8
    x, w = torch.randn(4, hidden, dtype=torch.bfloat16), torch.ones(hidden, dtype=torch.bfloat16)
    q, k = torch.randn(4, heads * d, dtype=torch.bfloat16), torch.randn(4, kvh * d, dtype=torch.bfloat16)
    kv = torch.zeros(2, 64, page, kvh, d, dtype=torch.bfloat16)
    lens = [900, 17, 300, 5]
    meta = AttentionMetadata(slot_mapping=torch.arange(4, dtype=torch.int64),
                             query_start_loc=torch.arange(5, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32),
                             block_tables=torch.arange(4 * 16, dtype=torch.int32).view(4, 16), max_query_len=1,
                             max_seq_len=max(lens), query_start_loc_cpu=list(range(5)), seq_lens_cpu=lens,
                             block_size=page)

    def step():
        fo.rms_norm(x, w, 1e-5, residual=x.clone(), use_triton=True)
        fo.rotary_embedding(torch.arange(4), q, k, torch.randn(1024, d), d, use_triton=True)
        tkv.store_kv(k.view(4, kvh, d), k.view(4, kvh, d), kv, meta.slot_mapping)
        ta.paged_attention(q.view(4, heads, d), kv, meta, d ** -0.5, num_splits=4)
        fo.silu_and_mul(torch.randn(4, 2 * hidden, dtype=torch.bfloat16), use_triton=True)

    monkeypatch.setattr(triton_pdl, "pdl_enabled", lambda device: True)
    with captured_launches() as launches:
        step()
    names = [launch.name for launch in launches]
    assert names == ["_rms_norm_kernel", "_rotary_kernel", "_rotary_kernel", "_store_kv_kernel", "_decode_kernel",
                     "_decode_reduce_kernel", "_silu_and_mul_kernel"], names
    for launch in launches:
        assert launch.kwargs.get("PDL") is True and launch.kwargs.get("launch_pdl") is True, launch.name
        _pdl_order(launch.name, compile_launch(launch))
    monkeypatch.setattr(triton_pdl, "pdl_enabled", lambda device: False)
    with captured_launches() as launches:
        step()
    for launch in launches:
        assert launch.kwargs.get("PDL") is False and "launch_pdl" not in launch.kwargs, launch.name
        assert "griddepcontrol" not in compile_launch(launch).asm["ptx"], launch.name


# ------------------------------------------------------------------------------------------------ 8-bit quantizers
# the activation widths of the models' W8A8 / FP8 layers: hidden sizes (RMSNorm -> qkv / gate_up, o_proj's
# standalone quantizer) of 8B / 70B-class / 405B-class Llama, and intermediate sizes (SiLU-mul -> down_proj)
HIDDEN = (4096, 8192, 16384)
INTERMEDIATE = (14336, 28672)
INT8_MODES = ("sym", "asym", "static")


def _int8_kwargs(mode):
    if mode == "static":
        return {"scale": torch.full((1,), 0.05), "azp": torch.full((1,), 3, dtype=torch.int32)}
    return {"symmetric": mode == "sym"}


def _fp8_nan_safe(name: str, ptx: str) -> None:
    """The fp8 codes' clamp to +-448 keeps NaN (``min.NaN`` / ``max.NaN``): no NaN-dropping ``min.f32`` /
    ``max.f32`` against +-448 (0f43E00000 / 0fC3E00000) before the e4m3 cast."""
    import re

    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx, name
    assert ".NaN" in ptx, f"{name}: no NaN-propagating clamp in the PTX"
    assert not re.search(r"\b(min|max)\.f32\s[^;]*0f(43E00000|C3E00000)", ptx), f"{name}: clamp drops NaN"


@pytest.mark.parametrize("mode", INT8_MODES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_int8_rms_norm_quant(hidden, mode, cpu_launches):
    from lqe.kernels import fused_quant as fq

    x = torch.randn(33, hidden, dtype=torch.bfloat16)
    assert _compile_all(lambda: fq.rms_norm_quant_int8_any(x, torch.ones(hidden, dtype=torch.bfloat16), 1e-5,
                                                           residual=x.clone(), use_triton=True, **_int8_kwargs(mode))
                        ) == ["_rms_norm_quant_kernel"]


@pytest.mark.parametrize("mode", INT8_MODES)
@pytest.mark.parametrize("inter", INTERMEDIATE)
def test_int8_silu_mul_quant(inter, mode, cpu_launches):
    from lqe.kernels import fused_quant as fq

    x = torch.randn(33, 2 * inter, dtype=torch.bfloat16)
    assert _compile_all(lambda: fq.silu_mul_quant_int8_any(x, use_triton=True, **_int8_kwargs(mode))
                        ) == ["_silu_mul_quant_kernel"]


@pytest.mark.parametrize("mode", INT8_MODES)
@pytest.mark.parametrize("k", HIDDEN + INTERMEDIATE)
def test_int8_act_quant(k, mode):
    from lqe.kernels import triton_act_quant as taq

    x = torch.randn(33, k, dtype=torch.bfloat16)
    assert _compile_all(lambda: taq.quant_int8(x, use_triton=True, **_int8_kwargs(mode))) == ["_int8_quant_kernel"]


FP8_MODES = [(0, False), (128, False), (0, True)]  # (group, static): per token, 1 x 128 groups, static per tensor
needs_fp8 = pytest.mark.skipif(F8 is None, reason="this torch has no float8_e4m3fn")


@needs_fp8
@pytest.mark.parametrize("group,static", FP8_MODES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_fp8_rms_norm_quant(hidden, group, static, cpu_launches):
    from lqe.kernels import fused_quant_fp8 as fq

    x = torch.randn(33, hidden, dtype=torch.bfloat16)
    assert _compile_all(lambda: fq.rms_norm_quant_fp8(x, torch.ones(hidden, dtype=torch.bfloat16), 1e-5,
                                                      residual=x.clone(), group=group, use_triton=True,
                                                      scale=torch.ones(1) if static else None), _fp8_nan_safe
                        ) == ["_rms_norm_quant_fp8_kernel"]


@needs_fp8
@pytest.mark.parametrize("group,static", FP8_MODES)
@pytest.mark.parametrize("inter", INTERMEDIATE)
def test_fp8_silu_mul_quant(inter, group, static, cpu_launches):
    from lqe.kernels import fused_quant_fp8 as fq

    x = torch.randn(33, 2 * inter, dtype=torch.bfloat16)
    assert _compile_all(lambda: fq.silu_mul_quant_fp8(x, group=group, use_triton=True,
                                                      scale=torch.ones(1) if static else None), _fp8_nan_safe
                        ) == ["_silu_mul_quant_fp8_kernel"]


@needs_fp8
@pytest.mark.parametrize("group,static", FP8_MODES)
@pytest.mark.parametrize("k", HIDDEN + INTERMEDIATE)
def test_fp8_act_quant(k, group, static):
    from lqe.kernels import triton_act_quant as taq

    x = torch.randn(33, k, dtype=torch.bfloat16)
    assert _compile_all(lambda: taq.quant_fp8(x, group, scale=torch.ones(1) if static else None, use_triton=True),
                        _fp8_nan_safe) == ["_fp8_quant_kernel"]


def test_fp8_nan_check_catches_a_nan_dropping_clamp():
    """The PTX check above fails on the clamp the fp8 quantizers had (tl.minimum / tl.maximum)."""
    lines = ["cvt.rn.satfinite.e4m3x2.f32  %rs1, %r4, %r3;"]
    with pytest.raises(AssertionError, match="clamp drops NaN"):
        _fp8_nan_safe("old", "\n".join(lines + ["max.f32 \t%r10, %r8, 0fC3E00000;", "min.NaN.f32 %r1, %r2, %r3;"]))
    _fp8_nan_safe("new", "\n".join(lines + ["min.NaN.xorsign.abs.f32 \t%r3, %r8, %r10;"]))


@pytest.mark.parametrize("chain", ["int8", "fp8", "w4a16"])
def test_pdl_quantized_layers_wait_before_any_global_access(chain, monkeypatch, cpu_launches):
    """The quantized layers' kernels of a decode step under LQE_PDL=1 (lqe.kernels.triton_pdl): the int8 / fp8
    producers (RMSNorm and SiLU-mul with the quantization fused, the standalone quantizer), the W8A8 / FP8 GEMV and
    the FP8 GEMM (split-K workspaces and arrival counters shared across launches), and triton-wna16 with its split-K
    reduction: each launches with launch_pdl and waits ahead of every global load and store in its sm_90 PTX."""
    from lqe.kernels import fused_quant as fq, fused_quant_fp8 as fq8, repack, triton_act_quant as taq
    from lqe.kernels import triton_fp8 as tf, triton_gemv_w8a8 as tg, triton_pdl, triton_wna16 as tw
    from lqe.kernels.canonical import CanonicalWeight
    from hopper_compile import captured_launches, compile_launch

    if chain == "fp8" and F8 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    k, n = SHAPE
    x, w = torch.randn(4, k, dtype=torch.bfloat16), torch.ones(k, dtype=torch.bfloat16)
    act = torch.randn(4, 2 * k, dtype=torch.bfloat16)

    def step():
        if chain == "int8":
            fq.rms_norm_quant_int8_any(x, w, 1e-5, residual=x.clone(), use_triton=True)
            fq.silu_mul_quant_int8_any(act, use_triton=True)
            taq.quant_int8(x, use_triton=True)
            xq, sa, wq, sw = _int8(4, k, n)
            tg.gemv_w8a8(xq, sa, wq, sw)
        elif chain == "fp8":
            fq8.rms_norm_quant_fp8(x, w, 1e-5, residual=x.clone(), use_triton=True)
            fq8.silu_mul_quant_fp8(act, use_triton=True)
            taq.quant_fp8(x, use_triton=True)
            xq, wq = torch.randn(4, k).div(4).to(F8), torch.randn(n, k).div(4).to(F8)
            tg.gemv_w8a8(xq, torch.rand(4, 1) + 0.1, wq, torch.rand(n) + 0.1)
            tf.fp8_mm(xq, torch.rand(4, 1) + 0.1, wq, torch.rand(n) + 0.1)
        else:
            g = torch.Generator().manual_seed(0)
            cw = CanonicalWeight(torch.randint(0, 16, (k, n), dtype=torch.uint8, generator=g),
                                 torch.rand(k // 128, n, generator=g) * 0.01 + 0.001, None, None, 4, 128)
            p = repack.repack_wna16(cw, torch.bfloat16)
            cfg = tw.WNA16Config(16, 64, 128, split_k=4)
            tw.gemm(torch.randn(8, k, dtype=torch.bfloat16), p, bias=torch.rand(n, dtype=torch.bfloat16), config=cfg)

    want = {"int8": ["_rms_norm_quant_kernel", "_silu_mul_quant_kernel", "_int8_quant_kernel", "_gemv_kernel"],
            "fp8": ["_rms_norm_quant_fp8_kernel", "_silu_mul_quant_fp8_kernel", "_fp8_quant_kernel", "_gemv_kernel",
                    "_fp8_mm_kernel"],
            "w4a16": ["_wna16_gemm_kernel", "_splitk_reduce_kernel"]}[chain]
    monkeypatch.setattr(triton_pdl, "pdl_enabled", lambda device: True)
    with captured_launches() as launches:
        step()
    assert [launch.name for launch in launches] == want
    for launch in launches:
        assert launch.kwargs.get("PDL") is True and launch.kwargs.get("launch_pdl") is True, launch.name
        kernel = compile_launch(launch)
        _pdl_order(launch.name, kernel)
        if launch.name == "_gemv_kernel":  # its first weight lines go to L2 while the kernel before it runs
            ptx = kernel.asm["ptx"]
            assert 0 <= ptx.find("prefetch.global.L2") < ptx.find("griddepcontrol.wait"), "no L2 prefetch first"
