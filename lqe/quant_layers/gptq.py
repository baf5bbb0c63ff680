"""GPTQ (AutoGPTQ / GPTQModel) checkpoints: ``qweight``, ``qzeros``, ``scales``, ``g_idx`` (FORMATS.md §1).

Zero points: ``sym: true`` ignores the stored qzeros (zero = 2^(b-1)) and warns when they disagree with the
declared format; ``sym: false`` applies the v1 (+1) or v2 rule and warns when v1 zeros show the zero=0
corruption. Act-order is detected from ``g_idx`` itself, not trusted from ``desc_act``.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from lqe.quant_layers import reference as ref
from lqe.quant_layers.base import LinearMethod, QuantConfig, empty_param
from lqe.kernels.canonical import CanonicalWeight
from lqe.quant_layers.checks import config_number
from lqe.quant_layers.gptq_rules import NO_MATCH, SKIP, DynamicRule, dynamic_for_layer, layer_quantized, parse_dynamic
from lqe.quant_layers.loading import FLOAT_DTYPES, add_param, is_loaded, require_loaded
from lqe.quant_layers.weight_only import (QuantWarning, WeightOnlyMethod, check_row_groups, group_label, group_rows,
                                          replicated_groups, shard_canonical, warn)


@dataclass(slots=True)
class GPTQParams:
    bits: int
    group_size: int
    desc_act: bool
    sym: bool
    fmt: str  # "gptq" (v1) or "gptq_v2"

    def validate(self, where: str) -> None:
        if self.bits not in ref.SUPPORTED_BITS:
            raise ValueError(f"{where}: GPTQ bits={self.bits} is not supported; lqe supports bits {ref.SUPPORTED_BITS}")
        if not (self.group_size == -1 or self.group_size > 0):
            raise ValueError(f"{where}: GPTQ group_size={self.group_size} must be -1 (one group) or a positive integer")


class GPTQConfig(QuantConfig):
    name: ClassVar[str] = "gptq"

    def __init__(self, params: GPTQParams, lm_head: bool = False, dynamic: list[DynamicRule] | None = None,
                 modules_in_block_to_quantize: list[list[str]] | None = None) -> None:
        self.params = params
        self.lm_head = lm_head
        self.dynamic = dynamic or []
        self.modules_in_block_to_quantize = modules_in_block_to_quantize

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "GPTQConfig":
        method = str(cfg.get("quant_method", "gptq")).lower()
        if method != "gptq":
            raise ValueError(f"GPTQConfig: quant_method is {method!r}, not 'gptq'")
        fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
        if cfg.get("is_marlin_format") or fmt == "marlin":
            raise ValueError("GPTQ checkpoint_format 'marlin' (legacy Marlin-serialized B/s tensors) is not supported; "
                             "re-export the model in the 'gptq' or 'gptq_v2' format")
        if fmt not in ref.GPTQ_FORMATS:
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported; expected one of {ref.GPTQ_FORMATS}")
        pack_dtype = str(cfg.get("pack_dtype", "int32")).lower().removeprefix("torch.")
        if pack_dtype != "int32":
            raise ValueError(f"GPTQ pack_dtype {pack_dtype!r} is not supported: lqe (like vLLM) reads int32-packed words only")
        if "bits" not in cfg or "group_size" not in cfg:
            raise ValueError("GPTQ quantization_config needs 'bits' and 'group_size'")
        if "sym" not in cfg:
            warnings.warn("GPTQ quantization_config has no 'sym' key; assuming sym=true (AutoGPTQ's default)", QuantWarning, stacklevel=2)
        params = GPTQParams(config_number(cfg["bits"], "bits", "quantization_config"),
                            config_number(cfg["group_size"], "group_size", "quantization_config"),
                            bool(cfg.get("desc_act", False)),
                            bool(cfg.get("sym", True)), fmt)
        params.validate("quantization_config")
        dynamic = parse_dynamic(cfg.get("dynamic"))
        for rule in dynamic:
            replace(params, **rule.overrides).validate(f"quantization_config.dynamic[{rule.pattern.pattern!r}]")
        blocks = cfg.get("modules_in_block_to_quantize")
        return cls(params, bool(cfg.get("lm_head", False)), dynamic, blocks)

    def params_for(self, prefix: str) -> GPTQParams | None:
        if not layer_quantized(prefix, self.lm_head, self.modules_in_block_to_quantize):
            return None
        rule = dynamic_for_layer(self.dynamic, prefix)
        if rule == SKIP:
            return None
        return self.params if rule == NO_MATCH else replace(self.params, **rule)

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        params = self.params_for(prefix)
        return None if params is None else GPTQLinearMethod(params)


class GPTQLinearMethod(WeightOnlyMethod):
    CHECKPOINT_PARAMS = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, params: GPTQParams) -> None:
        super().__init__()
        self.p = params

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype) -> None:
        b, k, n = self.p.bits, input_size, sum(output_sizes)
        block, _ = ref.values_per_block(b)
        where = f"{layer.prefix} ({b}-bit GPTQ)"
        if k % block:
            raise ValueError(f"{where}: input size {k} must be a multiple of {block} to pack qweight along K")
        bad = [s for s in output_sizes if s % block]
        if bad:
            raise ValueError(f"{where}: output sizes {bad} must be multiples of {block} to pack qzeros along N")
        gs = self.p.group_size
        check_row_groups(layer, gs, where, self.p.desc_act)
        g = group_rows(layer, gs)
        # input_dim: the dim a row-parallel shard splits; absent on group parameters replicated over the ranks
        split = {} if replicated_groups(layer, gs) else {"input_dim": 0}
        psize = lambda size: ref.packed_size(size, b)  # noqa: E731
        add_param(layer, "qweight", empty_param((psize(k), n), torch.int32, output_dim=1, packed_dim=0, input_dim=0), (torch.int32,))
        add_param(layer, "qzeros", empty_param((g, psize(n)), torch.int32, output_dim=1, packed_dim=1, pack_factor=32 // b if b != 3 else 1,
                                               **split), (torch.int32,), packed_size=psize)
        layer.qzeros.optional = self.p.sym  # sym ignores stored zeros: exporters may leave them out
        add_param(layer, "scales", empty_param((g, n), torch.float32, output_dim=1, **split), FLOAT_DTYPES)
        # a row-parallel shard keeps global group ids (see shard_canonical)
        add_param(layer, "g_idx", empty_param((k,), torch.int32, input_dim=0), (torch.int32, torch.int64), mode="shared")

    def decode(self, layer: nn.Module) -> tuple[CanonicalWeight, str]:
        p = self.p
        require_loaded(layer, ["qweight", "scales"] + ([] if p.sym else ["qzeros"]))
        k, n = layer.input_size, layer.output_size
        g = ref.num_groups(k, p.group_size)
        g_idx = layer.g_idx.data if is_loaded(layer, "g_idx") else None
        if g_idx is not None and not replicated_groups(layer, p.group_size) and (int(g_idx.min()) < 0 or int(g_idx.max()) >= g):
            raise ValueError(f"tensor {layer.prefix}.g_idx: group ids must lie in [0, {g}) for K={k}, group_size={p.group_size}; "
                             f"found [{int(g_idx.min())}, {int(g_idx.max())}]")
        stored = ref.unpack_gptq_qzeros(layer.qzeros.data, p.bits, n) if is_loaded(layer, "qzeros") else None
        if stored is not None:
            self._check_zeros(layer.prefix, stored)
        zeros = None if p.sym else ref.gptq_true_zeros(stored, p.bits, p.fmt)
        codes = ref.unpack_gptq_qweight(layer.qweight.data, p.bits, k)
        cw = shard_canonical(layer, codes, layer.scales.data, zeros, g_idx, p.bits, p.group_size)
        zp = "sym" if p.sym else f"asym {p.fmt}"
        return cw, f"gptq {p.bits}-bit {group_label(p.group_size)} {zp}"

    def _check_zeros(self, prefix: str, stored: torch.Tensor) -> None:
        p = self.p
        if p.sym:
            expected = ref.gptq_sym_stored_zero(p.bits, p.fmt)
            if bool((stored == expected).all()):
                return
            other = "gptq_v2" if p.fmt == "gptq" else "gptq"
            if bool((stored == ref.gptq_sym_stored_zero(p.bits, other)).all()):
                msg = f"stored qzeros are the {other} symmetric constant although the config says checkpoint_format {p.fmt!r}"
            else:
                msg = f"stored qzeros are not the symmetric constant {expected} of checkpoint_format {p.fmt!r}"
            warn(f"{prefix}: {msg}; ignored because sym=true (zero = {1 << (p.bits - 1)})")
        elif p.fmt == "gptq":
            bad = int(ref.v1_zero_corruption(stored, p.bits).sum())
            if bad:
                warn(
                    f"{prefix}: {bad} stored qzeros fields equal {(1 << p.bits) - 1}, the mark of a true zero point of 0 that "
                    "GPTQ v1 cannot represent; the packer likely corrupted neighbouring zero points in the same word. "
                    "Decoded as zero 0; re-export as gptq_v2 for exact results.")
