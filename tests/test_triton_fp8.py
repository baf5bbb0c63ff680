"""The Triton FP8 GEMMs (lqe/kernels/triton_fp8.py) on CPU under Triton's interpreter: per-token x per-channel and
128 x 128 block-scaled, split-K with a ragged last split, ragged M / N / K tiles (the checks of
tests/gpu/test_triton_fp8_gemm.py on small shapes)."""
from __future__ import annotations

import importlib.util

import pytest

from triton_compat import run_interpreted


SCRIPT = """
    import functools
    import torch
    import test_triton_fp8_gemm as T
    from lqe.kernels.triton_fp8 import Fp8Config as C
    check = functools.partial(T.check_fp8_mm, device="cpu")

    check(3, 72, 200, C(16, 32, 64, split_k=1))
    check(19, 40, 256, C(16, 32, 64, split_k=3), static=True, dt=torch.float16)
    check(1, 72, 384, C(16, 32, 128, split_k=0), bias=False)
    # block-scaled: N spans two 128-row weight blocks (ragged), K three 128 groups (ragged last one)
    check(5, 200, 300, C(16, 64, 128, split_k=1), block=True)
    check(18, 136, 384, C(16, 32, 128, split_k=2), block=True, dt=torch.float16)
    # the swapped GEMM (out^T = W x^T; per-channel only, a block-scaled launch ignores it): ragged N / K, split-K
    check(5, 72, 200, C(16, 64, 64, split_k=2, swap_ab=True), dt=torch.float16)
    check(16, 136, 256, C(16, 64, 128, split_k=1, swap_ab=True, precise_acc=False))
    check(5, 136, 256, C(16, 64, 128, split_k=2, swap_ab=True), block=True)
    # the pipelined split-K reduction (red_stages > 0: 16 x 64 x 9 partials exceed the unrolled budget)
    check(7, 72, 570, C(16, 64, 64, split_k=9))  # 9 K blocks (a ragged last one): 9 splits
    check(7, 136, 1152, C(16, 128, 128, split_k=9), block=True)
    print("FP8-GEMM-INTERPRET-OK")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_fp8_gemm_under_interpreter():
    run_interpreted(SCRIPT, "FP8-GEMM-INTERPRET-OK")


def test_fp8_configs_and_bad_scales():
    import torch

    from lqe.kernels import triton_fp8 as tf

    for table in (tf.CONFIGS, tf.BLOCK_CONFIGS):
        assert table[-1][0] is None and [mm for mm, _ in table[:-1]] == sorted(mm for mm, _ in table[:-1])
    assert all(c.block_k == tf.SCALE_BLOCK and c.block_n <= tf.SCALE_BLOCK for _, c in tf.BLOCK_CONFIGS)
    for m in (1, 16, 17, 64, 256, 1024):
        cfg = tf.pick_config(m, 4096, 4096)
        assert cfg.split_k >= 1 and (m > 64 or cfg.split_k * -(-m // cfg.block_m) * cfg.block_m <= tf.WS_ROWS)
        assert tf.sweep_configs(m)
    assert tf.red_stages(tf.Fp8Config(16, 64, split_k=5), 5) == 0  # 40 registers per thread of partials
    assert tf.red_stages(tf.Fp8Config(64, 64, split_k=5), 5) > 0  # 160
    assert tf.red_stages(tf.Fp8Config(16, 64, 64, split_k=9), 9) > 0  # the interpreter case above
    assert any(c.swap_ab for c in tf.sweep_configs(16)) and not any(c.swap_ab for c in tf.sweep_configs(64))
    x = torch.zeros(2, 256, dtype=torch.float8_e4m3fn)
    w = torch.zeros(8, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="block scales"):
        tf.fp8_mm(x, torch.ones(2, 3), w, torch.ones(1, 2), block_scale=True)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        tf.fp8_mm(x.float(), torch.ones(2), w, torch.ones(8))
