"""GPTQ (AutoGPTQ / GPTQModel) checkpoint tensors <-> :class:`CanonicalWeight` (FORMATS.md §1).

``qweight [K*b/32, N]`` int32 packed along K, ``qzeros [G, N*b/32]`` int32 packed along N, ``scales [G, N]``,
``g_idx [K]``. Zero points: v1 (``"gptq"``) stores ``zero - 1`` and is decoded as ``(stored + 1) & (2^b - 1)``
(the AutoGPTQ order: add, then mask); v2 (``"gptq_v2"``) stores the true zero. Symmetric layers always use
``zero = 2^(b-1)`` whatever qzeros hold (vLLM Marlin semantics, immune to v1/v2 mislabeling).
"""
from __future__ import annotations

import torch

from lqe.kernels.canonical import CanonicalWeight
from lqe.quant_layers.reference.packing import pack_int32, packed_size, unpack_int32

GPTQ_FORMATS = ("gptq", "gptq_v2")


def _check_format(fmt: str) -> None:
    if fmt not in GPTQ_FORMATS:
        raise ValueError(f"unknown GPTQ checkpoint format {fmt!r}; expected one of {GPTQ_FORMATS}")


def num_groups(k: int, group_size: int) -> int:
    """``ceil(K / g)`` (1 for ``group_size == -1``); the last group may be short when g does not divide K."""
    return 1 if group_size == -1 else -(-k // group_size)


def unpack_gptq_qweight(qweight: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """``[K*b/32, N]`` int32 -> ``[K, N]`` uint8 codes."""
    return unpack_int32(qweight, bits, k, dim=0)


def unpack_gptq_qzeros(qzeros: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """``[G, N*b/32]`` int32 -> ``[G, N]`` uint8 *stored* zero fields (before the v1 +1)."""
    return unpack_int32(qzeros, bits, n, dim=1)


def gptq_true_zeros(stored: torch.Tensor, bits: int, fmt: str) -> torch.Tensor:
    """Stored zero fields -> true zero points: v1 ``(stored + 1) & mask``, v2 ``stored``."""
    _check_format(fmt)
    if fmt == "gptq_v2":
        return stored.to(torch.uint8)
    return ((stored.to(torch.int32) + 1) & ((1 << bits) - 1)).to(torch.uint8)


def gptq_sym_stored_zero(bits: int, fmt: str) -> int:
    """The stored zero field a symmetric checkpoint holds: ``2^(b-1) - 1`` (v1) or ``2^(b-1)`` (v2)."""
    _check_format(fmt)
    return (1 << (bits - 1)) - (1 if fmt == "gptq" else 0)


def v1_zero_corruption(stored: torch.Tensor, bits: int) -> torch.Tensor:
    """Bool mask of v1 stored fields equal to ``2^b - 1``: only a true zero of 0 produces it, and AutoGPTQ's
    packer then also overwrote the higher fields of that word (FORMATS.md §1.5 hazards)."""
    return stored.to(torch.int32) == (1 << bits) - 1


def decode_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    sym: bool,
    fmt: str = "gptq",
) -> CanonicalWeight:
    """Decode GPTQ tensors. ``g_idx`` is kept only when it is not the trivial ``k // g``."""
    _check_format(fmt)
    k = qweight.shape[0] * 32 // bits
    n = qweight.shape[1]
    if qweight.shape[0] != packed_size(k, bits):
        raise ValueError(f"qweight has {qweight.shape[0]} rows, not a whole number of {bits}-bit blocks")
    if g_idx is not None:
        k = g_idx.shape[0]  # K need not fill the last packed block
    codes = unpack_gptq_qweight(qweight, bits, k)
    g = num_groups(k, group_size)
    if tuple(scales.shape) != (g, n):
        raise ValueError(f"scales: expected shape {(g, n)} for K={k}, group_size={group_size}, found {tuple(scales.shape)}")
    zeros = None
    if not sym:
        if qzeros is None:
            raise ValueError("asymmetric GPTQ needs qzeros")
        zeros = gptq_true_zeros(unpack_gptq_qzeros(qzeros, bits, n), bits, fmt)
    cw = CanonicalWeight(codes, scales.float(), zeros, None if g_idx is None else g_idx.to(torch.int32), bits, group_size)
    if not cw.has_act_order():
        cw.g_idx = None
    return cw


def encode_gptq(cw: CanonicalWeight, fmt: str = "gptq") -> dict[str, torch.Tensor]:
    """CanonicalWeight -> ``{"qweight", "qzeros", "scales" (fp16), "g_idx"}`` as AutoGPTQ/GPTQModel write them.

    Symmetric weights get the constant qzeros of their format. v1 cannot represent a true zero of 0: that
    raises (AutoGPTQ would silently corrupt the word; use ``fmt="gptq_v2"`` or keep zeros >= 1)."""
    _check_format(fmt)
    k, n = cw.shape
    if cw.zeros is None:
        stored = torch.full(cw.scales.shape, gptq_sym_stored_zero(cw.bits, fmt), dtype=torch.int64)
    else:
        stored = cw.zeros.to(torch.int64)
        if fmt == "gptq":
            if bool((stored == 0).any()):
                raise ValueError("GPTQ v1 ('gptq') stores zero-1 and cannot represent a zero point of 0; "
                                 "export with fmt='gptq_v2' or clamp zeros to >= 1")
            stored = stored - 1
    return {
        "qweight": pack_int32(cw.codes, cw.bits, dim=0),
        "qzeros": pack_int32(stored, cw.bits, dim=1),
        "scales": cw.scales.to(torch.float16),
        "g_idx": cw.group_index().to(torch.int32),
    }
