"""Bit-exact checks of the reference codecs against the worked examples in FORMATS.md (expected values are
written out here, not computed by the code under test)."""
import pytest
import torch

from lqe.quant_layers import reference as ref
from lqe.kernels.canonical import CanonicalWeight

W = 0x76543210  # 1985229328 as int32


def i32(v: int) -> torch.Tensor:
    return torch.tensor([[v - 2**32 if v >= 2**31 else v]], dtype=torch.int32)


def test_gptq_4bit_worked_example():
    codes = ref.unpack_gptq_qweight(i32(W), 4, 8)
    assert codes.flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    cw = ref.decode_gptq(i32(W), None, torch.tensor([[0.5]]), None, 4, -1, sym=True)
    assert cw.dequantize().flatten().tolist() == [0.5 * (m - 8) for m in range(8)]


def test_gptq_qzeros_word_v1_v2():
    stored = ref.unpack_gptq_qzeros(i32(W), 4, 8)
    assert ref.gptq_true_zeros(stored, 4, "gptq").flatten().tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert ref.gptq_true_zeros(stored, 4, "gptq_v2").flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]


def test_gptq_8bit_worked_example():
    codes = ref.unpack_gptq_qweight(i32(0x80020100), 8, 4)
    assert codes.flatten().tolist() == [0, 1, 2, 128]
    cw = ref.decode_gptq(i32(0x80020100), None, torch.tensor([[2.0]]), None, 8, -1, sym=True)
    assert cw.dequantize().flatten().tolist() == [-256.0, -254.0, -252.0, 0.0]


@pytest.mark.parametrize("bits,v1,v2", [(4, 0x77777777, 0x88888888), (8, 0x7F7F7F7F, 0x80808080), (2, 0x55555555, 0xAAAAAAAA)])
def test_sym_qzeros_constants(bits, v1, v2):
    n = 32 // bits
    cw = CanonicalWeight(torch.zeros(32, n, dtype=torch.uint8), torch.ones(1, n), None, None, bits, -1)
    assert ref.encode_gptq(cw, "gptq")["qzeros"].item() == i32(v1).item()
    assert ref.encode_gptq(cw, "gptq_v2")["qzeros"].item() == i32(v2).item()
    assert i32(0x88888888).item() == -2004318072 and i32(0x77777777).item() == 2004318071


def test_3bit_layout_matches_spec():
    vals = torch.arange(32).view(32, 1) % 8  # values 0..7 repeating
    words = [w & 0xFFFFFFFF for w in ref.pack_int32(vals, 3, dim=0).flatten().tolist()]
    v = vals.flatten().tolist()
    w0 = sum(v[t] << (3 * t) for t in range(10)) | ((v[10] & 3) << 30)
    w1 = (v[10] >> 2) | sum(v[t] << (3 * (t - 11) + 1) for t in range(11, 21)) | ((v[21] & 1) << 31)
    w2 = (v[21] >> 1) | sum(v[t] << (3 * (t - 22) + 2) for t in range(22, 32))
    assert words == [w0, w1, w2]
    assert ref.unpack_int32(ref.pack_int32(vals, 3, 0), 3, 32, 0).flatten().tolist() == v


def test_v1_zero0_corruption_autogptq_numpy():
    # true zeros [3,0,5,9,1,2,4,6] packed by AutoGPTQ's numpy packer -> 0xFFFFFFF2 -> decodes [3,0,0,...]
    stored = ref.unpack_gptq_qzeros(i32(0xFFFFFFF2), 4, 8)
    assert ref.gptq_true_zeros(stored, 4, "gptq").flatten().tolist() == [3, 0, 0, 0, 0, 0, 0, 0]
    assert ref.v1_zero_corruption(stored, 4).flatten().tolist() == [False] + [True] * 7


def test_v1_zero0_gptqmodel_borrow():
    # v2 word 0x64219503 minus 0x11111111 = 0x531083F2: the borrow makes the neighbour off by one
    assert (0x64219503 - 0x11111111) & 0xFFFFFFFF == 0x531083F2
    v2 = ref.gptq_true_zeros(ref.unpack_gptq_qzeros(i32(0x64219503), 4, 8), 4, "gptq_v2")
    assert v2.flatten().tolist() == [3, 0, 5, 9, 1, 2, 4, 6]
    v1 = ref.gptq_true_zeros(ref.unpack_gptq_qzeros(i32(0x531083F2), 4, 8), 4, "gptq")
    assert v1.flatten().tolist() == [3, 0, 4, 9, 1, 2, 4, 6]


def test_v1_encode_refuses_zero0():
    cw = CanonicalWeight(torch.zeros(8, 8, dtype=torch.uint8), torch.ones(1, 8), torch.zeros(1, 8, dtype=torch.uint8), None, 4, -1)
    with pytest.raises(ValueError, match="zero point of 0"):
        ref.encode_gptq(cw, "gptq")
    assert ref.encode_gptq(cw, "gptq_v2")["qzeros"].item() == 0


def test_awq_interleave():
    assert ref.unpack_awq(i32(W)).flatten().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert ref.pack_awq(torch.arange(8).view(1, 8)).item() == 0x75316420


def test_ct_pack_worked_example_and_offset():
    assert ref.unpack_from_int32(i32(W), 4, 8, dim=1).flatten().tolist() == list(range(-8, 0))
    assert ref.pack_to_int32(torch.arange(-8, 0).view(1, 8), 4, dim=1).item() == W
    # 8-bit: fields hold q + 128
    assert ref.pack_to_int32(torch.tensor([[-128, 0, 1, 127]]), 8, dim=1).item() == i32(0xFF818000).item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
def test_ct_is_gptq_transposed(bits, sym):
    torch.manual_seed(bits)
    cw = ref.rtn_quantize(torch.randn(48, 64), bits, 32, sym)
    g, c = ref.encode_gptq(cw, "gptq_v2"), ref.encode_ct_packed(cw)
    assert torch.equal(g["qweight"].t(), c["weight_packed"])
    assert torch.equal(g["scales"].t(), c["weight_scale"])
    if not sym:  # CT zero points = v2 zeros (packed along N on dim 0 instead of dim 1)
        assert torch.equal(g["qzeros"].t(), c["weight_zero_point"])
    back = ref.decode_ct_packed(c["weight_packed"], c["weight_scale"], c["weight_shape"], bits, 32, c.get("weight_zero_point"))
    assert torch.equal(back.codes, cw.codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_roundtrip(bits, dim):
    torch.manual_seed(bits + dim)
    size = 96 if bits == 3 else 40  # 40 is not a multiple of 16 (2-bit): padded tail
    v = torch.randint(0, 1 << bits, (size, 7) if dim == 0 else (7, size))
    words = ref.pack_int32(v, bits, dim)
    assert words.dtype == torch.int32
    assert torch.equal(ref.unpack_int32(words, bits, size, dim).long(), v)


@pytest.mark.parametrize("bits,sym,fmt", [(2, False, "gptq_v2"), (3, True, "gptq"), (4, False, "gptq"), (8, False, "gptq_v2")])
def test_gptq_codec_roundtrip_act_order(bits, sym, fmt):
    torch.manual_seed(bits)
    k, n, gs = 96, 64, 32
    g_idx = (torch.randperm(k) // gs).to(torch.int32)
    cw = ref.rtn_quantize(torch.randn(n, k), bits, gs, sym, g_idx=g_idx)
    if cw.zeros is not None:
        cw.zeros.clamp_(min=1)
    t = ref.encode_gptq(cw, fmt)
    back = ref.decode_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, gs, sym, fmt)
    assert back.g_idx is not None and torch.equal(back.codes, cw.codes)
    assert torch.allclose(back.dequantize(), cw.dequantize(), rtol=1e-3, atol=1e-3)


def test_rtn_short_last_group():
    w = torch.randn(16, 576)
    cw = ref.rtn_quantize(w, 4, 128, False)
    assert cw.scales.shape == (5, 16) and int(cw.group_index()[-1]) == 4
    assert float((cw.dequantize() - w.t()).abs().max()) <= float(cw.scales.max()) / 2 + 1e-6


def test_fp8_and_int8_dequant():
    w = torch.randn(8, 16)
    q, s = ref.quantize_fp8(w, per_channel=True)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (8, 1)
    assert float((ref.dequant_fp8(q, s) - w).abs().max()) < 0.07 * float(w.abs().max())
    q8, s8 = ref.quantize_int8_per_channel(w)
    assert torch.equal(ref.dequant_ct_int(q8, s8), q8.float() * s8)
    block = ref.expand_scale(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 3, 5, (2, 3))  # blocks of 2x3, short edges
    assert block.tolist() == [[1, 1, 1, 2, 2], [1, 1, 1, 2, 2], [3, 3, 3, 4, 4]]
