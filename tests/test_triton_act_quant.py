"""The standalone Triton activation quantizer (lqe/kernels/triton_act_quant.py) on CPU under Triton's interpreter, bit
for bit against the torch references (the checks of tests/gpu/test_act_quant_standalone.py on odd shapes), and its
host-side fallbacks."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from triton_compat import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None

SCRIPT = """
    # the interpreter's fp32 -> fp8 / bf16 casts truncate; the GPU rounds to nearest even like torch
    triton_compat.patch_fp8_rounding()
    triton_compat.patch_bf16_rounding()
    import torch
    import test_act_quant_standalone as A

    for dt in (torch.float16, torch.bfloat16, torch.float32):
        for m, k in ((1, 96), (7, 200), (9, 384)):
            A.check_int8(m, k, dt, "cpu")
            A.check_fp8(m, k, dt, "cpu")
        A.check_int8(7, 200, dt, "cpu", chunk=64)  # several chunks, ragged last one
        A.check_fp8(7, 320, dt, "cpu", chunk=64)
    A.check_exhaustive(torch.bfloat16, "cpu")
    A.check_layer_wrappers("cpu")
    A.check_leading_dims_empty_and_bad_input("cpu")
    print("ACT-QUANT-INTERPRET-OK")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_act_quant_under_interpreter():
    run_interpreted(SCRIPT, "ACT-QUANT-INTERPRET-OK", timeout=600)


def test_cpu_without_interpreter_runs_the_references():
    """Off the interpreter a CPU tensor takes the torch references (the same results, nothing launched)."""
    from lqe.kernels import triton_act_quant as taq
    from lqe.kernels import w8a8 as kw
    from lqe.kernels.act_quant_ref import per_token_quant_int8
    from lqe.kernels.fused_quant_fp8 import quant_fp8_ref

    x = torch.randn(5, 256).to(torch.bfloat16)
    x[1] = 0
    assert not taq.use_triton_for(x) or taq._triton_ok(x, None)
    q, s, z = taq.quant_int8(x, False, use_triton=False)
    rq, rs, rz = per_token_quant_int8(x, False)
    assert torch.equal(q, rq) and torch.equal(s, rs) and torch.equal(z, rz)
    q, s = taq.quant_fp8(x, 128, use_triton=False)
    rq, rs = quant_fp8_ref(x, 128)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    q, s = kw.fp8_quantize_per_token(x, use_triton=False)
    rq, rs = quant_fp8_ref(x)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


def test_fp8_needs_sm89(monkeypatch):
    from lqe.kernels import triton_act_quant as taq

    if not taq.HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "8.9" in taq.unavailable_reason("cuda", fp8=True)
    assert taq.unavailable_reason("cuda") is None


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="ahead-of-time compilation needs triton's real JIT")
@pytest.mark.parametrize("variant", ["i8-sym-1", "i8-asym-4", "i8-static-azp-4", "fp8-token-1", "fp8-token-4",
                                     "fp8-group-2", "fp8-static-1"])
def test_quantizers_compile_for_hopper(variant):
    """Compile to sm_90 PTX without a GPU (Triton ships ptxas), as the o_proj shapes launch them (K = 4096 in one
    chunk, 14336 in four): no spill to local memory, the fp8 codes by the hardware conversion."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lqe.kernels import triton_act_quant as taq

    kind, mode, *rest = variant.split("-")
    chunks = int(rest[-1])
    if kind == "i8":
        fn = taq._int8_quant_kernel
        consts = dict(MODE={"sym": 0, "asym": 1, "static": 2}[mode], HAS_AZP="azp" in rest, CHUNK=4096,
                      NUM_CHUNKS=chunks, PDL=False)
        types = {"X": "*bf16", "Q": "*i8", "S": "*fp32", "Z": "*i32", "SS": "*fp32", "ZP": "*i32"}
    else:
        fn = taq._fp8_quant_kernel
        consts = dict(GROUP=128 if mode == "group" else 0, CHUNK=4096, NUM_CHUNKS=chunks, STATIC=mode == "static",
                      PDL=False)
        types = {"X": "*bf16", "Q": "*fp8e4nv", "S": "*fp32", "SS": "*fp32"}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 8})
    ptx = k.asm["ptx"]
    assert ".local" not in ptx, "register spills to local memory"
    if kind == "fp8":
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "div.rn.f32" in ptx, "the scale / quotients must be correctly rounded divisions (tl.div_rn)"
