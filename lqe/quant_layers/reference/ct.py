"""compressed-tensors tensors (FORMATS.md §3): ``pack-quantized`` <-> CanonicalWeight, and the
``int-quantized`` / ``float-quantized`` (int8 / fp8 e4m3) weights.

pack-quantized stores *signed* ints offset to unsigned (``u = q + 2^(b-1)``) in the torch orientation
``[N, K]``, packed along K (``weight_packed [N, ceil(K/pf)]``); zero points get the same offset and are packed
along N (``weight_zero_point [ceil(N/pf), G]``); ``weight_shape = [N, K]`` cuts the padding. For 4/8 bits
``weight_packed`` is bit-for-bit the transpose of a GPTQ qweight and the unsigned zero is the v2 zero.
"""
from __future__ import annotations

import torch

from lqe.kernels.canonical import CanonicalWeight
from lqe.quant_layers.reference.packing import pack_int32, unpack_int32

FP8_E4M3_MAX = 448.0


def pack_to_int32(values: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """Signed ints in ``[-2^(b-1), 2^(b-1))`` -> offset to unsigned -> int32 words along ``dim``."""
    return pack_int32(values.to(torch.int64) + (1 << (bits - 1)), bits, dim=dim)


def unpack_from_int32(words: torch.Tensor, bits: int, size: int, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`pack_to_int32`: ``size`` signed int8 values along ``dim``."""
    return (unpack_int32(words, bits, size, dim=dim).to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


def decode_ct_packed(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: tuple[int, int] | torch.Tensor,
    bits: int,
    group_size: int,
    weight_zero_point: torch.Tensor | None = None,
    weight_g_idx: torch.Tensor | None = None,
) -> CanonicalWeight:
    """pack-quantized tensors -> CanonicalWeight (codes ``[K, N]`` unsigned, i.e. the GPTQ orientation)."""
    n, k = (int(v) for v in weight_shape)
    off = 1 << (bits - 1)
    codes = (unpack_from_int32(weight_packed, bits, k, dim=1).to(torch.int16) + off).to(torch.uint8).t().contiguous()
    zeros = None
    if weight_zero_point is not None:
        zeros = (unpack_from_int32(weight_zero_point, bits, n, dim=0).to(torch.int16) + off).to(torch.uint8).t().contiguous()
    cw = CanonicalWeight(codes, weight_scale.float().t().contiguous(), zeros,
                         None if weight_g_idx is None else weight_g_idx.to(torch.int32), bits, group_size)
    if not cw.has_act_order():
        cw.g_idx = None
    return cw


def encode_ct_packed(cw: CanonicalWeight, scale_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """CanonicalWeight -> ``{"weight_packed", "weight_scale", "weight_shape"[, "weight_zero_point", "weight_g_idx"]}``."""
    k, n = cw.shape
    off = 1 << (cw.bits - 1)
    out = {
        "weight_packed": pack_to_int32(cw.codes.t().to(torch.int64) - off, cw.bits, dim=1),
        "weight_scale": cw.scales.t().contiguous().to(scale_dtype),
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if cw.zeros is not None:
        out["weight_zero_point"] = pack_to_int32(cw.zeros.t().to(torch.int64) - off, cw.bits, dim=0)
    if cw.g_idx is not None:
        out["weight_g_idx"] = cw.g_idx.to(torch.int32)
    return out


def expand_scale(scale: torch.Tensor, n: int, k: int, block: tuple[int, int] | None = None) -> torch.Tensor:
    """Per-tensor ``[1]``/``[]``, per-channel ``[N]``/``[N, 1]``, or blockwise scales -> a full ``[N, K]`` float32
    tensor. Blockwise needs ``block = (rows, cols)`` covered by one scale: ``(1, g)`` for group scales ``[N, G]``,
    ``(128, 128)`` for fp8 block scales ``[ceil(N/128), ceil(K/128)]`` (edge blocks are short)."""
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(n, k)
    if s.dim() == 1 and s.shape[0] == n:
        s = s.unsqueeze(1)
    if s.dim() == 2 and tuple(s.shape) == (n, 1):
        return s.expand(n, k)
    if block is None or s.dim() != 2:
        raise ValueError(f"weight_scale: cannot expand shape {tuple(scale.shape)} to weight [{n}, {k}] without a block size")
    bh, bw = block
    if tuple(s.shape) != (-(-n // bh), -(-k // bw)):
        raise ValueError(f"weight_scale: expected shape {(-(-n // bh), -(-k // bw))} for blocks {block} of [{n}, {k}], found {tuple(s.shape)}")
    return s.repeat_interleave(bh, 0)[:n].repeat_interleave(bw, 1)[:, :k]


def dequant_ct_int(weight: torch.Tensor, weight_scale: torch.Tensor, weight_zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """int-quantized int8 ``[N, K]`` -> float32 ``W_torch = (q - zp) * scale``."""
    n, k = weight.shape
    q = weight.float()
    if weight_zero_point is not None:
        q = q - expand_scale(weight_zero_point.float(), n, k)
    return q * expand_scale(weight_scale, n, k)


def dequant_fp8(weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """float-quantized e4m3 ``[N, K]`` -> float32 ``float(weight) * scale`` (tensor, channel, or ``block`` scales)."""
    n, k = weight.shape
    return weight.float() * expand_scale(weight_scale, n, k, block)


def quantize_int8_per_channel(weight: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel, compressed-tensors math (``scale = absmax / 127.5``); ``absmax [N, 1]``
    overrides the rows' own (a tensor-parallel shard of K uses its whole row's).

    Returns ``(int8 [N, K], float32 scale [N, 1])``."""
    absmax = weight.float().abs().amax(dim=1, keepdim=True) if absmax is None else absmax.float()
    scale = torch.where(absmax > 0, absmax / 127.5, torch.ones_like(absmax))
    q = torch.round(weight.float() / scale).clamp(-128, 127).to(torch.int8)
    return q, scale


def quantize_fp8(weight: torch.Tensor, per_channel: bool = True,
                 absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 with ``scale = absmax / 448`` per channel (``[N, 1]``) or per tensor (``[1]``); ``absmax``
    overrides the weight's own (a tensor-parallel shard of K uses its whole rows')."""
    w = weight.float()
    if absmax is None:
        absmax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    absmax = absmax.float()
    scale = torch.where(absmax > 0, absmax / FP8_E4M3_MAX, torch.ones_like(absmax))
    s = scale if per_channel else scale.reshape(1, 1)
    q = (w / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale
