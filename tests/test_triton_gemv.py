"""The M <= 16 W8A8 GEMV kernels (lqe/kernels/triton_gemv_w8a8.py, int8 and fp8) on CPU under Triton's interpreter:
the checks of tests/gpu/test_gemv_w8a8.py on small awkward shapes (N, K not powers of two, ragged K blocks, split-K
with a ragged last split, padded tokens), both the CUDA-core and the tensor-core (tl.dot) variants."""
from __future__ import annotations

import importlib.util
import os

import pytest

from triton_compat import run_interpreted


SCRIPT = """
    import torch
    import functools
    import test_gemv_w8a8 as G
    from lqe.kernels.triton_gemv_w8a8 import GemvConfig as C
    G.check_gemv = functools.partial(G.check_gemv, device="cpu")

    f16, bf16 = torch.float16, torch.bfloat16
    for kind in ("int8", "fp8"):
        # CUDA-core path: M=1 (2-d reduce), M=3 (one reduce per token, one padded token); split-K, ragged last split
        G.check_gemv(1, 72, 200, C(16, 32, False, split_k=3), kind, dt=f16)
        G.check_gemv(3, 40, 200, C(16, 64, False, split_k=2), kind, bias=False, dt=bf16)
        G.check_gemv(1, 40, 96, C(32, 32, False, split_k=1), kind, static=True, dt=f16)
        # tensor-core path: tokens padded to 16, split-K, K % BLOCK_K != 0, N % BLOCK_N != 0
        G.check_gemv(7, 72, 200, C(32, 64, True, split_k=2), kind, dt=f16)
        G.check_gemv(16, 40, 160, C(32, 32, True, split_k=1), kind, static=True, dt=bf16)
        # split_k resolved from the (CPU stand-in) SM count
        G.check_gemv(2, 72, 256, C(16, 32, False, split_k=0), kind, dt=f16)
    # int8 at M = 1 runs dp4a on int32 words (K % 4 == 0; the two M = 1 int8 cases above took it, one with a ragged
    # last K block); K % 4 != 0 or dp4a=False take the fp32-FMA path; K_STAGES = 1 (no K pipeline)
    G.check_gemv(1, 40, 198, C(16, 32, False, split_k=2), "int8", dt=f16)
    G.check_gemv(1, 72, 200, C(16, 32, False, split_k=3, dp4a=False), "int8", dt=bf16)
    G.check_gemv(1, 72, 200, C(16, 32, False, split_k=3, num_stages=1), "int8", sym=False, dt=f16)
    # asymmetric int8 (zero point x colsum in the epilogue), per token and static
    G.check_gemv(5, 72, 200, C(32, 64, True, split_k=3), "int8", sym=False, dt=f16)
    G.check_gemv(2, 40, 96, C(16, 32, False, split_k=2), "int8", sym=False, static=True, dt=f16)
    # the swapped tensor-core GEMM (out^T = W x^T): ragged N and K, split-K, padded tokens, both kinds
    for kind in ("int8", "fp8"):
        G.check_gemv(5, 72, 200, C(64, 64, True, split_k=2, swap_ab=True), kind, dt=bf16)
        G.check_gemv(16, 136, 256, C(64, 128, True, split_k=1, swap_ab=True, precise_acc=False), kind, dt=f16)
    G.check_gemv(3, 72, 200, C(64, 64, True, split_k=3, swap_ab=True), "int8", sym=False, dt=f16)
    G.check_rejects_bad_input("cpu")
    print("GEMV-INTERPRET-OK")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_gemv_kernels_under_interpreter():
    run_interpreted(SCRIPT, "GEMV-INTERPRET-OK")


def test_config_table_and_split_k_are_host_functions():
    from lqe.kernels import triton_gemv_w8a8 as tg

    for m in range(1, 17):
        cfg = tg.pick_config(m, 4096, 4096)
        assert cfg.split_k >= 1 and tg.block_m(m, cfg.use_dot) >= m
        assert cfg.split_k * tg.block_m(m, cfg.use_dot) <= tg.WS_ROWS
    # a narrow N gets K splits, a wide one (enough N tiles) none
    few = tg.auto_split_k(1, 4096, 4096, tg.GemvConfig(32, 256), sms=132)
    many = tg.auto_split_k(1, 28672, 4096, tg.GemvConfig(32, 256), sms=132)
    assert few > many >= 1 and many <= 2
    for m in (1, 4, 16):
        cfgs = tg.sweep_configs(m)
        assert cfgs and len(set(cfgs)) == len(cfgs)
        assert all(c.use_dot for c in cfgs) or m <= 4


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="ahead-of-time compilation needs triton's real JIT")
@pytest.mark.parametrize("variant", ["i8-fma-m1", "i8-fma-m4-azp", "i8-dot", "fp8-fma-m1", "fp8-dot", "i8-dp4a-m1",
                                     "i8-dot-swap", "fp8-dot-swap"])
def test_gemv_compiles_for_hopper_with_vector_loads(variant):
    """Compile to sm_90 PTX without a GPU (Triton ships ptxas), with the 16-byte alignment the JIT infers for
    torch's allocations: the weight stream must use 16-byte vector loads, the dot variant tensor-core mma, and
    nothing may spill to local memory."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lqe.kernels import triton_gemv_w8a8 as tg

    dt, path, *rest = variant.split("-")
    fp8 = dt == "fp8"
    consts = dict(HAS_AZP="azp" in rest, HAS_BIAS=True, IS_FP8=fp8, BLOCK_M=16 if path == "dot" else
                  (4 if "m4" in rest else 1), BLOCK_N=64 if path == "dot" else 32,
                  BLOCK_K=128 if "swap" in rest else 256, SPLIT_K=4, USE_DOT=path == "dot", EVEN_K=True,
                  DP4A=path == "dp4a", DP4A_ASM=True, K_STAGES=3, SWAP_AB="swap" in rest,
                  PROMOTE=128 if "swap" in rest else None, PDL=False, PF_LINES=2)
    fn = tg._gemv_kernel
    elem = "fp8e4nv" if fp8 else "i8"
    types = {"x_ptr": f"*{elem}", "w_ptr": f"*{elem}", "out_ptr": "*bf16", "a_scale_ptr": "*fp32",
             "w_scale_ptr": "*fp32", "azp_ptr": "*i32", "colsum_ptr": "*i32", "bias_ptr": "*bf16", "ws_ptr": "*i32",
             "cnt_ptr": "*i32"}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    aligned = [n for n in fn.arg_names if n.endswith("_ptr") or n in ("N", "K", "stride_xm", "stride_wn", "stride_om")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 3})
    ptx = k.asm["ptx"]
    vector = r"(ld\.global(\.\w+)*\.v4|cp\.async\.cg\.shared\.global(\.\w+)* \[[^]]+\], \[[^]]+\], (16|0x10))"
    assert re.search(vector, ptx), \
        "the weight stream should be 16-byte vector loads"
    assert ".local" not in ptx, "register spills to local memory"
    if path == "dot" and "swap" in rest:  # Hopper's wgmma on the 8-bit operands themselves: no fp16 upcast
        assert "wgmma.mma_async" in ptx and ("e4m3.e4m3" in ptx if fp8 else ".s8.s8" in ptx)
        assert "cvt.rn.f16x2.e4m3x2" not in ptx
    elif path == "dot":
        assert "mma.sync" in ptx
    if path == "dp4a":  # four int8 products per instruction, the K loop pipelined through cp.async
        assert "dp4a.s32.s32" in ptx and "cp.async" in ptx
        sass_ops = k.asm.get("sass") or ""
        assert not sass_ops or "IDP.4A" in sass_ops
    assert "ld.global.b8" not in ptx and "ld.global.u8" not in ptx, "byte loads on the weight stream"
    # the CUDA-core path reduces each token's [BLOCK_N, BLOCK_K] tile in the weight's own layout: a 3-d
    # [BLOCK_M, BLOCK_N, BLOCK_K] broadcast-reduce compiled to 648 shuffles at BLOCK_M = 4 (0.24x bf16 on the H200)
    assert ptx.count("shfl.sync") <= 32 * consts["BLOCK_M"] + 32, f"{ptx.count('shfl.sync')} warp shuffles"
