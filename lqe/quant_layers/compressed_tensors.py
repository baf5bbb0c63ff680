"""compressed-tensors (llm-compressor) checkpoints: ``config_groups`` with ``targets``, ``ignore``, and per
group a scheme run by :class:`CTWNA16Method` (pack-quantized), :class:`W8A8Int8Method` (int-quantized) or
:class:`FP8Method` (float-quantized) (FORMATS.md §3).

Targets and ignore entries are exact module names, ``re:`` regexes (``re.match``) or, for targets, a module
class name (``"Linear"``: every linear layer). A fused layer's shards must all resolve to one scheme.
"""
from __future__ import annotations

import re
import warnings
from typing import Any, ClassVar

from torch import nn

from lqe.quant_layers.base import LinearMethod, QuantConfig
from lqe.quant_layers.ct_scheme import CTScheme, QArgs, classify, infer_format
from lqe.quant_layers.ct_wna16 import CTWNA16Method
from lqe.quant_layers.fp8 import FP8Method
from lqe.quant_layers.prefixes import resolve_shards
from lqe.quant_layers.w8a8 import W8A8Int8Method
from lqe.quant_layers.weight_only import QuantWarning

METHODS = {"wna16": CTWNA16Method, "w8a8_int8": W8A8Int8Method, "fp8": FP8Method}
FROZEN_HINT = ("The config says quantization_status 'frozen': such checkpoints may hold fake-quantized float "
               "weights; load them unquantized (quantization=None) or compress them with llm-compressor.")


def _match(name: str, target: str, allow_class: bool) -> int:
    """Match priority of ``target`` for module ``name``: 3 exact, 2 regex, 1 class name, 0 none."""
    if target.startswith("re:"):
        return 2 if re.match(target[3:], name) else 0
    if target == name:
        return 3
    if allow_class and "." not in target and "linear" in target.lower():
        return 1
    return 0


class CompressedTensorsConfig(QuantConfig):
    name: ClassVar[str] = "compressed-tensors"

    def __init__(self, schemes: list[CTScheme], ignore: list[str], status: str) -> None:
        self.schemes = schemes
        self.ignore = ignore
        self.status = status

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "CompressedTensorsConfig":
        method = str(cfg.get("quant_method", "compressed-tensors")).lower()
        if method != "compressed-tensors":
            raise ValueError(f"CompressedTensorsConfig: quant_method is {method!r}, not 'compressed-tensors'")
        status = str(cfg.get("quantization_status", "compressed")).lower()
        if status == "frozen":
            warnings.warn("compressed-tensors quantization_status is 'frozen' (not 'compressed'): loading as compressed; "
                          "tensors with float dtypes where quantized ones belong will be refused.", QuantWarning, stacklevel=2)
        elif status != "compressed":
            raise ValueError(f"compressed-tensors quantization_status {status!r} is not loadable: lqe needs 'compressed' "
                             "checkpoints (finish the llm-compressor run and save with save_compressed=True)")
        sparsity = cfg.get("sparsity_config") or {}
        if sparsity and str(sparsity.get("format", "dense")).lower() != "dense":
            raise ValueError(f"compressed-tensors sparsity format {sparsity.get('format')!r} is not supported")
        top = str(cfg["format"]).lower() if cfg.get("format") else None
        groups = cfg.get("config_groups") or {}
        if not groups and not cfg.get("kv_cache_scheme"):  # a KV-cache-only checkpoint has no groups
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        schemes = []
        for gname, g in groups.items():
            weights = QArgs.parse(g.get("weights"))
            if weights is None:
                raise ValueError(f"compressed-tensors config group {gname!r} has no weights section (activation-only "
                                 "quantization is not supported)")
            acts = QArgs.parse(g.get("input_activations"))
            fmt = str(g.get("format") or "").lower() or (top if top not in (None, "mixed-precision") else infer_format(weights, acts))
            scheme = CTScheme(gname, list(g.get("targets") or []), weights, acts, fmt)
            scheme.kind = classify(scheme)
            scheme.dtype_hint = FROZEN_HINT if status == "frozen" else ""
            schemes.append(scheme)
        return cls(schemes, list(cfg.get("ignore") or []), status)

    def scheme_for(self, name: str) -> CTScheme | None:
        if any(_match(name, t, allow_class=False) for t in self.ignore):
            return None
        best, best_prio = None, 0
        for scheme in self.schemes:
            prio = max((_match(name, t, allow_class=True) for t in scheme.targets), default=0)
            if prio > best_prio:
                best, best_prio = scheme, prio
        return best

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        group = resolve_shards(prefix, lambda n: getattr(self.scheme_for(n), "group", None), "compressed-tensors schemes")
        if group is None:
            return None
        scheme = next(s for s in self.schemes if s.group == group)
        return METHODS[scheme.kind](scheme)
