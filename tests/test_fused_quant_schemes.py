"""RMSNorm / SiLU-mul fused with the asymmetric per-token and the static per-tensor int8 quantization
(lqe/kernels/fused_quant.py ``*_any``) on CPU under Triton's interpreter, bit for bit against the unfused path (the
checks of tests/gpu/test_fused_act_quant_schemes.py: awkward shapes, a strided input, ties, constant and far-from-zero
rows, saturating static scales, the multi-chunk SiLU path and an exhaustive sweep over every fp16 / bf16 value), and
the argument checks."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from triton_compat import run_interpreted


SCRIPT = """
    triton_compat.patch_bf16_rounding()  # round fp32 -> bf16 to nearest even, as the GPU does
    import torch
    import test_fused_act_quant_schemes as F

    for dt in (torch.float16, torch.bfloat16):
        F.check_rms_norm_schemes(7, 200, dt, "cpu", residual=True)
        F.check_rms_norm_schemes(6, 96, dt, "cpu", residual=False)
        F.check_silu_mul_schemes(7, 200, dt, "cpu")
        F.check_silu_mul_schemes(8, 200, dt, "cpu", chunk=64)  # the two-pass path, ragged last chunk
        F.check_schemes_exhaustive(dt, "cpu")
    F.check_bad_arguments("cpu")
    print("FUSED-SCHEMES-INTERPRET-OK")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)")
def test_fused_asym_static_quant_under_interpreter():
    run_interpreted(SCRIPT, "FUSED-SCHEMES-INTERPRET-OK", timeout=600)


def test_twins_are_the_reference_quantizers():
    """On CPU (no interpreter) the ``*_any`` ops are the torch twins: the float op, then the reference quantizer."""
    from lqe.kernels import fused_ops as fo
    from lqe.kernels import fused_quant as fq
    from lqe.kernels.act_quant_ref import per_token_quant_int8, static_quant_int8

    g = torch.Generator().manual_seed(0)
    x, r, w = (torch.randn(5, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    a = torch.randn(5, 96, generator=g).to(torch.bfloat16)
    y, nr = fo.rms_norm_torch(x, w, 1e-6, r)
    q, s, z, r2 = fq.rms_norm_quant_int8_any(x, w, 1e-6, r, symmetric=False)
    rq, rs, rz = per_token_quant_int8(y, False)
    assert torch.equal(q, rq) and torch.equal(s, rs) and torch.equal(z, rz) and torch.equal(r2, nr)
    scale, azp = torch.tensor([0.02]), torch.tensor([4], dtype=torch.int32)
    q, s, z = fq.silu_mul_quant_int8_any(a, scale=scale, azp=azp)
    assert torch.equal(q, static_quant_int8(fo.silu_and_mul_torch(a), scale, azp)) and s is scale and z is azp
    q0, s0, z0 = fq.silu_mul_quant_int8_any(a.reshape(5, 1, 96)[:0], symmetric=False)
    assert q0.shape == (0, 1, 48) and s0.shape == (0, 1, 1) and z0.shape == (0, 1, 1)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="ahead-of-time compilation needs triton's real JIT")
@pytest.mark.parametrize("kernel", ["norm", "silu", "silu-chunked"])
@pytest.mark.parametrize("mode,has_azp", [(0, False), (1, False), (2, False), (2, True)])
def test_producers_compile_for_hopper(kernel, mode, has_azp):
    """Every scheme's kernel compiles to sm_90 PTX without a GPU (the interpreter accepts code the JIT refuses), with
    no register spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lqe.kernels import fused_quant as fq

    if kernel == "norm":
        fn = fq._rms_norm_quant_kernel
        consts = dict(HAS_RESIDUAL=True, MODE=mode, HAS_AZP=has_azp, BLOCK=4096, PDL=False)
        types = dict(X="*bf16", R="*bf16", W="*bf16", ROut="*bf16", eps="fp32")
    else:
        fn = fq._silu_mul_quant_kernel
        consts = dict(MODE=mode, HAS_AZP=has_azp, CHUNK=4096, NUM_CHUNKS=4 if kernel == "silu-chunked" else 1,
                      PDL=False)
        types = dict(X="*bf16")
    types.update(Q="*i8", S="*fp32", Z="*i32", SS="*fp32", ZP="*i32")
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 8})
    ptx = k.asm["ptx"]
    assert ".local" not in ptx, "register spills to local memory"
    assert "div.rn.f32" in ptx, "the scale / quotients must be correctly rounded divisions (tl.div_rn)"
