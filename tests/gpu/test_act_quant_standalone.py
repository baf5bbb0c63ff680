"""The standalone Triton activation quantizer (lqe/kernels/triton_act_quant.py: the input of a W8A8 / FP8 layer with no
fused producer, o_proj) bit for bit against the torch references evaluated on CPU (every quotient the IEEE one):
per-token int8 symmetric / asymmetric, static int8 (with and without a zero point), per-token fp8 e4m3, 1 x 128 (and
1 x 32) fp8 groups, static fp8; float16 / bfloat16 / float32 inputs, odd shapes, rows of zeros, ties, saturation, the
multi-chunk path of long rows; and the layer-facing wrappers of lqe/kernels/w8a8.py on the same inputs. The ``check_*``
helpers also run on CPU under ``TRITON_INTERPRET=1`` (tests/test_triton_act_quant.py).
"""
from __future__ import annotations

import pytest
import torch

from test_fused_act_quant import TIES, probe_inputs

STATIC_INT8 = ((1.0, None), (0.03, 5), (0.037, -7), (2.0 ** -3, -128), (0.001, 100))
STATIC_FP8 = (0.004, 0.3)


def act_inputs(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A strided ``[m, k]`` view of random rows plus special rows (when M allows): 0 ties at absmax 127 (inv 1), 1 all
    zeros, 2 large magnitude, 3 one dominant spike, 4 all positive far from 0 (a large negative zero point), 5 constant
    nonzero (asymmetric: scale 0, q 0), 6 tiny values (fp8: scale near the 1e-12 floor)."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(m, k + 24, generator=g) * 3
    x = wide[:, :k]
    n_ties = min(len(TIES), k)
    rows = {0: torch.cat([torch.tensor(TIES[:n_ties]), torch.rand(k - n_ties, generator=g) * 100]),
            1: torch.zeros(k), 2: x[2] * 1000 if m > 2 else None, 3: torch.full((k,), 0.01),
            4: x[4].abs() + 40 if m > 4 else None, 5: torch.full((k,), 1.5), 6: x[6] * 1e-9 if m > 6 else None}
    rows[3][k // 2] = 3e3
    for i, row in rows.items():
        if i < m and row is not None:
            x[i] = row
    return wide.to(dtype)[:, :k]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().cpu()
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t


def _same(got, want, what):
    g, w = _bits(got), _bits(want)
    assert g.shape == w.shape and g.dtype == w.dtype, (what, tuple(g.shape), g.dtype, tuple(w.shape), w.dtype)
    assert torch.equal(g, w), (what, int((g != w).sum()), "of", g.numel())


def check_int8(m: int, k: int, dtype: torch.dtype, device: str, chunk: int | None = None, x: torch.Tensor | None = None):
    from lqe.kernels import triton_act_quant as taq
    from lqe.kernels.act_quant_ref import per_token_quant_int8, static_quant_int8

    x = act_inputs(m, k, dtype) if x is None else x
    xd = x.to(device)
    what = f"int8 M={m} K={k} {dtype} chunk={chunk} on {device}"
    for sym in (True, False):
        q, s, z = taq.quant_int8(xd, sym, use_triton=True, chunk=chunk)
        rq, rs, rz = per_token_quant_int8(x.cpu(), sym)
        _same(q, rq, f"{what} sym={sym} q")
        _same(s, rs, f"{what} sym={sym} scale")
        assert (z is None) == sym and (sym or torch.equal(z.cpu(), rz)), (what, "azp")
    for scale, zp in STATIC_INT8:
        s_t = torch.tensor([scale], device=device)
        z_t = None if zp is None else torch.tensor([zp], dtype=torch.int32, device=device)
        q, s, z = taq.quant_int8(xd, scale=s_t, azp=z_t, use_triton=True, chunk=chunk)
        assert s is s_t and z is z_t
        _same(q, static_quant_int8(x.cpu(), s_t.cpu(), None if z_t is None else z_t.cpu()), f"{what} static {scale} {zp}")


def check_fp8(m: int, k: int, dtype: torch.dtype, device: str, chunk: int | None = None, x: torch.Tensor | None = None,
              groups: tuple[int, ...] = (0, 32, 128)):
    from lqe.kernels import triton_act_quant as taq
    from lqe.kernels.fused_quant_fp8 import quant_fp8_ref, quant_fp8_static_ref

    x = act_inputs(m, k, dtype) if x is None else x
    xd = x.to(device)
    what = f"fp8 M={m} K={k} {dtype} chunk={chunk} on {device}"
    for group in groups:
        if group and k % group:
            continue
        q, s = taq.quant_fp8(xd, group, use_triton=True, chunk=chunk)
        rq, rs = quant_fp8_ref(x.cpu(), group)
        _same(q, rq, f"{what} group={group} q")
        _same(s, rs, f"{what} group={group} scale")
    for scale in STATIC_FP8:
        s_t = torch.tensor([scale], device=device)
        q, s = taq.quant_fp8(xd, scale=s_t, use_triton=True, chunk=chunk)
        assert s is s_t
        _same(q, quant_fp8_static_ref(x.cpu(), s_t.cpu()), f"{what} static {scale}")


def check_exhaustive(dtype: torch.dtype, device: str, fp8: bool = True) -> None:
    """Every ``dtype`` value ``v`` with ``2^-8 <= |v| <= absmax`` for a dozen row absmaxes (tests/gpu/test_fused_act_quant
    ``probe_inputs``): the division and rounding of every scheme on every input value."""
    act = probe_inputs(dtype)[1]
    check_int8(*act.shape, dtype, device, x=act)
    if fp8:
        check_fp8(*act.shape, dtype, device, x=act, groups=(0,))


def check_layer_wrappers(device: str) -> None:
    """What the W8A8 / FP8 layers call when they quantize for themselves (lqe/kernels/w8a8.py) gives the reference's
    bits on ``device``: the int8 per-token quantizer (CUDA extension or this kernel), static int8, fp8 per token,
    static and per 1 x 128 group."""
    from lqe.kernels import w8a8 as kw
    from lqe.kernels.act_quant_ref import per_token_quant_int8, static_quant_int8
    from lqe.kernels.fused_quant_fp8 import quant_fp8_ref, quant_fp8_static_ref

    x = act_inputs(9, 384, torch.bfloat16)
    xd = x.to(device)
    for sym in (True, False):
        q, s, z = kw.quantize_per_token_any(xd, sym)
        rq, rs, rz = per_token_quant_int8(x, sym)
        _same(q, rq, f"quantize_per_token_any sym={sym}")
        _same(s, rs.reshape(-1), "quantize_per_token_any scale")
        assert sym or torch.equal(z.cpu(), rz.reshape(-1))
    sc, zp = torch.tensor([0.03], device=device), torch.tensor([5], dtype=torch.int32, device=device)
    _same(kw.quantize_static(xd, sc, zp), static_quant_int8(x, sc.cpu(), zp.cpu()), "quantize_static")
    q, s = kw.fp8_quantize_per_token(xd)
    rq, rs = quant_fp8_ref(x)
    _same(q, rq, "fp8_quantize_per_token q")
    _same(s, rs, "fp8_quantize_per_token scale")
    q, s = kw.fp8_quantize_static(xd, sc)
    _same(q, quant_fp8_static_ref(x, sc.cpu()), "fp8_quantize_static q")
    assert s.shape == (9, 1) and torch.equal(s.cpu(), sc.cpu().reshape(1, 1).expand(9, 1))
    q, s = kw.fp8_quantize_group(xd, 128)
    rq, rs = quant_fp8_ref(x, 128)
    _same(q, rq, "fp8_quantize_group q")
    _same(s, rs, "fp8_quantize_group scale")


def check_leading_dims_empty_and_bad_input(device: str) -> None:
    from lqe.kernels import triton_act_quant as taq

    x = act_inputs(6, 96, torch.float16).to(device)
    q, s, _ = taq.quant_int8(x.reshape(2, 3, 96), use_triton=True)
    assert q.shape == (6, 96) and s.shape == (6, 1)
    q, s = taq.quant_fp8(x.reshape(2, 3, 96), 32, use_triton=True)
    assert q.shape == (6, 96) and s.shape == (6, 3)
    q, s, z = taq.quant_int8(x[:0], False, use_triton=True)
    assert q.shape == (0, 96) and s.shape == (0, 1) and z.shape == (0, 1)
    q, s = taq.quant_fp8(x[:0], use_triton=True)
    assert q.shape == (0, 96) and s.shape == (0, 1)
    with pytest.raises(ValueError, match="group"):
        taq.quant_fp8(x, 128, use_triton=True)  # 96 is not a multiple of 128
    with pytest.raises(ValueError, match="static fp8"):
        taq.quant_fp8(x, 32, scale=torch.tensor([0.1], device=device), use_triton=True)
    with pytest.raises(ValueError, match="azp without scale"):
        taq.quant_int8(x, azp=torch.tensor([1], dtype=torch.int32, device=device), use_triton=True)


def fp8_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_int8_quantizer_bit_exact(dtype):
    for m, k in ((1, 4096), (7, 200), (33, 14336), (130, 4096), (5, 5000)):
        check_int8(m, k, dtype, "cuda")
    check_int8(9, 1000, dtype, "cuda", chunk=256)  # several chunks, ragged last one
    if dtype != torch.float32:
        check_exhaustive(dtype, "cuda", fp8=False)


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_ok(), reason="needs an FP8 GPU (sm89+)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fp8_quantizer_bit_exact(dtype):
    for m, k in ((1, 4096), (7, 256), (33, 14336), (130, 4096), (5, 5000)):
        check_fp8(m, k, dtype, "cuda")
    check_fp8(9, 1024, dtype, "cuda", chunk=256)
    if dtype != torch.float32:
        check_exhaustive(dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_ok(), reason="needs an FP8 GPU (sm89+)")
def test_layer_wrappers_and_edge_cases():
    check_layer_wrappers("cuda")
    check_leading_dims_empty_and_bad_input("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_ok(), reason="needs an FP8 GPU (sm89+)")
def test_quantizers_capture_in_a_cuda_graph():
    """No host sync, nothing allocated outside the graph's pool: the unfused layers' quantization is capturable."""
    from lqe.kernels import triton_act_quant as taq

    x = act_inputs(16, 4096, torch.bfloat16).cuda()
    sc = torch.tensor([0.03], device="cuda")
    eager = [taq.quant_int8(x), taq.quant_int8(x, False), taq.quant_fp8(x), taq.quant_fp8(x, 128),
             taq.quant_fp8(x, scale=sc)]
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [taq.quant_int8(x), taq.quant_int8(x, False), taq.quant_fp8(x), taq.quant_fp8(x, 128),
                taq.quant_fp8(x, scale=sc)]
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, outs):
        for ta, tb in zip(a, b):
            assert (ta is None) == (tb is None) and (ta is None or torch.equal(_bits(ta), _bits(tb)))
