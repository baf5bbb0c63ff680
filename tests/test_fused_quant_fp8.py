"""RMSNorm / SiLU-mul -> fp8 e4m3 fusion (lqe/kernels/fused_quant_fp8.py) on CPU under Triton's interpreter, bit for
bit against the unfused path (the checks of tests/gpu/test_fused_act_quant_fp8.py on awkward shapes), and the torch
twins against the quantizer the FP8 layer runs."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from triton_compat import run_interpreted


SCRIPT = """
    triton_compat.patch_bf16_rounding()
    triton_compat.patch_fp8_rounding()
    import torch
    import test_fused_act_quant_fp8 as F

    for dt in (torch.float16, torch.bfloat16):
        for group in (0, 32):
            for m, k in ((1, 96), (7, 256)):
                F.check_rms_norm_quant_fp8(m, k, dt, "cpu", residual=True, group=group)
            F.check_rms_norm_quant_fp8(5, 160, dt, "cpu", residual=False, group=group)
            F.check_silu_mul_quant_fp8(5, 224, dt, "cpu", group=group)
            F.check_silu_mul_quant_fp8(3, 320, dt, "cpu", group=group, chunk=128)  # several chunks, ragged last one
        F.check_rms_norm_quant_fp8(7, 256, dt, "cpu", residual=True, static=True)
        F.check_rms_norm_quant_fp8(5, 160, dt, "cpu", residual=False, static=True)
        F.check_silu_mul_quant_fp8(5, 224, dt, "cpu", static=True)
        F.check_silu_mul_quant_fp8(3, 320, dt, "cpu", chunk=128, static=True)
    F.check_matches_layer_quantizer("cpu")
    print("FUSED-FP8-INTERPRET-OK")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_fused_fp8_quant_under_interpreter():
    run_interpreted(SCRIPT, "FUSED-FP8-INTERPRET-OK")


def test_group_reference_and_bad_groups():
    from lqe.kernels import fused_quant_fp8 as fq

    y = torch.randn(3, 256)
    y[0, :128] = 0
    q, s = fq.quant_fp8_ref(y, 128)
    assert s.shape == (3, 2) and s[0, 0].item() == pytest.approx(1e-12 / 448) and not q[0, :128].float().any()
    deq = (q.float().reshape(3, 2, 128) * s[..., None]).reshape(3, 256)
    assert (deq - y).abs().max() <= y.abs().max() / 16  # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match="group"):
        fq.silu_mul_quant_fp8(torch.randn(2, 200), group=128)
    with pytest.raises(ValueError, match="group"):
        fq.rms_norm_quant_fp8(torch.randn(2, 192), torch.ones(192), 1e-6, group=96)
    with pytest.raises(ValueError, match="static fp8"):
        fq.silu_mul_quant_fp8(torch.randn(2, 256), group=128, scale=torch.tensor([0.1]))
    with pytest.raises(ValueError, match="static fp8"):
        fq.rms_norm_quant_fp8(torch.randn(2, 128), torch.ones(128), 1e-6, scale=torch.tensor([0.1, 0.2]))
