"""The Triton W4A16/W8A16 kernels (lqe/kernels/triton_wna16.py) on CPU: Triton's interpreter on tiny awkward
shapes against the pure-torch references, plus the host-side config/dispatch logic and an sm_90 compile check.

The interpreter must be on before triton is first imported, so kernel checks run in a fresh process.
Interpreter limits: its bf16 arithmetic/dot are wrong (the kernel computes in fp32 there: ``DOT_F32``) and
fp32 -> bf16 casts truncate, so bf16 results are compared loosely and fp16 dequantization bit-exactly.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None

SCRIPT = textwrap.dedent("""
    import sys
    sys.path[:0] = [{root!r}, {tests!r}]
    import triton_compat
    triton_compat.patch()
    import torch
    from lqe.kernels import gemm, gemm_ref, repack, triton_wna16 as tw
    from lqe.kernels.canonical import CanonicalWeight

    def canonical(k, n, bits, gs, asym, act_order, seed):
        g = torch.Generator().manual_seed(seed)
        gsz = k if gs == -1 else gs
        ng = -(-k // gsz)
        codes = torch.randint(0, 2**bits, (k, n), dtype=torch.uint8, generator=g)
        scales = torch.rand(ng, n, generator=g) * (0.04 if bits == 4 else 0.003) + 0.002
        zeros = torch.randint(0, 2**bits, (ng, n), dtype=torch.uint8, generator=g) if asym else None
        g_idx = None
        if act_order:
            g_idx = (torch.arange(k) // gsz)[torch.randperm(k, generator=g)].to(torch.int32)
        return CanonicalWeight(codes, scales, zeros, g_idx, bits, gs)

    C = tw.WNA16Config
    cases = [
        # (m, k, n, bits, gs, asym, act_order, dtype, config, bias)
        (1, 192, 128, 4, 128, False, False, torch.float16, C(16, 64, 128, 4, 2), True),   # short last group, K % BK
        (7, 320, 192, 4, 64, True, True, torch.bfloat16, C(16, 128, 64, 4, 2), False),   # N % BN, act-order, asym
        (33, 256, 128, 4, 32, True, False, torch.float16, C(32, 64, 64, 4, 2, split_k=0), True),  # BK fit to 32
        (7, 576, 64, 4, 128, False, True, torch.float16, C(16, 64, 128, 4, 2, split_k=2), True),  # K=576, split
        (1, 256, 128, 8, -1, True, False, torch.bfloat16, C(16, 64, 64, 4, 2, split_k=4), True),  # 8-bit, channel
        (33, 192, 64, 8, 64, False, True, torch.float16, C(64, 64, 64, 4, 2), False),  # 8-bit sym act-order
        (7, 192, 128, 4, 64, True, False, torch.float16, C(16, 64, 64, 4, 2, factored=False), True),  # dequant form
        (33, 256, 64, 8, 128, True, True, torch.bfloat16, C(64, 64, 64, 4, 2, factored=False), True),
        # swapped operands (out^T = W^T x^T): factored and dequant forms, split-K, ragged M / N / K, both dtypes
        (7, 320, 192, 4, 64, True, True, torch.bfloat16, C(16, 128, 64, 4, 2, swap_ab=True), True),
        (1, 576, 64, 4, 128, False, False, torch.float16, C(16, 64, 128, 4, 2, split_k=2, swap_ab=True), True),
        # symmetric 4-bit swapped: the magic-number dequantization (its interpreter form), bf16
        (5, 256, 128, 4, 64, False, False, torch.bfloat16, C(16, 128, 64, 4, 2, swap_ab=True), True),
        (33, 192, 128, 8, 64, False, True, torch.float16, C(64, 64, 64, 4, 2, factored=False, swap_ab=True), False),
        (40, 256, 128, 8, -1, True, False, torch.bfloat16, C(32, 64, 64, 4, 2, split_k=4, swap_ab=True), True),
    ]
    for i, (m, k, n, bits, gs, asym, act, dt, cfg, with_bias) in enumerate(cases):
        cw = canonical(k, n, bits, gs, asym, act, seed=i)
        p = repack.repack_wna16(cw, dt)
        x = torch.randn(m, k).to(dt)
        bias = torch.randn(n).to(dt) if with_bias else None
        out = torch.full((m, n), float("nan"), dtype=dt)
        y = gemm.wna16_gemm(x, p, bias, out=out, path="triton-wna16", config=cfg)
        assert y.data_ptr() == out.data_ptr() and not torch.isnan(y).any(), i
        # ground truth from the canonical weight (no layout code involved)
        ref = x.float() @ cw.dequantize(torch.float32).to(dt).float() + (0 if bias is None else bias.float())
        tol = (2e-2 if dt == torch.bfloat16 else 4e-3) * ref.abs().max().item() + 1e-3
        err = (y.float() - ref).abs().max().item()
        assert err <= tol, f"case {{i}}: max error {{err}} > {{tol}}"
        # and the kernel-side emulation agrees too
        emu = gemm_ref.wna16_gemm_ref(x, p, bias).float()
        assert (y.float() - emu).abs().max().item() <= tol, i
        # split-K is deterministic: a second call gives the same bits
        assert torch.equal(y, gemm.wna16_gemm(x, p, bias, path="triton-wna16", config=cfg)), i

    # leading dims and the default config tables (the swapped kernel's too)
    cw = canonical(256, 192, 4, 128, False, False, seed=11)
    p = repack.repack_wna16(cw, torch.float16)
    x = torch.randn(2, 3, 256).to(torch.float16)
    ref = x.reshape(6, 256).float() @ cw.dequantize(torch.float32).half().float()
    for path in ("triton-wna16", "triton-wna16-swap"):
        y = gemm.wna16_gemm(x, p, path=path)
        assert y.shape == (2, 3, 192)
        assert (y.reshape(6, 192).float() - ref).abs().max().item() <= 4e-3 * ref.abs().max().item() + 1e-3, path

    # dequantize kernel: fp16 bit-exact against the emulation and the canonical weight; bf16 within truncation
    for bits in (4, 8):
        for asym in (False, True):
            cw = canonical(320, 192, bits, 64, asym, True, seed=bits + asym)
            for dt in (torch.float16, torch.bfloat16):
                cw_r = CanonicalWeight(cw.codes, cw.scales.to(dt).float(), cw.zeros, cw.g_idx, bits, 64)
                p = repack.repack_wna16(cw_r, dt)
                w = tw.dequantize(p)
                emu = gemm_ref.dequantize_wna16(p)
                truth = cw_r.dequantize(torch.float32)[p.perm].to(dt)
                if dt == torch.float16:
                    assert torch.equal(w, emu) and torch.equal(w, truth), (bits, asym)
                else:
                    assert (w.float() - truth.float()).abs().max().item() <= 2 ** -7 * truth.abs().max().item()
                y = tw.dequant_matmul(torch.randn(5, 320).to(dt), p)
                assert y.shape == (5, 192) and not torch.isnan(y).any()
                # column ranges (a 64-multiple start, a ragged end) into a view with a longer row stride
                buf = torch.full((320, 200), float("nan"), dtype=dt)
                part = tw.dequantize(p, buf[:, :120], cols=(64, 184))
                assert torch.equal(part, w[:, 64:184]) and torch.isnan(buf[:, 120:]).all(), (bits, asym, dt)

    # dequantize + cuBLAS in column chunks (triton-dequant-l2+cublas): each chunk's columns are the one-pass GEMM's
    cw = canonical(256, 448, 4, 128, True, False, seed=21)
    p = repack.repack_wna16(cw, torch.float16)
    x, bias = torch.randn(7, 256).half(), torch.randn(448).half()
    whole = tw.dequant_matmul(x, p, bias)
    for chunk in (64, 128, 192, 448, 1024):
        out = torch.full((7, 448), float("nan"), dtype=torch.float16)
        y = tw.dequant_matmul(x, p, bias, out=out, chunk_cols=chunk)
        assert y.data_ptr() == out.data_ptr() and torch.allclose(y.float(), whole.float(), atol=1e-3, rtol=1e-3), chunk
    for bad in ((32, 96), (0, 449)):
        try:
            tw.dequantize(p, cols=bad)
        except ValueError as e:
            assert "multiple of 64" in str(e)
        else:
            raise AssertionError(f"dequantize accepted {{bad}}")
    print("TRITON-WNA16-OK")
""")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_wna16_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    script = SCRIPT.format(root=str(ROOT), tests=str(ROOT / "tests"))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "TRITON-WNA16-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_resolve_splits_evenly_and_fits_groups():
    from lqe.kernels import triton_wna16 as tw

    cpu = torch.device("cpu")
    for k in (576, 1024, 4096, 14336):
        for gs in (32, 64, 128, k):
            for m in (1, 8, 16, 64, 300):
                cfg, split, iters = tw.resolve(tw.pick_config(m, 4096, k), m, 4096, k, gs, cpu)
                kblocks = -(-k // cfg.block_k)
                assert split * iters == kblocks and split >= 1
                assert gs % cfg.block_k == 0 or gs >= k  # no K block straddles a group
    assert tw.fit_block_k(128, 32, 4096) == 32 and tw.fit_block_k(128, 4096, 4096) == 128
    assert tw.fit_block_k(128, 576, 576) == 128  # per-channel: one group
    # the interpreter's fixed "SM count" (4) x CTAS_PER_SM asks for splits on a one-tile problem
    _, split, _ = tw.resolve(tw.WNA16Config(16, 128, 128), 1, 128, 4096, 128, cpu)
    assert split > 1
    _, split, _ = tw.resolve(tw.WNA16Config(16, 128, 128, split_k=1), 1, 128, 4096, 128, cpu)
    assert split == 1


def test_sweep_lists_table_config_first():
    from lqe.kernels import triton_wna16 as tw

    for m in (1, 8, 16, 32, 64, 128, 256, 1024):
        cands = tw.sweep_configs(m)
        assert cands[0] == tw.pick_config(m, 0, 0)
        assert len(cands) == len(set(cands)) and 2 <= len(cands) <= 12


def test_table_falls_back_to_counterparts():
    from lqe.kernels import dispatch, gemm

    table = tuple(dispatch.WNA16_TABLE)
    both = gemm._table_for("t", True, True, False, table)
    assert [name for _, name in both] == [name for _, name in dispatch.WNA16_TABLE]
    only_cuda = gemm._table_for("t", True, False, False, table)
    assert not any(name.startswith("triton") for _, name in only_cuda)
    only_triton = gemm._table_for("t", False, True, False, table)
    assert all(name.startswith("triton") for _, name in only_triton)
    assert dispatch.WNA16_TABLE[-1][0] is None
    # a layer repacked for lqe-w4a16-mma runs every row on that layout (the mma GEMM or its dequantize + cuBLAS)
    mma = gemm._table_for("t", True, True, True, tuple(dispatch.WNA16_MMA_TABLE))
    assert all(name.startswith("lqe-w4a16-mma") for _, name in mma)
    # and an mma row met by a plain-layout layer becomes its counterpart
    plain = gemm._table_for("t", True, True, False, tuple(dispatch.WNA16_MMA_TABLE))
    assert not any(name.startswith("lqe-w4a16-mma") for _, name in plain)


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1", reason="needs the real Triton JIT")
def test_wna16_kernels_compile_for_hopper_without_a_gpu():
    """Compile the table's configs to sm_90: tensor cores used, no local-memory spills in the PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lqe.kernels import triton_wna16 as tw

    types = {"X": "*bf16", "QW": "*i32", "S": "*bf16", "Z": "*bf16", "Bias": "*bf16", "Out": "*bf16",
             "Part": "*fp32", "W": "*bf16"}

    def compile_kernel(fn, consts, warps, stages):
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        return triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})

    # (zero points: the generic dequantization; symmetric swap configs: the inline-PTX magic-number one, ASM_DQ=1)
    cases = [(cfg, True) for _, cfg in tw.CONFIG_TABLE[:1] + tw.CONFIG_TABLE[-1:] + tw.SWAP_CONFIG_TABLE]
    cases += [(cfg, False) for _, cfg in tw.SWAP_CONFIG_TABLE if cfg.factored]
    for cfg, zp in cases:
        asm_dq = 0 if zp or not cfg.swap_ab else 1
        consts = dict(BITS=4, HAS_ZP=zp, HAS_BIAS=True, MAGIC=0x4300, MAGIC_C=128.0, FACTORED=cfg.factored,
                      EVEN_K=True, EVEN_N=True, SPLIT=False, DOT_F32=False, SWAP_AB=cfg.swap_ab, BM=cfg.block_m,
                      BN=cfg.block_n, BK=cfg.block_k, GROUP_M=8, ASM_DQ=asm_dq, GS_SHIFT=7, PDL=False)
        k = compile_kernel(tw._wna16_gemm_kernel, consts, cfg.num_warps, cfg.num_stages)
        ptx = k.asm["ptx"]
        assert "mma" in ptx, f"{cfg.label()}: no tensor-core instruction"
        assert ".local" not in ptx, f"{cfg.label()}: local memory in PTX"
        if cfg.swap_ab:
            # wgmma with the dequantized weights as its register operand A ("{a regs}, b-desc"), the tokens as
            # its N: the weights never go through shared memory, M is not padded to 64
            wgmma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
            assert wgmma and all(re.search(r"\}, \{%r", line) for line in wgmma), f"{cfg.label()}: A not in registers"
            assert f"m64n{cfg.block_m}k16" in wgmma[0], (cfg.label(), wgmma[0][:80])
        if asm_dq:  # one lop3 per packed pair and one packed bf16 fma
            assert "lop3.b32" in ptx and "fma.rn.bf16x2" in ptx, cfg.label()
    k = compile_kernel(tw._wna16_dequant_kernel, dict(BITS=8, HAS_ZP=False, BK=64, BN=256), 8, 1)
    assert "st.global" in k.asm["ptx"]


def test_swap_kernel_is_a_table_name_with_its_own_configs():
    from lqe.kernels import gemm, triton_wna16 as tw

    table = ((16, "triton-wna16-swap"), (None, "triton-dequant+cublas"))
    assert [n for _, n in gemm._table_for("t", True, True, False, table)] == ["triton-wna16-swap", "triton-dequant+cublas"]
    assert [n for _, n in gemm._table_for("t", True, False, False, table)] == ["lqe-wna16-fused", "dequant+cublas"]
    for m in (1, 16, 17, 64, 65, 4096):
        cfg = tw.pick_config(m, 4096, 4096, swap_ab=True)
        # one token tile up to M = 64; above it several 64-token tiles (the H200 sweep at 50fb9ce: 0.69x at M = 128
        # against the 128-token tile's 0.40x)
        assert cfg.swap_ab and cfg.block_m >= min(m, 64) and cfg.block_m % 16 == 0 and cfg.block_n % 64 == 0
        assert not tw.pick_config(m, 4096, 4096).swap_ab
    assert tw.pick_config(1, 0, 0, swap_ab=True).label().endswith("-t")
