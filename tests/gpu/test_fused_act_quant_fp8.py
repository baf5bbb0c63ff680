"""RMSNorm / SiLU-mul fused with the dynamic fp8 e4m3 quantization (lqe/kernels/fused_quant_fp8.py), per token and
per 1 x 128 group, against the unfused path bit for bit: the float op of lqe/kernels/fused_ops.py on the same device,
then :func:`quant_fp8_ref` (on CPU: every quotient the IEEE one); and against the torch twins wherever the float
activation agrees. The ``check_*`` helpers also run on CPU under ``TRITON_INTERPRET=1`` (tests/test_fused_quant_fp8.py).
"""
from __future__ import annotations

import pytest
import torch

from test_fused_act_quant import EPS, norm_inputs, silu_inputs


def fp8_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def _compare(q, s, y, twin_q, twin_s, twin_y, group, what):
    from lqe.kernels.fused_quant_fp8 import quant_fp8_ref

    k = q.shape[-1]
    q, s, y = q.reshape(-1, k), s.reshape(q.reshape(-1, k).shape[0], -1).cpu(), y.reshape(-1, k)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape[1] == (1 if group == 0 else k // group)
    ref_q, ref_s = quant_fp8_ref(y.cpu(), group)
    assert torch.equal(s, ref_s), (what, "scale != reference(unfused)", (s - ref_s).abs().max().item())
    assert torch.equal(_bits(q), _bits(ref_q)), (what, "q != reference(unfused)", int((_bits(q) != _bits(ref_q)).sum()))
    same = (y.cpu() == twin_y.reshape(y.shape)).all(-1)
    twin_q, twin_s = twin_q.reshape(q.shape), twin_s.reshape(s.shape)
    assert torch.equal(_bits(q)[same], _bits(twin_q)[same]) and torch.equal(s[same], twin_s[same]), (what, "!= twin")
    return {"rows_like_twin": int(same.sum()), "rows": len(same)}


def _compare_static(q, s, scale, y, twin_q, twin_y, what):
    """Static: the codes are fp8_quantize_static's (what the unfused layer computes), the scale the consumer's own."""
    from lqe.kernels import w8a8

    assert s is scale, (what, "the static scale returned is not the consumer's tensor")
    k = q.shape[-1]
    q, y = q.reshape(-1, k), y.reshape(-1, k)
    ref_q, ref_s = w8a8.fp8_quantize_static(y, scale)
    assert torch.equal(_bits(q), _bits(ref_q)), (what, "q != fp8_quantize_static", int((_bits(q) != _bits(ref_q)).sum()))
    assert torch.equal(ref_s.cpu(), scale.cpu().reshape(1, 1).expand(len(q), 1))
    same = (y.cpu() == twin_y.reshape(y.shape)).all(-1)
    assert torch.equal(_bits(q)[same], _bits(twin_q.reshape(q.shape))[same]), (what, "!= twin")
    return {"rows_like_twin": int(same.sum()), "rows": len(same)}


def check_rms_norm_quant_fp8(m, k, dtype, device, residual=True, group=0, static=False):
    from lqe.kernels import fused_ops as fo
    from lqe.kernels import fused_quant_fp8 as fq

    x, r, w = norm_inputs(m, k, dtype, residual)
    xd, rd, wd = x.to(device), (r.to(device) if residual else None), w.to(device)
    if static:  # a scale that saturates the largest values (the clamp) and rounds the rest
        scale = torch.tensor([0.004], device=device)
        q, s, new_r = fq.rms_norm_quant_fp8(xd, wd, EPS, rd, scale=scale)
        tq, _, _ = fq.rms_norm_quant_fp8_torch(x, w, EPS, r, scale=scale.cpu())
        y, ty = fo.rms_norm(xd, wd, EPS, rd), fo.rms_norm_torch(x, w, EPS, r)
        if residual:
            (y, ref_r), ty = y, ty[0]
            assert torch.equal(new_r, ref_r), "residual != rms_norm's residual"
        return _compare_static(q, s, scale, y, tq, ty, f"static rms_norm_quant_fp8 M={m} K={k} {dtype} on {device}")
    q, s, new_r = fq.rms_norm_quant_fp8(xd, wd, EPS, rd, group=group)
    y = fo.rms_norm(xd, wd, EPS, rd)
    if residual:
        y, ref_r = y
        assert torch.equal(new_r, ref_r), "residual != rms_norm's residual"
    else:
        assert new_r is None
    tq, ts, _ = fq.rms_norm_quant_fp8_torch(x, w, EPS, r, group)
    ty = fo.rms_norm_torch(x, w, EPS, r)
    ty = ty[0] if residual else ty
    what = f"rms_norm_quant_fp8 M={m} K={k} {dtype} residual={residual} group={group} on {device}"
    return _compare(q, s, y, tq, ts, ty, group, what)


def check_silu_mul_quant_fp8(m, inter, dtype, device, group=0, chunk=None, static=False):
    from lqe.kernels import fused_ops as fo
    from lqe.kernels import fused_quant_fp8 as fq

    x = silu_inputs(m, inter, dtype)
    xd = x.to(device)
    if static:
        scale = torch.tensor([0.002], device=device)
        q, s = fq.silu_mul_quant_fp8(xd, chunk=chunk, scale=scale)
        tq, _ = fq.silu_mul_quant_fp8_torch(x, scale=scale.cpu())
        return _compare_static(q, s, scale, fo.silu_and_mul(xd), tq, fo.silu_and_mul_torch(x),
                               f"static silu_mul_quant_fp8 M={m} I={inter} {dtype} chunk={chunk} on {device}")
    q, s = fq.silu_mul_quant_fp8(xd, group=group, chunk=chunk)
    y = fo.silu_and_mul(xd)
    tq, ts = fq.silu_mul_quant_fp8_torch(x, group)
    what = f"silu_mul_quant_fp8 M={m} I={inter} {dtype} group={group} chunk={chunk} on {device}"
    return _compare(q, s, y, tq, ts, fo.silu_and_mul_torch(x), group, what)


def check_matches_layer_quantizer(device):
    """The per-token reference is what the FP8 layer's unfused path computes (lqe.kernels.w8a8)."""
    from lqe.kernels import w8a8
    from lqe.kernels.fused_quant_fp8 import quant_fp8_ref

    y = torch.randn(9, 256) * 3
    y[1] = 0
    q, s = w8a8.fp8_quantize_per_token(y.to(device))
    rq, rs = quant_fp8_ref(y)
    assert torch.equal(s.cpu(), rs) and torch.equal(_bits(q), _bits(rq))


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_ok(), reason="needs an FP8 GPU (sm89+)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [0, 128])
def test_fused_fp8_quant_bit_exact(dtype, group):
    for m, k in ((1, 4096), (7, 256), (33, 14336)):
        for residual in (False, True):
            check_rms_norm_quant_fp8(m, k, dtype, "cuda", residual, group)
    for m, inter in ((1, 14336), (7, 256), (26, 1024)):
        check_silu_mul_quant_fp8(m, inter, dtype, "cuda", group)
    check_silu_mul_quant_fp8(7, 640, dtype, "cuda", group, chunk=256)
    check_matches_layer_quantizer("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_ok(), reason="needs an FP8 GPU (sm89+)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_fp8_static_quant_bit_exact(dtype):
    for m, k in ((1, 4096), (33, 14336)):
        for residual in (False, True):
            check_rms_norm_quant_fp8(m, k, dtype, "cuda", residual, static=True)
    for m, inter in ((1, 14336), (26, 1024)):
        check_silu_mul_quant_fp8(m, inter, dtype, "cuda", static=True)
    check_silu_mul_quant_fp8(7, 640, dtype, "cuda", chunk=256, static=True)
