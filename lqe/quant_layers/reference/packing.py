"""Bit packing of unsigned codes into signed int32 words (FORMATS.md §0, §1.3).

Element ``j`` of a word lives in bits ``[b*j, b*j + b)`` (element 0 in the least-significant bits). For
``b`` in {2, 4, 8} a word holds ``32/b`` elements. 3-bit packing is the same rule applied to a little-endian
bit stream: 32 consecutive values fill 3 consecutive words, a value may straddle two words (§1.3).
Words are stored as *signed* int32; unpacking masks after an arithmetic shift, which removes the sign
extension. All functions pack/unpack along ``dim`` and leave the other dimension alone.
"""
from __future__ import annotations

import torch

SUPPORTED_BITS = (2, 3, 4, 8)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported; supported bit widths are {SUPPORTED_BITS}")


def values_per_block(bits: int) -> tuple[int, int]:
    """(values, words) of the smallest whole block: (32/b, 1) for b | 32, (32, 3) for 3-bit."""
    _check_bits(bits)
    return (32, 3) if bits == 3 else (32 // bits, 1)


def packed_size(size: int, bits: int) -> int:
    """Number of int32 words along the packed dim for ``size`` values (padding the tail block)."""
    vals, words = values_per_block(bits)
    return -(-size // vals) * words


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> int32 with two's-complement wrap (0xFFFFFFF2 -> -14)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def to_uint32(words: torch.Tensor) -> torch.Tensor:
    """int32 words -> int64 in [0, 2^32) (the unsigned reading of the same bits)."""
    return words.to(torch.int64) & 0xFFFFFFFF


def pack_int32(values: torch.Tensor, bits: int, dim: int = 0) -> torch.Tensor:
    """Pack unsigned codes (any integer dtype, each in [0, 2^bits)) along ``dim`` into int32 words.

    The packed dim is zero-padded to a whole block. 2-D input only."""
    _check_bits(bits)
    if values.dim() != 2:
        raise ValueError(f"pack_int32 expects a 2-D tensor, got shape {tuple(values.shape)}")
    v = values.to(torch.int64)
    if int(v.min()) < 0 or int(v.max()) >= (1 << bits):
        raise ValueError(f"codes must lie in [0, {1 << bits}) for {bits}-bit packing; found [{int(v.min())}, {int(v.max())}]")
    if dim == 1:
        return pack_int32(v.t(), bits, 0).t().contiguous()
    vals, words = values_per_block(bits)
    rows, cols = v.shape
    pad = (-rows) % vals
    if pad:
        v = torch.cat([v, v.new_zeros(pad, cols)])
    if bits == 3:
        # bit stream: value i of a block occupies stream bits [3i, 3i+3); stream bit s is bit s%32 of word s//32
        nb = v.shape[0] // vals
        bitplanes = (v.view(nb, vals, 1, cols) >> torch.arange(3).view(1, 1, 3, 1)) & 1  # [nb, 32, 3, C]
        stream = bitplanes.reshape(nb, words, 32, cols)
        weight = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).view(1, 1, 32, 1)
        return to_int32((stream * weight).sum(2).reshape(nb * words, cols))
    shifts = (torch.arange(vals, dtype=torch.int64) * bits).view(1, vals, 1)
    packed = (v.view(-1, vals, cols) << shifts).sum(1)  # fields do not overlap: sum == OR
    return to_int32(packed)


def unpack_int32(words: torch.Tensor, bits: int, size: int, dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: ``size`` uint8 codes along ``dim`` (the padding is cut)."""
    _check_bits(bits)
    if words.dtype != torch.int32:
        raise ValueError(f"packed words must be int32, found {words.dtype}")
    if words.dim() != 2:
        raise ValueError(f"unpack_int32 expects a 2-D tensor, got shape {tuple(words.shape)}")
    if dim == 1:
        return unpack_int32(words.t(), bits, size, 0).t().contiguous()
    if words.shape[0] != packed_size(size, bits):
        raise ValueError(f"{size} {bits}-bit values need {packed_size(size, bits)} words along the packed dim, found {words.shape[0]}")
    vals, nwords = values_per_block(bits)
    cols = words.shape[1]
    if bits == 3:
        u = to_uint32(words).view(-1, nwords, 1, cols)
        stream = (u >> torch.arange(32, device=words.device).view(1, 1, 32, 1)) & 1  # [nb, 3, 32, C]
        planes = stream.reshape(-1, vals, 3, cols)
        out = (planes << torch.arange(3, device=words.device).view(1, 1, 3, 1)).sum(2)
        return out.reshape(-1, cols)[:size].to(torch.uint8)
    shifts = (torch.arange(vals, dtype=torch.int32, device=words.device) * bits).view(1, vals, 1)
    out = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # arithmetic shift, then mask
    return out.reshape(-1, cols)[:size].to(torch.uint8)
