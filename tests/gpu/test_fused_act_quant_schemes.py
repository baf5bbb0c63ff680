"""RMSNorm / SiLU-mul fused with the asymmetric per-token and the static per-tensor int8 quantization
(lqe/kernels/fused_quant.py ``*_any``), bit for bit against the unfused path: the float op of lqe/kernels/fused_ops.py
on the same device, then the reference quantizer on its output (``per_token_quant_int8(symmetric=False)``,
``static_quant_int8``; on CPU, every quotient the IEEE one) and, on CUDA, what the W8A8 layer's own quantization
computes there (csrc/gemm/quant_per_token.cu for asymmetric, ``lqe.kernels.w8a8.quantize_static``); and against the
torch twins on the rows where the float activation agrees. The ``check_*`` helpers also run on CPU under
``TRITON_INTERPRET=1`` (tests/test_act_quant_fusion_schemes.py).
"""
from __future__ import annotations

import pytest
import torch

from test_fused_act_quant import EPS, norm_inputs, probe_inputs, silu_inputs

# static (scale, zero point) cases: ties at scale 1 (the tie row of norm_inputs), a typical scale, one that saturates
# and 0.3 / 0.03 (where y / scale and y * (1 / scale) round to different codes for a few float16 values)
STATIC_CASES = ((1.0, None), (1.0, 3), (0.3, None), (0.03, 5), (0.037, -7), (0.001, 100), (2.0 ** -3, -128))


def scheme_inputs(x: torch.Tensor, silu: bool) -> torch.Tensor:
    """Extra rows for the asymmetric quantizer (when M allows): 4 constant nonzero (max == min: scale 0, q 0),
    5 all positive far from 0 (a large negative zero point, the rounding of values beyond 2^22) and, SiLU-mul only,
    6 the range [-261, 249] of odd integers: scale 2, ``-128 - min / scale = 2.5`` (the zero point on a tie, to even:
    2) and every ``y / scale`` a tie (exact in float16; bfloat16 rounds the ends)."""
    x = x.clone()
    m, k = x.shape
    half = k // 2 if silu else k
    if m > 4:
        if silu:
            x[4, :half], x[4, half:] = 32.0, 0.25  # silu(32) * 0.25 = 8 exactly
        else:
            x[4] = 0.0  # the norm of a zero row is 0 * weight: constant 0 (a constant nonzero needs a constant weight)
    if m > 5:
        if silu:
            x[5, :half] = 32.0
            x[5, half:] = 30 + torch.rand(half, generator=torch.Generator().manual_seed(5))
        else:
            x[5] = x[5].abs() + 40
    if m > 6 and silu:
        v = torch.arange(-259, 249, 2, dtype=torch.float32)
        x[6, :half] = 32.0
        x[6, half:] = torch.cat([torch.tensor([-261.0, 249.0]), v])[torch.arange(half) % (len(v) + 2)] / 32
    return x


def _cuda_unfused(y: torch.Tensor, scheme):
    """The W8A8 layer's own quantization on CUDA (None off CUDA, or for asymmetric without the lqe extension)."""
    from lqe.kernels import gemm
    from lqe.kernels import w8a8 as kw

    if y.device.type != "cuda":
        return None
    y2 = y.reshape(-1, y.shape[-1])
    if scheme == "asym":
        if not gemm.available():
            return None
        q, s, z = kw.quantize_per_token(y2, False)
        return q, s.reshape(-1, 1), z.reshape(-1, 1)
    scale, azp = scheme
    return kw.quantize_static(y2, scale, azp), scale, azp


def _compare(q, s, z, y, twin, twin_y, scheme, what: str) -> dict:
    from lqe.kernels.act_quant_ref import per_token_quant_int8, static_quant_int8

    k = q.shape[-1]
    q, y = q.reshape(-1, k).cpu(), y.reshape(-1, k)
    assert q.dtype == torch.int8, what
    if scheme == "asym":
        s, z = s.reshape(-1, 1).cpu(), z.reshape(-1, 1).cpu()
        assert s.dtype == torch.float32 and z.dtype == torch.int32 and s.shape == z.shape == (q.shape[0], 1), what
        ref_q, ref_s, ref_z = per_token_quant_int8(y.cpu(), False)
        assert torch.equal(s, ref_s), (what, "scale != reference(unfused)", (s - ref_s).abs().max().item())
        assert torch.equal(z, ref_z), (what, "azp != reference(unfused)", int((z != ref_z).sum()))
    else:
        scale, azp = scheme
        assert s is scale and z is azp, (what, "static scale / zero point are returned as given")
        ref_q = static_quant_int8(y.cpu(), scale.cpu(), None if azp is None else azp.cpu())
    assert torch.equal(q, ref_q), (what, "q != reference(unfused)", int((q != ref_q).sum()))
    cuda = _cuda_unfused(y, scheme)
    if cuda is not None:
        assert torch.equal(q, cuda[0].cpu()), (what, "q != the layer's CUDA quantization", int((q != cuda[0].cpu()).sum()))
        if scheme == "asym":
            assert torch.equal(s, cuda[1].cpu()) and torch.equal(z, cuda[2].cpu()), (what, "scale/azp != CUDA kernel")
    tq = twin[0].reshape(q.shape)
    same = (y.cpu() == twin_y.reshape(y.shape)).all(-1)
    if y.device.type == "cpu":
        assert same.all(), (what, "the interpreter's float op should equal torch's", int((~same).sum()))
    assert torch.equal(q[same], tq[same]), (what, "q != twin")
    if scheme == "asym":
        assert torch.equal(s[same], twin[1].reshape(s.shape)[same]) and torch.equal(z[same], twin[2].reshape(z.shape)[same])
    return {"rows_like_twin": int(same.sum()), "rows": len(same)}


def _scheme_args(scheme, device):
    if scheme == "asym":
        return dict(symmetric=False), "asym"
    scale, azp = scheme
    s = torch.tensor([scale], dtype=torch.float32, device=device)
    z = None if azp is None else torch.tensor([azp], dtype=torch.int32, device=device)
    return dict(scale=s, azp=z), (s, z)


def check_rms_norm_schemes(m: int, k: int, dtype: torch.dtype, device: str, residual: bool = True) -> None:
    from lqe.kernels import fused_ops as fo
    from lqe.kernels import fused_quant as fq

    x, r, w = norm_inputs(m, k, dtype, residual)
    x = scheme_inputs(x, silu=False)
    xd, rd, wd = x.to(device), (r.to(device) if residual else None), w.to(device)
    y = fo.rms_norm(xd, wd, EPS, rd)
    y, ref_r = y if residual else (y, None)
    ty = fo.rms_norm_torch(x, w, EPS, r)
    ty = ty[0] if residual else ty
    for scheme in ("asym", *STATIC_CASES):
        kw, expect = _scheme_args(scheme, device)
        q, s, z, new_r = fq.rms_norm_quant_int8_any(xd, wd, EPS, rd, **kw)
        assert q.shape == (m, k)
        if residual:
            assert torch.equal(new_r, ref_r), "residual != rms_norm's residual"
        else:
            assert new_r is None
        cpu_kw = {key: (v.cpu() if isinstance(v, torch.Tensor) else v) for key, v in kw.items()}
        twin = fq.rms_norm_quant_int8_any_torch(x, w, EPS, r, **cpu_kw)
        _compare(q, s, z, y, twin, ty, expect, f"rms_norm_quant_int8 {scheme} M={m} K={k} {dtype} residual={residual}")


def check_silu_mul_schemes(m: int, inter: int, dtype: torch.dtype, device: str, chunk: int | None = None,
                           x: torch.Tensor | None = None) -> None:
    from lqe.kernels import fused_ops as fo
    from lqe.kernels import fused_quant as fq

    x = scheme_inputs(silu_inputs(m, inter, dtype), silu=True) if x is None else x
    y, ty = fo.silu_and_mul(x.to(device)), fo.silu_and_mul_torch(x)
    saved = fq.SILU_CHUNK
    for scheme in ("asym", *STATIC_CASES):
        kw, expect = _scheme_args(scheme, device)
        fq.SILU_CHUNK = chunk or saved
        try:
            q, s, z = fq.silu_mul_quant_int8_any(x.to(device), **kw)
        finally:
            fq.SILU_CHUNK = saved
        cpu_kw = {key: (v.cpu() if isinstance(v, torch.Tensor) else v) for key, v in kw.items()}
        twin = fq.silu_mul_quant_int8_any_torch(x, **cpu_kw)
        _compare(q, s, z, y, twin, ty, expect, f"silu_mul_quant_int8 {scheme} M={x.shape[0]} I={x.shape[1] // 2} "
                                               f"{dtype} chunk={chunk}")


def check_schemes_exhaustive(dtype: torch.dtype, device: str) -> None:
    """Every ``dtype`` value through the asymmetric and static quantizers (probe rows of test_fused_act_quant)."""
    x, _ = probe_inputs(dtype, rows=6)
    check_silu_mul_schemes(x.shape[0], x.shape[1] // 2, dtype, device, x=x)


def check_bad_arguments(device: str) -> None:
    from lqe.kernels import fused_quant as fq

    x = torch.randn(3, 64, device=device, dtype=torch.float16)
    with pytest.raises(ValueError, match="one scale"):
        fq.silu_mul_quant_int8_any(x, scale=torch.ones(2, device=device))
    with pytest.raises(ValueError, match="zero point is only given for static"):
        fq.silu_mul_quant_int8_any(x, azp=torch.zeros(1, dtype=torch.int32, device=device))


# ------------------------------------------------------------------------------------------------ GPU tests
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(1, 96), (7, 200), (26, 576), (257, 4096), (33, 5120)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_asym_static_bits(m, k, dtype, residual):
    check_rms_norm_schemes(m, k, dtype, "cuda", residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,inter,chunk", [(1, 200, None), (7, 1536, None), (26, 14336, None), (257, 4864, None),
                                           (9, 1000, 128)])
def test_silu_mul_asym_static_bits(m, inter, chunk, dtype):
    check_silu_mul_schemes(m, inter, dtype, "cuda", chunk)


@pytest.mark.parametrize("dtype", DTYPES)
def test_asym_static_quantizers_exhaustive(dtype):
    check_schemes_exhaustive(dtype, "cuda")
    check_bad_arguments("cuda")


def test_asym_static_capture_in_a_cuda_graph():
    from lqe.kernels import fused_quant as fq

    x, r, w = (t.cuda() for t in norm_inputs(8, 576, torch.bfloat16, True))
    a = silu_inputs(8, 1536, torch.bfloat16).cuda()
    scale, azp = torch.tensor([0.02], device="cuda"), torch.tensor([5], dtype=torch.int32, device="cuda")

    def run():
        return (*fq.rms_norm_quant_int8_any(x, w, EPS, r, symmetric=False),
                *fq.silu_mul_quant_int8_any(a, scale=scale, azp=azp))

    want = run()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run()
    scale.fill_(0.05)  # the static scale is read on the device at replay: a new value takes effect without capture
    graph.replay()
    torch.cuda.synchronize()
    for g, e in zip(got[:4], want[:4]):
        assert torch.equal(g, e)
    # the new scale took effect: the codes of this activation (the GPU's own SiLU-mul, whose exp / division may differ
    # from torch's in the last bits) quantized with it
    from lqe.kernels import fused_ops as fo
    from lqe.kernels.act_quant_ref import static_quant_int8

    y = fo.silu_and_mul(a).cpu()
    assert torch.equal(got[4].cpu(), static_quant_int8(y, scale.cpu(), azp.cpu()))
