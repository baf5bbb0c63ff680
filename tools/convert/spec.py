"""What an export writes: format, bits, grouping, zero points, dtypes. Validated against what each format can
store (FORMATS.md §1-§3) before anything is read, in words the user can act on (DESIGN.md rule 6)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("gptq", "gptq_v2", "awq", "w8a8", "w4a16-ct")
FORMAT_BITS = {"gptq": (2, 3, 4, 8), "gptq_v2": (2, 3, 4, 8), "awq": (4,), "w8a8": (8,), "w4a16-ct": (4, 8)}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
          "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class ConvertError(ValueError):
    """A problem with the user's input (model, parameters, options); the message says what to do."""


@dataclass(slots=True)
class ExportSpec:
    fmt: str = "gptq"
    bits: int = 4
    group_size: int = 128  # -1 = one group over K (per output channel)
    sym: bool = True
    desc_act: bool = False
    clamp_zero: bool = False  # v1 only: clamp true zero 0 to 1 (changes those weights) instead of refusing
    quantize_lm_head: bool = False
    scale_dtype: torch.dtype | None = None  # None: fp16 for gptq/awq (what the ecosystem writes), fp32 for CT
    float_dtype: torch.dtype | None = None  # None = keep the source dtype
    max_shard_size: int = 5 * 1024**3
    method: str = "rtn"  # recorded in the config (quantizer provenance)
    damp_percent: float = 0.01
    true_sequential: bool = True
    static_groups: bool = False
    mse: bool = False  # GPTQ: per-group clipping search of the quantization range
    drift_alpha: float = 0.0  # GPTQ: target the float model's outputs (0 = plain GPTQ); see gptq.drift_target

    def resolve_scale_dtype(self) -> torch.dtype:
        if self.scale_dtype is None:
            self.scale_dtype = torch.float32 if self.fmt in ("w8a8", "w4a16-ct") else torch.float16
        return self.scale_dtype

    def validate(self) -> None:
        self.resolve_scale_dtype()
        if self.fmt not in FORMATS:
            raise ConvertError(f"unknown format {self.fmt!r}; choose one of {FORMATS}")
        if self.bits not in FORMAT_BITS[self.fmt]:
            raise ConvertError(f"format {self.fmt!r} stores bits {FORMAT_BITS[self.fmt]}, not bits={self.bits}")
        if not (self.group_size == -1 or self.group_size > 0):
            raise ConvertError(f"group size {self.group_size} must be -1 (one group per output channel) or positive")
        if self.fmt == "w8a8":
            if not self.sym:
                raise ConvertError("w8a8 (compressed-tensors int-quantized) weights must be symmetric; drop --asym")
            if self.group_size != -1:
                raise ConvertError("w8a8 weights are per output channel: use --group-size -1")
            if self.desc_act:
                raise ConvertError("w8a8 has no act-order (g_idx); drop --desc-act")
        if self.fmt == "awq" and self.desc_act:
            raise ConvertError("AWQ checkpoints have no g_idx: act-order (--desc-act) cannot be exported as awq; use gptq")
        if self.clamp_zero and self.fmt != "gptq":
            raise ConvertError("--clamp-zero only applies to the gptq (v1) format")

    def check_layer(self, name: str, n: int, k: int) -> None:
        """Shape constraints of the format for one linear ``[N, K]`` (torch layout)."""
        g = k if self.group_size == -1 else self.group_size
        if self.fmt in ("awq", "w4a16-ct") and k % g:
            raise ConvertError(f"{name}: group size {g} does not divide K={k}; {self.fmt} cannot store a short last "
                               f"group (gptq can: ceil(K/g) groups). Pick a group size dividing {k} or -1.")
        if self.fmt == "awq" and n % 8:
            raise ConvertError(f"{name}: AWQ packs 8 output columns per word; N={n} is not a multiple of 8")
        if self.fmt in ("gptq", "gptq_v2") and self.bits != 3 and n % (32 // self.bits):
            raise ConvertError(f"{name}: GPTQ packs {32 // self.bits} output columns per qzeros word; N={n} is not a multiple")


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB', '1000' -> bytes."""
    if isinstance(text, int):
        return text
    t = text.strip().upper().replace("IB", "B")
    for unit, mult in (("TB", 1024**4), ("GB", 1024**3), ("MB", 1024**2), ("KB", 1024), ("B", 1)):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name in (None, "auto", "source"):
        return None
    if name not in DTYPES:
        raise ConvertError(f"unknown dtype {name!r}; choose fp16, bf16 or fp32")
    return DTYPES[name]
