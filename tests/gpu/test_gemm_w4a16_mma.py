"""GPU: lqe-w4a16-mma (csrc/gemm/w4a16_mma.cu) against its CPU emulation (lqe/kernels/mma_ref.py) and the
canonical dequantization, for every W4/W8 format and group size, fp16/bf16, M across the 16/32/64-row tiles and
the 64-row problem split, odd K/N (padding), every stripe count, and CUDA-graph replay."""
from __future__ import annotations

import functools

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from lqe.kernels import gemm, mma_ref, repack_mma  # noqa: E402
from lqe.kernels.canonical import CanonicalWeight  # noqa: E402
from helpers import random_canonical  # noqa: E402  (tests/ is on sys.path)

MS = [1, 7, 16, 24, 33, 64, 65, 257]  # the 16 / 32 / 64-row tiles (24: MB=2), several 64-row problems
DTYPES = [torch.float16, torch.bfloat16]
# (format label, bits, group size, asym, act-order): GPTQ sym / asym (v1 and v2 decode alike), act-order, AWQ
# (asym, no act-order), compressed-tensors (sym / asym) all arrive as these CanonicalWeight kinds.
KINDS = [("gptq-sym", 4, 128, False, False), ("gptq-asym", 4, 128, True, False), ("gptq-act-order", 4, 128, False, True),
         ("gptq-asym-act-order", 4, 32, True, True), ("awq", 4, 64, True, False), ("ct-channel", 4, -1, False, False),
         ("w8-sym", 8, 128, False, False), ("w8-asym-act-order", 8, 64, True, True), ("w8-channel", 8, -1, True, False),
         ("w8-asym-g32", 8, 32, True, False)]


@pytest.fixture(scope="module", autouse=True)
def built():
    if not gemm.available():
        pytest.fail(f"lqe CUDA kernels did not build: {gemm.unavailable_reason()}")


canonical = functools.partial(random_canonical, fp16_scales=True)  # scales exact in fp16


def packed_on_gpu(cw, dtype):
    p = repack_mma.repack_mma(cw, dtype)
    mv = lambda t: None if t is None else t.cuda()  # noqa: E731
    return repack_mma.PackedMMA(mv(p.qweight), mv(p.scales), mv(p.zeros), mv(p.perm), p.bits, p.group_size, p.k,
                                p.n, p.k_pad, p.n_pad)


def reference(x, p, bias):
    """fp32 matmul of the emulated weights (bit-exact to the kernel's B fragments): only the accumulation order
    differs from the kernel."""
    w = mma_ref.dequantize_mma(p, x.dtype)[: p.k, : p.n].float().cuda()
    xs = x if p.perm is None else x.index_select(1, p.perm)
    y = xs.float() @ w
    return y if bias is None else y + bias.float()


def check(y, ref, k):
    assert torch.isfinite(y).all()
    err = (y.float() - ref).abs().max().item()
    tol = 2e-2 * ref.abs().max().item() + 1e-3 * k ** 0.5
    assert err <= tol, f"max abs err {err:.4g} > {tol:.4g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
def test_dequant_kernel_is_bit_exact_to_emulation(kind, dtype):
    _, bits, gs, asym, act_order = kind
    cw = canonical(200, 136, bits, gs, asym, act_order, seed=bits + gs)
    p = packed_on_gpu(cw, dtype)
    got = gemm.wna16_dequantize(p).cpu()
    want = mma_ref.dequantize_mma(p, dtype)[: p.k, : p.n]
    assert torch.equal(got, want)
    perm = p.perm.cpu() if p.perm is not None else torch.arange(p.k)
    cw_t = CanonicalWeight(cw.codes, cw.scales.to(dtype).float(), cw.zeros, cw.g_idx, cw.bits, cw.group_size)
    assert torch.equal(got, cw_t.dequantize(torch.float32)[perm].to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
@pytest.mark.parametrize("m", MS)
def test_gemm_matches_reference(m, kind, dtype):
    _, bits, gs, asym, act_order = kind
    k, n = (200, 136) if m % 2 else (1024, 768)  # odd shapes (K and N padding) and whole tiles
    cw = canonical(k, n, bits, gs, asym, act_order, seed=m * 13 + bits)
    p = packed_on_gpu(cw, dtype)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype) if m % 3 == 1 else None
    y = gemm.wna16_gemm(x, p, bias, path="lqe-w4a16-mma")
    assert y.shape == (m, n) and y.dtype == dtype
    check(y, reference(x, p, bias), k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
@pytest.mark.parametrize("sms", [1, 5])
@pytest.mark.parametrize("m", [1, 24, 64])
def test_long_stripes_every_format(m, sms, kind, dtype):
    """Stripes of many k-tiles crossing column tiles (1 block walks all 48; 5 blocks walk 10 each): the 4-stage
    ring is reused, group scales carry over and restart at a new column tile, skipped scale slots, and the
    slot reduction of pieces that share a tile, for every format and every instantiation (M = 1 / 24 / 64: one, two
    and four m16 tiles). Only a stripe this long runs the main loop's stage loads; the M = 1 kernel's were the ones
    ptxas 13.0 once miscompiled (.ci/sass_check.py), and the short-K tests never reached them."""
    _, bits, gs, asym, act_order = kind
    k, n = 1024, 768
    cw = canonical(k, n, bits, gs, asym, act_order, seed=sms + bits)
    p = packed_on_gpu(cw, dtype)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    y = gemm.wna16_gemm(x, p, bias, path="lqe-w4a16-mma", splits=sms)
    check(y, reference(x, p, bias), k)
    assert torch.equal(y, gemm.wna16_gemm(x, p, bias, path="lqe-w4a16-mma", splits=sms))


@pytest.mark.parametrize("gs", [96, 192, 2048])
@pytest.mark.parametrize("m", [1, 24, 64])
def test_group_sizes_off_the_power_of_two_path(m, gs):
    """Group sizes the kernel's one-group-per-k-tile path (G64: a power of two >= 64, or one group) does not take:
    96 and 192 (192 is a multiple of 64 but no power of two: the per-slab path, its group by division; K % g != 0),
    and 2048 > K (one group, the G64 path with its large shift), over long stripes."""
    k, n = 1024, 768
    cw = canonical(k, n, 4, gs, True, False, seed=gs)
    p = packed_on_gpu(cw, torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for sms in (1, 5):
        y = gemm.wna16_gemm(x, p, path="lqe-w4a16-mma", splits=sms)
        check(y, reference(x, p, None), k)


def test_unaligned_activation_view():
    """A view at an odd element offset (not 16-byte aligned) gives the aligned result."""
    cw = canonical(512, 256, 4, 128, True, False, seed=5)
    p = packed_on_gpu(cw, torch.bfloat16)
    base = torch.randn(3 * 512 + 1, device="cuda", dtype=torch.bfloat16)
    x = base[1:].view(3, 512)
    assert x.data_ptr() % 16 != 0
    check(gemm.wna16_gemm(x, p, path="lqe-w4a16-mma"), reference(x, p, None), 512)


@pytest.mark.parametrize("path", ["lqe-w4a16-mma", "lqe-w4a16-mma-k2"])
@pytest.mark.parametrize("sms", [1, 2, 5, 37, None, "2x", 500])
@pytest.mark.parametrize("m", [1, 48])
def test_every_stripe_count_gives_the_same_deterministic_result(sms, m, path):
    """1 block (no reduction) to many stripes per column tile (each piece above k = 0 in a workspace slot of its
    own, added up by the k = 0 piece in slot order; -k2: half the slots in each warp group): two blocks per SM
    ("2x") and more blocks than fit at once (500: a k = 0 piece waits only on blocks dispatched before it); twice =
    bit-identical."""
    if sms == "2x":
        sms = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    k, n = 4096, 512
    cw = canonical(k, n, 4, 128, True, False, seed=3)
    p = packed_on_gpu(cw, torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y1 = gemm.wna16_gemm(x, p, path=path, splits=sms)
    y2 = gemm.wna16_gemm(x, p, path=path, splits=sms)
    assert torch.equal(y1, y2)
    check(y1, reference(x, p, None), k)


def _k2_applies(gs: int) -> bool:
    """gemm_mma.MMA_K2_KERNEL runs its 8-warp kernel where every 64-row k-tile lies in one scale group (g a power of
    two >= 64, or channel-wise: an H100 / H200 holds its shared memory at every M); elsewhere it runs the 4-warp
    kernel, bit for bit lqe-w4a16-mma."""
    return gs == -1 or (gs >= 64 and gs & (gs - 1) == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS, ids=[k[0] for k in KINDS])
@pytest.mark.parametrize("sms", [1, 5, "2x"])
@pytest.mark.parametrize("m", [1, 7, 24, 64])
def test_k2_matches_reference_every_format(m, sms, kind, dtype):
    """lqe-w4a16-mma-k2: 8 warps per block, each k-tile's four slabs split between the lower and the upper four
    warps, whose sums the lower ones take over through shared memory at every piece's end. One block (every piece
    of every column tile in one stripe: the hand-over buffer reused piece after piece), 5 (a k = 0 piece with one
    slot to add: the upper warps add none) and two per SM (up to 15 slots, split between the warp groups); one, two
    and four m16 tiles (M = 1 / 24 / 64; M = 24 without bias), odd K / N at M = 7 (a partial last k-tile); every
    format, deterministic. Where it does not apply (g32) it is lqe-w4a16-mma, bit for bit."""
    _, bits, gs, asym, act_order = kind
    if sms == "2x":
        sms = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    k, n = (200, 136) if m == 7 else (1024, 768)
    cw = canonical(k, n, bits, gs, asym, act_order, seed=m + bits + gs)
    p = packed_on_gpu(cw, dtype)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype) if m != 24 else None
    y = gemm.wna16_gemm(x, p, bias, path="lqe-w4a16-mma-k2", splits=sms)
    assert y.shape == (m, n) and y.dtype == dtype
    check(y, reference(x, p, bias), k)
    assert torch.equal(y, gemm.wna16_gemm(x, p, bias, path="lqe-w4a16-mma-k2", splits=sms))
    if not _k2_applies(gs):
        assert torch.equal(y, gemm.wna16_gemm(x, p, bias, path="lqe-w4a16-mma", splits=sms))


def test_k2_in_a_table_runs_on_the_mma_layout(monkeypatch):
    """A table that names lqe-w4a16-mma-k2 repacks layers into the mma layout and runs it where its row says."""
    from lqe.kernels import dispatch
    from lqe.quant_layers.wna16_kernels import select_w4a16_kernel

    monkeypatch.setattr(dispatch, "WNA16_TABLE", [(16, "lqe-w4a16-mma-k2"), *dispatch.WNA16_MMA_TABLE])
    monkeypatch.delenv("LQE_WNA16_TABLE", raising=False)
    cw = canonical(1024, 512, 4, 128, True, False, seed=2)
    module, reasons = select_w4a16_kernel(cw, "cuda", torch.bfloat16)
    assert isinstance(module.packed(), repack_mma.PackedMMA), reasons
    assert gemm.kernel_for(8, torch.device("cuda"), mma_layout=True) == "lqe-w4a16-mma-k2"
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    y = module(x, None)
    check(y, reference(x, module.packed(), None), 1024)
    assert torch.equal(y, gemm.wna16_gemm(x, module.packed(), path="lqe-w4a16-mma-k2"))


def test_dequant_cublas_path_and_auto_table():
    cw = canonical(512, 256, 4, 64, True, True, seed=9)
    p = packed_on_gpu(cw, torch.float16)
    x = torch.randn(300, 512, device="cuda", dtype=torch.float16)
    ref = reference(x, p, None)
    check(gemm.wna16_gemm(x, p, path="lqe-w4a16-mma-dequant+cublas"), ref, 512)
    check(gemm.wna16_gemm(x, p), ref, 512)  # auto: the table resolved for the mma layout
    assert gemm.kernel_for(1, x.device, mma_layout=True) in ("lqe-w4a16-mma", "lqe-w4a16-mma-dequant+cublas")


@pytest.mark.parametrize("path", ["lqe-w4a16-mma", "lqe-w4a16-mma-k2"])
@pytest.mark.parametrize("m", [1, 16, 64, 130])
def test_cuda_graph_replay_equals_eager(m, path):
    """Captured (as a decode or piecewise graph runs it), the GEMM gives its eager bits and follows new inputs on
    replay; -k2 (g128: its 8-warp kernel) too."""
    k, n = 2048, 1024
    cw = canonical(k, n, 4, 128, False, True, seed=m)
    p = packed_on_gpu(cw, torch.bfloat16)
    gemm_mma_ws = __import__("lqe.kernels.gemm_mma", fromlist=["reserve_workspace"])
    gemm_mma_ws.reserve_workspace("cuda", p.n_pad)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    eager = gemm.wna16_gemm(x, p, path=path).clone()
    check(eager, reference(x, p, None), k)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemm.wna16_gemm(x, p, out=out, path=path)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gemm.wna16_gemm(x, p, out=out, path=path)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemm.wna16_gemm(x, p, path=path))


def test_quant_layer_path_selects_mma_when_the_table_names_it(monkeypatch):
    from lqe.quant_layers.wna16_kernels import select_w4a16_kernel

    monkeypatch.setenv("LQE_WNA16_TABLE", "mma")
    cw = canonical(1024, 512, 4, 128, True, True, seed=1)
    module, reasons = select_w4a16_kernel(cw, "cuda", torch.float16)
    assert "lqe-w4a16-mma" in module.describe(), (module.describe(), reasons)
    assert isinstance(module.packed(), repack_mma.PackedMMA)
    x = torch.randn(5, 1024, device="cuda", dtype=torch.float16)
    y = module(x, None)
    check(y, reference(x, module.packed(), None), 1024)
