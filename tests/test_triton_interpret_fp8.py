"""The Triton paged-attention kernels over an fp8 KV cache, run on CPU by Triton's interpreter
(``TRITON_INTERPRET=1``, in a fresh process as in ``tests/test_triton_interpret.py``); small cases only: the
GPU tests in ``tests/gpu/test_triton_attention_fp8.py`` cover the kernels' main configurations."""
from __future__ import annotations

import importlib.util
import os

import pytest

from triton_compat import run_interpreted


pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton)")

SCRIPT = """
    # the interpreter's fp32 -> fp8 downcast drops the carry of a mantissa that rounds up (31.5 -> 16, not 32)
    # and rounds ties away from zero; the GPU's cvt.rn.satfinite rounds to nearest even like torch: use torch
    triton_compat.patch_fp8_rounding(e5m2=True)
    import torch
    import test_triton_attention_fp8 as A

    E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
    # prefill over a cached prefix + padding rows, GQA 4:2, e4m3 with a saturating outlier, fp32 queries
    A.check_attention_fp8([(5, 0), (19, 40), (2, 3)], 4, 2, 32, torch.float32, "cpu", E4M3, pad_tokens=2)
    # prefill over a cached prefix with fp16 queries (a 16-bit model's fp16 dots: q pre-scaled, K / V widened
    # to fp16), e4m3 and e5m2
    A.check_attention_fp8([(5, 0), (19, 40)], 4, 2, 32, torch.float16, "cpu", E4M3)
    A.check_attention_fp8([(7, 9)], 4, 4, 32, torch.float16, "cpu", E5M2)
    # decode with split-K (and an empty sequence), e5m2, fp16 queries
    A.check_attention_fp8([(1, 150), (1, 0), (1, 37)], 4, 2, 32, torch.float16, "cpu", E5M2, num_splits=3)
    # mixed decode + prefill rows, bf16 queries, odd block size
    A.check_attention_fp8([(1, 70), (9, 20), (1, 1)], 4, 1, 32, torch.bfloat16, "cpu", E4M3, block_size=8)

    # the backend seam passes the layer's scales: triton backend == torch backend on an fp8 cache
    from lqe.kernels.attention_backends import TorchAttentionBackend, select_backend
    from lqe.kernels import attention_ref as ref
    backend = select_backend(torch.device("cpu"))
    assert backend.name == "triton", backend.name
    q, k, v, cache, meta = A.make_case([(1, 50), (7, 12)], 4, 2, 32, torch.float32, "cpu")
    ks, vs = torch.tensor([0.02]), torch.tensor([0.05])
    c1 = ref.quantize_kv(cache, ks, E4M3)
    c2 = c1.clone()
    got = backend.forward(q, k, v, c1, meta, 0.2, ks, vs)
    want = TorchAttentionBackend().forward(q, k, v, c2, meta, 0.2, ks, vs)
    assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    # key rotation (the layer hands the kernels bf16 rotated queries and float32 rotated keys): triton == torch,
    # the same stored bytes
    from lqe.layers.attention import Attention, key_rotation
    q, k, v, cache, meta = A.make_case([(1, 50), (7, 12), (1, 3)], 4, 2, 32, torch.bfloat16, "cpu")
    outs = []
    for be in (backend, TorchAttentionBackend()):
        layer = Attention(4, 32, 2, 0.2, 0)
        layer.backend = be
        layer.set_key_rotation(key_rotation(32, torch.bfloat16, "cpu"))
        layer.k_scale.fill_(0.02), layer.v_scale.fill_(0.05)
        c = ref.quantize_kv(cache.float(), ks, E4M3)
        t = q.shape[0]
        outs.append((layer.attend(q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), meta, c), c))
    assert torch.equal(outs[0][1].view(torch.uint8), outs[1][1].view(torch.uint8))
    torch.testing.assert_close(outs[0][0].float(), outs[1][0].float(), atol=2e-2, rtol=2e-2)
    print("TRITON-INTERPRET-FP8-OK")
"""


def test_triton_fp8_kv_kernels_under_interpreter():
    run_interpreted(SCRIPT, "TRITON-INTERPRET-FP8-OK", LQE_ATTENTION_BACKEND="triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="ahead-of-time compilation needs the real JIT")
@pytest.mark.parametrize("kv_type", ["fp8e4nv", "fp8e5"])
def test_fp8_attention_kernels_compile_for_hopper_without_a_gpu(kv_type):
    """The fp8-cache variants (store, prefill, split-K decode) compile to sm_90 without spills, on tensor cores."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lqe.kernels import triton_attention as ta

    def compile_kernel(fn, types, consts):
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        return triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 2})

    types = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KV": f"*{kv_type}", "Out": "*bf16", "BlockTables": "*i32",
             "QueryStart": "*i32", "SeqLens": "*i32", "Tiles": "*i32", "Slots": "*i64", "scale_log2": "fp32",
             "PartOut": "*fp32", "PartLse": "*fp32", "KScale": "*fp32", "VScale": "*fp32", "KVW": "*i32"}
    common = dict(GROUP=4, HEAD_DIM=128, PAGE=16, BLOCK_D=128, DOT_F32=False, PRECISION=None, QUANT=True)
    attn = [
        compile_kernel(ta._prefill_kernel, types, dict(common, BLOCK_M=64, BLOCK_N=64, PACK=4, DENSE=False)),
        compile_kernel(ta._decode_kernel, types, dict(common, NUM_SPLITS=4, BLOCK_H=16, BLOCK_N=64, V_ASM=1, PDL=False)),
    ]
    # decode widens V in registers by inline PTX (e4m3x2 / e5m2x2 pairs), so V reaches shared memory as 16-bit data:
    # no single-byte shared loads (an fp8 V widened by .to() was read byte by byte into the dot operand: 64 per tile)
    dec = attn[1].asm["ptx"]
    assert f"cvt.rn.f16x2.{'e4m3x2' if kv_type == 'fp8e4nv' else 'e5m2x2'}" in dec
    assert "ld.shared.b8" not in dec and "ld.shared.u8" not in dec, "V read from shared memory byte by byte"
    fmax = 448.0 if kv_type == "fp8e4nv" else 57344.0
    store = compile_kernel(ta._store_kv_kernel, types, dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128,
                                                            QUANT=True, FP8_MAX=fmax, PDL=False))
    for k in attn:
        ptx = k.asm["ptx"]
        assert "mma" in ptx, "the attention kernels should use tensor cores"
        assert ".local" not in ptx, "register spills to local memory"
    assert "cvt" in store.asm["ptx"] and ".local" not in store.asm["ptx"]
