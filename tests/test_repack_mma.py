"""CPU tests of the ``lqe-w4a16-mma`` layout: every checkpoint format decodes to a CanonicalWeight, is repacked
(lqe.kernels.repack_mma) and decoded the way the CUDA threads do (lqe.kernels.mma_ref); the result must be the
canonical dequantization in the activation dtype, bit for bit."""
from __future__ import annotations

import pytest
import torch

from lqe.kernels import mma_ref, repack_mma
from lqe.kernels.canonical import CanonicalWeight
from lqe.quant_layers.reference import awq as awq_ref
from lqe.quant_layers.reference import ct as ct_ref
from lqe.quant_layers.reference import gptq as gptq_ref


def make_canonical(k, n, bits, gs, asym, act_order, seed, zero_min=0):
    g = torch.Generator().manual_seed(seed)
    gsz = k if gs == -1 else gs
    ng = -(-k // gsz)
    codes = torch.randint(0, 2**bits, (k, n), dtype=torch.uint8, generator=g)
    scales = (torch.rand(ng, n, generator=g) * 0.05 + 0.001).half().float()  # checkpoints store fp16 scales
    zeros = torch.randint(zero_min, 2**bits, (ng, n), dtype=torch.uint8, generator=g) if asym else None
    g_idx = (torch.randperm(k, generator=g) // gsz).to(torch.int32) if act_order else None
    return CanonicalWeight(codes, scales, zeros, g_idx, bits, gs)


def through_format(cw: CanonicalWeight, fmt: str) -> CanonicalWeight:
    """Encode ``cw`` as a checkpoint of ``fmt`` and decode it back the way the loaders do."""
    k, n = cw.shape
    if fmt in ("gptq", "gptq_v2"):
        t = gptq_ref.encode_gptq(cw, fmt)
        g_idx = t["g_idx"] if cw.g_idx is not None else None
        return gptq_ref.decode_gptq(t["qweight"], t["qzeros"], t["scales"], g_idx, cw.bits, cw.group_size,
                                    sym=cw.zeros is None, fmt=fmt)
    if fmt == "awq":
        t = awq_ref.encode_awq(cw)
        return awq_ref.decode_awq(t["qweight"], t["qzeros"] if cw.zeros is not None else None, t["scales"],
                                  cw.group_size)
    t = ct_ref.encode_ct_packed(cw)
    return ct_ref.decode_ct_packed(t["weight_packed"], t["weight_scale"], t["weight_shape"], cw.bits,
                                   cw.group_size, t.get("weight_zero_point"), t.get("weight_g_idx"))


def reference(cw: CanonicalWeight, dtype: torch.dtype) -> torch.Tensor:
    """``CanonicalWeight.dequantize`` in the activation dtype, scales as the kernel holds them (in ``dtype``)."""
    cw_t = CanonicalWeight(cw.codes, cw.scales.to(dtype).float(), cw.zeros, cw.g_idx, cw.bits, cw.group_size)
    return cw_t.dequantize(torch.float32).to(dtype)


def check_exact(cw: CanonicalWeight, dtype: torch.dtype) -> repack_mma.PackedMMA:
    k, n = cw.shape
    p = repack_mma.repack_mma(cw, dtype)
    assert p.k_pad % 64 == 0 and p.n_pad % 256 == 0 and p.k_pad - k < 64 and p.n_pad - n < 256
    assert p.qweight.dtype == torch.int32 and p.qweight.numel() * 32 == p.k_pad * p.n_pad * cw.bits
    perm = p.perm if p.perm is not None else torch.arange(k)
    assert (p.perm is not None) == cw.has_act_order()
    codes = mma_ref.unpack_mma_codes(p)
    assert torch.equal(codes[:k, :n], cw.codes.long()[perm])
    assert not codes[k:].any() and not codes[:, n:].any()  # padding holds zero codes
    got = mma_ref.dequantize_mma(p)
    assert got.dtype == dtype
    assert torch.equal(got[:k, :n], reference(cw, dtype)[perm])
    assert not got[:, n:].any()  # padded columns have zero scales
    return p


# Every format x group size (K % g != 0 where K=200 and g=32/64/128) x 4/8 bits x fp16/bf16.
FORMATS = [("gptq", False, False), ("gptq", True, False), ("gptq", False, True), ("gptq", True, True),
           ("gptq_v2", False, False), ("gptq_v2", True, False), ("gptq_v2", False, True), ("gptq_v2", True, True),
           ("awq", False, False), ("awq", True, False), ("ct", False, False), ("ct", True, False), ("ct", False, True),
           ("ct", True, True)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gs", [-1, 32, 64, 128])
@pytest.mark.parametrize("fmt,asym,act_order,bits", [(*f, b) for f in FORMATS for b in (4, 8) if f[0] != "awq" or b == 4])
def test_every_format_decodes_bit_exact(fmt, asym, act_order, bits, gs, dtype):
    # AWQ GEMM checkpoints are 4-bit only (the format has no 8-bit), hence no (awq, 8) case
    if act_order and gs == -1:
        act_order = False  # one group: g_idx is trivial and dropped by the decoders
    k, n = 200, 136  # K % 64, K % g and N % 256 all non-zero: padding on both axes
    cw = make_canonical(k, n, bits, gs, asym, act_order, seed=bits * 131 + gs + 7 * asym + 3 * act_order,
                        zero_min=1 if fmt == "gptq" else 0)
    cw = through_format(cw, fmt)
    assert (cw.zeros is not None) == asym and cw.has_act_order() == act_order
    check_exact(cw, dtype)


@pytest.mark.parametrize("k,n", [(64, 256), (16, 8), (1000, 520)])
def test_shapes_bit_exact(k, n):
    for bits, dtype in [(4, torch.float16), (8, torch.bfloat16)]:
        check_exact(make_canonical(k, n, bits, 16 if k == 16 else 64, True, k > 64, seed=k + n), dtype)


def test_extreme_codes_and_zeros():
    """Codes and zero points at both ends of their range (the magic-number paths have no headroom issue)."""
    for bits in (4, 8):
        top = 2**bits - 1
        cw = make_canonical(128, 256, bits, 64, True, False, seed=bits)
        cw.codes[:64] = top
        cw.codes[64:] = 0
        cw.zeros[0] = 0
        cw.zeros[1] = top
        for dtype in (torch.float16, torch.bfloat16):
            check_exact(cw, dtype)


def test_layout_vectors_are_stage_contiguous():
    """One block stage (64 x 256) is one contiguous run of the flat qweight, in (slab, warp, vec, lane) order:
    changing the codes of one stage changes only that run."""
    k, n, bits = 128, 512, 4
    cw = make_canonical(k, n, bits, 128, False, False, seed=5)
    p0 = repack_mma.repack_mma(cw, torch.float16)
    cw.codes[64:128, 256:512] ^= 0x5  # stage (k-tile 1, n-tile 1)
    p1 = repack_mma.repack_mma(cw, torch.float16)
    diff = (p0.qweight.reshape(-1) != p1.qweight.reshape(-1)).nonzero().reshape(-1)
    words_per_stage = 64 * 256 * bits // 32
    stage = 1 * (n // 256) + 1
    assert diff.min() >= stage * words_per_stage and diff.max() < (stage + 1) * words_per_stage


@pytest.mark.parametrize("bits,gs,asym,act_order", [(4, 128, False, False), (4, 32, True, True), (8, 64, True, True)])
@pytest.mark.parametrize("m", [1, 7, 65])
def test_emulated_gemm_matches_canonical(bits, gs, asym, act_order, m):
    k, n = 200, 136
    cw = make_canonical(k, n, bits, gs, asym, act_order, seed=m)
    p = repack_mma.repack_mma(cw, torch.bfloat16)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    bias = torch.randn(n).bfloat16()
    y = mma_ref.gemm_mma_ref(x, p, bias)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    ref = x.float() @ reference(cw, torch.bfloat16).float() + bias.float()
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.parametrize("n_tiles,k_tiles,sms", [(16, 64, 132), (112, 64, 132), (1, 3, 132), (5, 7, 4), (24, 9, 132),
                                                 (16, 64, 264), (1, 224, 132)])
def test_stripe_schedule_covers_every_tile_once_with_one_slot_per_piece(n_tiles, k_tiles, sms):
    """Every tile's K range is covered once; its k = 0 piece lies in the lowest of its stripes and every other piece
    in a higher one (run by a lower block, dispatched first), each with a slot of its own below workspace_slots."""
    blocks = mma_ref.stripe_pieces(n_tiles, k_tiles, sms)
    assert len(blocks) <= sms
    slots = mma_ref.workspace_slots(n_tiles, k_tiles, sms)
    seen = {}
    for s, pieces in enumerate(blocks):
        for t, k_lo, k_hi, slot in pieces:
            seen.setdefault(t, []).append((k_lo, k_hi, slot, s))
    assert sorted(seen) == list(range(n_tiles))
    for t, ps in seen.items():
        ps.sort()
        assert ps[0][0] == 0 and ps[-1][1] == k_tiles
        assert all(a[1] == b[0] for a, b in zip(ps, ps[1:]))  # contiguous, no overlap
        closer = ps[0]
        assert closer[2] == -1 and all(p[2] >= 0 for p in ps[1:])
        assert sorted(p[2] for p in ps[1:]) == list(range(len(ps) - 1))  # slots 0.. of the tile, each once
        assert all(p[3] > closer[3] for p in ps[1:]) and len(ps) - 1 <= slots
    assert slots == max(len(ps) - 1 for ps in seen.values())


@pytest.mark.parametrize("n,k,sms", [(28672, 4096, 132), (6144, 4096, 132), (4096, 4096, 132), (4096, 14336, 132),
                                     (4096, 14336, 108), (28672, 4096, 108), (6144, 4096, 78), (2048, 576, 132)])
def test_stripe_schedule_never_chains_the_blocks(n, k, sms):
    """No block waits for another to finish its stripe: a launch lasts about one stripe (``per`` k-tiles), not
    ``grid x per`` (the Llama-3-8B layer shapes on H100 / A100 SM counts, and a small one)."""
    n_tiles, k_tiles = -(-n // 256), -(-k // 64)
    _, per = mma_ref.stripe_plan(n_tiles, k_tiles, sms)
    assert mma_ref.stripe_critical_path(n_tiles, k_tiles, sms) <= per + 1


@pytest.mark.parametrize("n,k,sms", [(256, 14336, 224), (256, 14336, 132), (1024, 4096, 132), (4096, 4096, 132),
                                     (28672, 4096, 108), (6144, 4096, 78)])
def test_no_block_waits_on_one_not_dispatched(n, k, sms):
    """Block b runs stripe grid - 1 - b, so a piece waits only on stripes in lower blocks, which the GPU dispatches
    first: the launch finishes even when one block fits at a time (other kernels on the SMs, an ``sms`` above the
    resident slots). With block b on stripe b a resident block would spin on a block still waiting for its slot."""
    n_tiles, k_tiles = -(-n // 256), -(-k // 64)
    assert mma_ref.dispatch_completes(n_tiles, k_tiles, sms, resident=1)
    assert not mma_ref.dispatch_completes(n_tiles, k_tiles, sms, resident=1, reverse=False)
    grid, _ = mma_ref.stripe_plan(n_tiles, k_tiles, sms)
    assert [mma_ref.stripe_of_block(b, grid) for b in (0, grid - 1)] == [grid - 1, 0]


def test_unsupported_inputs_are_named():
    cw = make_canonical(100, 64, 4, 32, False, False, seed=0)
    with pytest.raises(ValueError, match="multiples of 8"):
        repack_mma.repack_mma(cw)
    cw = make_canonical(128, 64, 4, 24, False, False, seed=0)
    assert "group_size=24" in repack_mma.mma_unsupported(cw)
    cw = make_canonical(128, 64, 3, 32, False, False, seed=0)
    assert "bits=3" in repack_mma.mma_unsupported(cw)
    cw = make_canonical(128, 64, 4, 32, False, True, seed=0)
    cw.g_idx[:5] = 0  # group 0 gets more than group_size rows
    assert "contiguous groups" in repack_mma.mma_unsupported(cw)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        repack_mma.repack_mma(make_canonical(128, 64, 4, 32, False, False, seed=0), torch.float32)


def test_tables_resolve_to_one_layout(monkeypatch):
    """A table naming lqe-w4a16-mma serves mma-layout layers with only its two kernels; a wna16-layout layer
    (shape the mma kernel declines) gets the wna16 counterparts of the mma rows."""
    from lqe.kernels import dispatch, gemm

    assert gemm.table_uses_mma(dispatch.WNA16_MMA_TABLE) and not gemm.table_uses_mma(dispatch.WNA16_TABLE)
    assert {n for _, n in gemm._table_for("cuda:0", True, True, True, tuple(dispatch.WNA16_MMA_TABLE))} <= set(
        gemm._MMA_KERNELS)  # the measured table, whatever its rows: mma-layout kernels only
    mma = ((64, "lqe-w4a16-mma"), (None, "lqe-w4a16-mma-dequant+cublas"))
    assert set(n for _, n in gemm._table_for("cuda:0", True, True, True, mma)) == {
        "lqe-w4a16-mma", "lqe-w4a16-mma-dequant+cublas"}
    wna16_rows = ((2, "lqe-wna16-fused"), (64, "triton-wna16-swap"), (128, "triton-wna16"),
                  (None, "triton-dequant+cublas"))  # (a wna16-layout table: every GEMM row, then dequantize + cuBLAS)
    on_mma = gemm._table_for("cuda:0", True, True, True, wna16_rows)
    assert on_mma == ((2, "lqe-w4a16-mma"), (64, "lqe-w4a16-mma"), (128, "lqe-w4a16-mma"),
                      (None, "lqe-w4a16-mma-dequant+cublas"))
    assert [n for _, n in gemm._table_for("cuda:0", True, True, False, mma)] == ["triton-wna16", "triton-dequant+cublas"]
    # the 8-warp k-split row: an mma-layout name of its own, kept on that layout, triton-wna16 on the other
    k2 = ((16, "lqe-w4a16-mma-k2"), *mma)
    assert gemm.table_uses_mma(list(k2[:1]))
    assert gemm._table_for("cuda:0", True, True, True, k2)[0] == (16, "lqe-w4a16-mma-k2")
    assert gemm._table_for("cuda:0", True, True, False, k2)[0] == (16, "triton-wna16")
    assert [n for _, n in gemm._table_for("cuda:0", True, False, False, mma)] == ["lqe-wna16-fused", "dequant+cublas"]
    monkeypatch.setenv("LQE_WNA16_TABLE", "mma")
    assert gemm.active_table() is dispatch.WNA16_MMA_TABLE
    monkeypatch.setenv("LQE_WNA16_TABLE", "marlin")
    with pytest.raises(ValueError, match="LQE_WNA16_TABLE"):
        gemm.active_table()
    monkeypatch.delenv("LQE_WNA16_TABLE")
    assert gemm.active_table() is dispatch.WNA16_TABLE


def test_a_bad_warps_k_is_named():
    """The mma GEMM's warps per k-tile are 1 or 2 (lqe-w4a16-mma / -k2); anything else is refused before a launch."""
    from lqe.kernels import gemm_mma

    p = repack_mma.repack_mma(make_canonical(128, 64, 4, 64, False, False, seed=0), torch.float16)
    with pytest.raises(ValueError, match="warps_k=3"):
        gemm_mma.mma_gemm(None, torch.zeros(1, 128, dtype=torch.float16), p, None,
                          torch.empty(1, 64, dtype=torch.float16), warps_k=3)


def test_an_mma_table_that_cannot_be_honoured_says_so(monkeypatch, caplog):
    """LQE_WNA16_TABLE=mma with the CUDA extension unbuilt: the layer takes the wna16 layout (Triton), and a warning
    names why, once per reason (a benchmark's w4a16-mma row would otherwise report Triton numbers unnoticed)."""
    import logging

    from helpers import random_canonical
    from lqe.kernels import gemm, triton_wna16

    monkeypatch.setenv("LQE_WNA16_TABLE", "mma")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(gemm, "_state", {"error": "nvcc failed (simulated)"})
    monkeypatch.setattr(triton_wna16, "unavailable_reason", lambda d: None)
    monkeypatch.setattr(gemm, "_to_device", lambda cw, d: cw)
    monkeypatch.setattr(gemm, "_MMA_DECLINED", set())
    cw = random_canonical(256, 128, 4, 128, True, False, seed=0)
    with caplog.at_level(logging.WARNING, logger=gemm.log.name):
        for _ in range(2):
            kernel, desc = gemm.select_w4a16_kernel(cw, "cuda", torch.bfloat16)
            assert desc.startswith("lqe-wna16 (") and "triton-wna16" in desc
    warned = [r.getMessage() for r in caplog.records if "lqe-w4a16-mma" in r.getMessage()]
    assert len(warned) == 1 and "nvcc failed (simulated)" in warned[0], warned


def test_repack_out_of_memory_and_a_bad_table_are_raised(monkeypatch):
    """The quant layer's kernel choice falls back to the torch paths on a broken build, but not when the GPU ran out
    of memory while repacking (the fallback holds the codes in twice the memory) or LQE_WNA16_TABLE is wrong."""
    import lqe.kernels as kernels
    from helpers import random_canonical
    from lqe.quant_layers import wna16_kernels

    cw = random_canonical(256, 128, 4, 128, True, False, seed=0)

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(kernels, "select_w4a16_kernel", oom)
    with pytest.raises(torch.OutOfMemoryError):
        wna16_kernels._external(cw, torch.device("cuda"), torch.bfloat16)
    monkeypatch.setattr(kernels, "select_w4a16_kernel", lambda *a: (_ for _ in ()).throw(RuntimeError("broken build")))
    assert wna16_kernels._external(cw, torch.device("cuda"), torch.bfloat16) == (
        None, "lqe-wna16 failed: RuntimeError: broken build")
    monkeypatch.setenv("LQE_WNA16_TABLE", "marlin")
    with pytest.raises(ValueError, match="LQE_WNA16_TABLE"):
        wna16_kernels._external(cw, torch.device("cuda"), torch.bfloat16)


def test_mma_workspace_grows_and_keeps_what_graphs_captured_earlier_address():
    """The fp32 workspace and zeroed locks are one buffer per device, grown by reserve_workspace at load; a buffer a
    larger layer replaces stays alive (a graph captured for an earlier model still reads and writes it)."""
    from lqe.kernels import gemm_mma

    dev = torch.device("cpu", 7)  # a key of its own (CPU tensors: no capture, the bookkeeping is the same)
    first = gemm_mma.reserve_workspace(dev, 256, 128, sms=4)  # 1 tile x 2 k-tiles on 4 blocks: 1 slot
    assert first[0].numel() == 64 * 256 and first[1].numel() == 1 and not first[1].any()
    assert gemm_mma.reserve_workspace(dev, 256, 128, sms=4)[0] is first[0]  # fits: the same buffers
    grown = gemm_mma.reserve_workspace(dev, 1024, 256, sms=8)  # 4 tiles x 4 k-tiles, 2 per stripe: 1 slot
    assert grown[0].numel() == 64 * 1024 and grown[1].numel() == 4 and not grown[1].any()
    assert any(ws is first[0] and lk is first[1] for ws, lk in gemm_mma._retired)
    assert gemm_mma.reserve_workspace(dev, 512, 128, sms=4)[0] is grown[0]  # a smaller layer reuses the larger buffer
    # the Llama-3-8B o_proj on 132 SMs: 16 tiles x 64 k-tiles, 8 per stripe: 7 pieces above k = 0 per tile
    assert gemm_mma.workspace_elems(dev, 4096, 4096, 132) == 7 * 64 * 4096
    # without k_pad, the bound for any K covers every K
    for k_pad in (64, 4096, 14336, 1 << 17):
        for n_pad, sms in ((256, 132), (4096, 132), (28672, 264)):
            assert gemm_mma.workspace_elems(dev, n_pad, None, sms) >= gemm_mma.workspace_elems(dev, n_pad, k_pad, sms)
