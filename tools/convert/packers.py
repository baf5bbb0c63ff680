"""Per-layer packer: a CanonicalWeight (+ optional bias) -> the tensors a format stores for that linear.

All bit layouts come from ``lqe.quant_layers.reference`` (DESIGN.md rule 5); this file only chooses the encoder,
casts scales to the requested dtype and applies the v1 zero-point policy.
"""
from __future__ import annotations

import torch

from lqe.quant_layers import reference as ref
from lqe.kernels.canonical import CanonicalWeight
from tools.convert.spec import ConvertError, ExportSpec


class ZeroPointError(ConvertError):
    """GPTQ v1 cannot store a true zero point of 0."""


def v1_zero_layers(cw: CanonicalWeight) -> int:
    """How many (group, channel) zero points are 0 (unrepresentable in GPTQ v1)."""
    return 0 if cw.zeros is None else int((cw.zeros == 0).sum())


def clamp_zero_to_one(cw: CanonicalWeight) -> None:
    """v1 policy of TGI / auto-round: zero 0 -> 1, codes of the affected rows shifted by +1 where possible (the
    weights of those groups move by one scale step wherever a code was already 2^b - 1)."""
    if cw.zeros is None:
        return
    hit = cw.zeros == 0
    if not bool(hit.any()):
        return
    gi = cw.group_index()
    maxq = (1 << cw.bits) - 1
    shift = hit.to(torch.int16)[gi]
    cw.codes = (cw.codes.to(torch.int16) + shift).clamp(0, maxq).to(torch.uint8)
    cw.zeros = torch.where(hit, torch.ones_like(cw.zeros), cw.zeros)


def pack_layer(name: str, cw: CanonicalWeight, spec: ExportSpec, bias: torch.Tensor | None = None,
               float_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """``{leaf name: tensor}`` for the layer ``name`` in ``spec.fmt`` (no prefix on the keys)."""
    k, n = cw.shape
    spec.check_layer(name, n, k)
    if cw.bits != spec.bits:
        raise ConvertError(f"{name}: quantized with {cw.bits} bits but the export asks for {spec.bits}")
    fmt = spec.fmt
    if fmt in ("gptq", "gptq_v2"):
        if fmt == "gptq" and v1_zero_layers(cw):
            if not spec.clamp_zero:
                raise ZeroPointError(
                    f"{name}: {v1_zero_layers(cw)} zero points are 0, which GPTQ v1 ('gptq') cannot store (it stores "
                    "zero-1). Export with --format gptq_v2 (lqe, vLLM >= PR #26092 and GPTQModel load it), or pass "
                    "--clamp-zero to clamp them to 1 (changes those weights).")
            clamp_zero_to_one(cw)
        out = ref.encode_gptq(cw, fmt)
        out["scales"] = cw.scales.to(spec.scale_dtype)
    elif fmt == "awq":
        out = ref.encode_awq(cw)
        out["scales"] = cw.scales.to(spec.scale_dtype)
    elif fmt == "w4a16-ct":
        out = ref.encode_ct_packed(cw, spec.scale_dtype)
    elif fmt == "w8a8":
        if cw.zeros is not None or cw.group_size != -1 or cw.bits != 8:
            raise ConvertError(f"{name}: w8a8 needs symmetric 8-bit per-channel weights")
        q = (cw.codes.to(torch.int16) - 128).t().contiguous().to(torch.int8)  # [N, K] signed
        out = {"weight": q, "weight_scale": cw.scales.t().contiguous().to(spec.scale_dtype)}
    else:
        raise ConvertError(f"unknown format {fmt!r}")
    if bias is not None:
        out["bias"] = bias.to(float_dtype)
    return {key: t.contiguous() for key, t in out.items()}
