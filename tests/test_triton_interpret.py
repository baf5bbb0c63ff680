"""A small subset of the GPU Triton tests, run on CPU by Triton's interpreter (``TRITON_INTERPRET=1``).

The interpreter must be switched on before triton is first imported, so the checks run in a fresh Python
process; they reuse the helpers of ``tests/gpu/test_triton_*.py``. Known interpreter limits (not kernel bugs):
bf16 ``tl.dot`` is wrong (the kernels upcast to fp32 there) and fp32 -> bf16 casts truncate (looser checks).
"""
from __future__ import annotations

import importlib.util
import os

import pytest

from triton_compat import run_interpreted


pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton)")

SCRIPT = """
    import torch
    import test_triton_attention as A
    import test_triton_fused_ops as F

    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    # prefill with a cached prefix, ragged, GQA 4:2, block size 16, padding tokens, K/V as views of qkv
    A.check_attention([(5, 0), (19, 40), (2, 3)], 4, 2, 32, f32, "cpu", pad_tokens=2, strided_kv=True)
    # decode over long contexts with split-K (and an empty sequence), GQA 6:2, head dim 64
    A.check_attention([(1, 300), (1, 0), (1, 77)], 6, 2, 64, f16, "cpu", num_splits=4)
    # mixed batch: decode rows and prefill rows in one step, automatic split choice, bf16, odd block size
    A.check_attention([(1, 130), (33, 20), (1, 1), (4, 0)], 8, 2, 64, bf16, "cpu", block_size=8)
    # MQA, head dim 128 (the kernels' main configuration), one token per block
    A.check_attention([(1, 40), (9, 9)], 4, 1, 128, f16, "cpu", block_size=1, num_splits=2)
    # a float32 model at head dim 128: its own smaller key tiles (16 keys in prefill and decode: no spills)
    A.check_attention([(1, 70), (21, 30), (1, 5)], 4, 2, 128, f32, "cpu", num_splits=2)

    for dt in (f32, f16, bf16):
        F.check_rms_norm(5, 576, dt, "cpu", residual=True)
        F.check_rms_norm(3, 64, dt, "cpu", residual=False)
        F.check_silu_and_mul(3, 200, dt, "cpu")
        F.check_rotary(4, (6, 2), 64, None, dt, "cpu")
    F.check_rotary(3, (4, 2), 128, 64, f16, "cpu")  # partial rotary
    F.check_torch_fallbacks()

    # the backend seam: LQE_ATTENTION_BACKEND=triton selects the triton backend, which stores K/V first
    from lqe.kernels.attention_backends import select_backend
    backend = select_backend(torch.device("cpu"))
    assert backend.name == "triton", backend.name
    from lqe.kernels import attention_ref as ref
    q, k, v, cache, meta = A.make_case([(1, 50), (7, 12)], 4, 2, 32, f32, "cpu")
    cache_ref = cache.clone()
    got = backend.forward(q, k, v, cache, meta, 0.2)
    ref.store_kv(k, v, cache_ref, meta.slot_mapping)
    torch.testing.assert_close(cache, cache_ref)
    torch.testing.assert_close(got, ref.paged_attention_ref(q, cache_ref, meta, 0.2), atol=1e-4, rtol=1e-4)
    # with out= (the piecewise replay's static buffer) the result lands there, the same values
    buf = torch.full_like(q, float("nan"))
    assert backend.forward(q, k, v, cache, meta, 0.2, out=buf) is buf
    torch.testing.assert_close(buf, got, atol=0, rtol=0)
    print("TRITON-INTERPRET-OK")
"""


def test_triton_kernels_under_interpreter():
    run_interpreted(SCRIPT, "TRITON-INTERPRET-OK", LQE_ATTENTION_BACKEND="triton")


def test_backends_module_imports_without_gpu():
    """Importing the backends never raises; without CUDA (and unforced) no GPU backend is registered."""
    import torch

    import lqe.kernels.attention_backends as m

    forced = os.environ.get("LQE_ATTENTION_BACKEND") == "triton"
    assert ("triton" in m._BACKENDS) == (m._ta is not None and (torch.cuda.is_available() or forced))
    if not torch.cuda.is_available():
        assert "flash_attn" not in m._BACKENDS


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="ahead-of-time compilation needs the real JIT")
def test_attention_kernels_compile_for_hopper_without_a_gpu():
    """Compile the attention kernels to sm_90 cubins (Triton ships ptxas): catches what only the GPU compiler
    rejects (dot shapes, early returns, precision arguments) on machines without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lqe.kernels import triton_attention as ta

    def compile_kernel(fn, types, consts):
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        return triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 2})

    types = {"Q": "*bf16", "KV": "*bf16", "Out": "*bf16", "BlockTables": "*i32", "QueryStart": "*i32",
             "SeqLens": "*i32", "Tiles": "*i32", "scale_log2": "fp32", "PartOut": "*fp32", "PartLse": "*fp32",
             "KScale": "*fp32", "VScale": "*fp32", "KVW": "*bf16"}
    common = dict(GROUP=4, HEAD_DIM=128, PAGE=16, BLOCK_D=128, DOT_F32=False, PRECISION=None, QUANT=False)
    kernels = [
        compile_kernel(ta._prefill_kernel, types, dict(common, BLOCK_M=64, BLOCK_N=64, PACK=4, DENSE=False)),
        compile_kernel(ta._decode_kernel, types, dict(common, NUM_SPLITS=4, BLOCK_H=16, BLOCK_N=64, V_ASM=0, PDL=False)),
    ]
    for k in kernels:
        ptx = k.asm["ptx"]
        assert "mma" in ptx, "the attention kernels should use tensor cores"
        assert ".local" not in ptx, "register spills to local memory"
