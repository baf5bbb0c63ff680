"""compressed-tensors ``config_groups`` entries parsed into schemes and classified into the method that runs
them (FORMATS.md §3.1, §3.6). Unsupported combinations fail when the config is read, naming the group."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")


@dataclass(slots=True)
class QArgs:
    num_bits: int = 8
    type: str = "int"
    symmetric: bool = True
    group_size: int | None = None
    strategy: str | None = None
    dynamic: bool = False
    actorder: str | None = None
    block_structure: list[int] | None = None

    @classmethod
    def parse(cls, d: dict[str, Any] | None) -> "QArgs | None":
        if d is None:
            return None
        actorder = d.get("actorder")
        actorder = "group" if actorder is True else (str(actorder).lower() if actorder else None)
        q = cls(int(d.get("num_bits", 8)), str(d.get("type", "int")).lower(), bool(d.get("symmetric", True)),
                d.get("group_size"), (str(d["strategy"]).lower() if d.get("strategy") else None),
                d.get("dynamic", False) not in (False, None), actorder, d.get("block_structure"))
        if q.strategy is None:  # compressed-tensors infers the strategy when it is absent
            q.strategy = "group" if q.group_size else ("block" if q.block_structure else "tensor")
        return q


@dataclass(slots=True)
class CTScheme:
    group: str
    targets: list[str]
    weights: QArgs
    input_activations: QArgs | None
    format: str
    kind: str = ""  # "wna16" | "w8a8_int8" | "fp8"
    dtype_hint: str = field(default="")

    @property
    def group_size(self) -> int:
        """Weight group size in canonical terms (-1 = per channel)."""
        return int(self.weights.group_size) if self.weights.strategy == "group" else -1


def infer_format(weights: QArgs, acts: QArgs | None) -> str:
    """compressed-tensors' automatic choice (config/format.py) when no format is written."""
    if weights.type == "float":
        return "float-quantized"
    if acts is None and weights.num_bits in (4, 8):
        return "pack-quantized"
    return "int-quantized"


def classify(scheme: CTScheme) -> str:
    """Pick the method for a scheme or raise ``ValueError`` saying which key is unsupported."""
    w, a, fmt, where = scheme.weights, scheme.input_activations, scheme.format, f"compressed-tensors config group {scheme.group!r}"
    if fmt not in SUPPORTED_FORMATS:
        raise ValueError(f"{where}: format {fmt!r} is not supported; lqe reads {SUPPORTED_FORMATS}")
    if w.type == "float":
        if w.num_bits != 8 or fmt not in ("float-quantized", "naive-quantized"):
            raise ValueError(f"{where}: float weights must be 8-bit (e4m3) in float-quantized format, got {w.num_bits} bits, {fmt!r}")
        if w.strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"{where}: fp8 weight strategy {w.strategy!r} is not supported (tensor, channel, block)")
        return "fp8"
    if w.type != "int":
        raise ValueError(f"{where}: weight type {w.type!r} is not supported")
    if fmt == "pack-quantized":
        if w.num_bits not in (4, 8):
            raise ValueError(f"{where}: pack-quantized weights must be 4 or 8 bits, got {w.num_bits}")
        if w.strategy not in ("group", "channel"):
            raise ValueError(f"{where}: pack-quantized strategy {w.strategy!r} is not supported (group, channel)")
        if a is not None:
            raise ValueError(f"{where}: pack-quantized with quantized input activations (e.g. W4A8) is not supported")
        if w.actorder not in (None, "group", "weight", "static", "dynamic"):
            raise ValueError(f"{where}: actorder {w.actorder!r} is not supported")
        return "wna16"
    if w.num_bits != 8 or not w.symmetric or w.strategy not in ("channel", "tensor"):
        raise ValueError(f"{where}: int-quantized weights must be 8-bit symmetric per channel or per tensor "
                         f"(got {w.num_bits} bits, symmetric={w.symmetric}, strategy {w.strategy!r})")
    if a is not None:
        if a.type != "int" or a.num_bits != 8:
            raise ValueError(f"{where}: input activations must be int8, got {a.type} {a.num_bits}-bit")
        if not ((a.dynamic and a.strategy == "token") or (not a.dynamic and a.strategy == "tensor")):
            raise ValueError(f"{where}: input activations must be dynamic per-token or static per-tensor, "
                             f"got strategy {a.strategy!r} dynamic={a.dynamic}")
    return "w8a8_int8"
