"""AWQ GEMM checkpoint tensors <-> :class:`CanonicalWeight` (FORMATS.md §2).

``qweight [K, N/8]`` and ``qzeros [G, N/8]`` are packed along N with an interleave: field ``i`` (bits
``4i..4i+3``) of word ``c`` holds column ``8c + AWQ_ORDER[i]``. Zero points are stored as-is (no +1).
``zero_point: false`` checkpoints either carry qzeros filled with 8 (GPTQModel) or none (then zero = 8).
"""
from __future__ import annotations

import torch

from lqe.kernels.canonical import CanonicalWeight
from lqe.quant_layers.reference.packing import pack_int32, unpack_int32

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field i holds column AWQ_ORDER[i] of its group of 8
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j sits in field AWQ_REVERSE_ORDER[j]
AWQ_BITS = 4


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """``[R, N]`` 4-bit codes -> ``[R, N/8]`` int32 with the AWQ interleave."""
    r, n = values.shape
    if n % 8:
        raise ValueError(f"AWQ packs 8 columns per word; N={n} is not a multiple of 8")
    order = torch.tensor(AWQ_ORDER)
    interleaved = values.reshape(r, n // 8, 8)[:, :, order].reshape(r, n)
    return pack_int32(interleaved, AWQ_BITS, dim=1)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """``[R, N/8]`` int32 -> ``[R, N]`` uint8 codes (undoes the interleave)."""
    r, c = words.shape
    fields = unpack_int32(words, AWQ_BITS, c * 8, dim=1).reshape(r, c, 8)
    return fields[:, :, torch.tensor(AWQ_REVERSE_ORDER)].reshape(r, c * 8)


def decode_awq(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor, group_size: int) -> CanonicalWeight:
    """Decode AWQ GEMM tensors; ``qzeros=None`` means symmetric (zero = 8)."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    g = 1 if group_size == -1 else -(-k // group_size)
    if tuple(scales.shape) != (g, n):
        raise ValueError(f"scales: expected shape {(g, n)} for K={k}, group_size={group_size}, found {tuple(scales.shape)}")
    codes = unpack_awq(qweight)
    zeros = None if qzeros is None else unpack_awq(qzeros)
    return CanonicalWeight(codes, scales.float(), zeros, None, AWQ_BITS, group_size)


def encode_awq(cw: CanonicalWeight) -> dict[str, torch.Tensor]:
    """CanonicalWeight (4-bit, no act-order) -> ``{"qweight", "qzeros", "scales" (fp16)}``; symmetric weights
    get qzeros filled with 8, as GPTQModel writes them."""
    if cw.bits != AWQ_BITS:
        raise ValueError(f"AWQ GEMM is 4-bit only, got bits={cw.bits}")
    if cw.has_act_order():
        raise ValueError("AWQ has no g_idx: act-order weights cannot be exported as AWQ")
    zeros = cw.zeros if cw.zeros is not None else torch.full(cw.scales.shape, 8, dtype=torch.uint8)
    return {"qweight": pack_awq(cw.codes), "qzeros": pack_awq(zeros), "scales": cw.scales.to(torch.float16)}
