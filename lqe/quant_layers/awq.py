"""AWQ (AutoAWQ GEMM layout) checkpoints: ``qweight [K, N/8]``, ``qzeros [G, N/8]`` (interleaved nibbles,
true zeros), ``scales [G, N]`` (FORMATS.md §2). ``zero_point: false`` reads qzeros when present (GPTQModel
fills them with 8) and uses zero 8 otherwise. GEMV checkpoints are refused."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from lqe.quant_layers import reference as ref
from lqe.quant_layers.base import LinearMethod, QuantConfig, empty_param
from lqe.kernels.canonical import CanonicalWeight, build_canonical
from lqe.quant_layers.checks import config_number
from lqe.quant_layers.loading import FLOAT_DTYPES, add_param, is_loaded, require_loaded
from lqe.quant_layers.prefixes import is_lm_head, resolve_shards
from lqe.quant_layers.weight_only import WeightOnlyMethod, check_row_groups, group_label


def _first(cfg: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if key in cfg:
            return cfg[key]
    raise ValueError(f"AWQ quantization_config needs one of the keys {list(keys)}")


class AWQConfig(QuantConfig):
    name: ClassVar[str] = "awq"

    def __init__(self, bits: int, group_size: int, zero_point: bool, modules_to_not_convert: list[str] | None = None,
                 lm_head: bool = False) -> None:
        self.bits = bits
        self.group_size = group_size
        self.zero_point = zero_point
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self.lm_head = lm_head

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "AWQConfig":
        method = str(cfg.get("quant_method", "awq")).lower()
        if method != "awq":
            raise ValueError(f"AWQConfig: quant_method is {method!r}, not 'awq'")
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"AWQ version {version!r} is not supported: only the GEMM layout (qweight [K, N/8] packed along N) is. "
                "GEMV checkpoints store qweight [N, K/8] packed along K with padded scales/zeros, which would load "
                "with wrong shapes (or silently wrong for square layers); re-quantize or convert with version='gemm'.")
        bits = config_number(_first(cfg, "bits", "w_bit"), "bits", "quantization_config")
        if bits != ref.AWQ_BITS:
            raise ValueError(f"AWQ bits={bits} is not supported: the AWQ GEMM layout is 4-bit only")
        group_size = config_number(_first(cfg, "group_size", "q_group_size"), "group_size", "quantization_config")
        if not (group_size == -1 or group_size > 0):
            raise ValueError(f"AWQ group_size={group_size} must be -1 or a positive integer")
        zero_point = bool(cfg.get("zero_point", True))
        return cls(bits, group_size, zero_point, cfg.get("modules_to_not_convert"), bool(cfg.get("lm_head", False)))

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if is_lm_head(prefix) and not self.lm_head:
            return None
        skip = resolve_shards(prefix, lambda n: any(m in n for m in self.modules_to_not_convert), "`modules_to_not_convert` membership")
        return None if skip else AWQLinearMethod(self)


class AWQLinearMethod(WeightOnlyMethod):
    CHECKPOINT_PARAMS = ("qweight", "qzeros", "scales")

    def __init__(self, config: AWQConfig) -> None:
        super().__init__()
        self.cfg = config

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype) -> None:
        bad = [s for s in output_sizes if s % 8]
        if bad:
            raise ValueError(f"{layer.prefix} (AWQ): output sizes {bad} must be multiples of 8 (8 columns per packed word)")
        k, n = input_size, sum(output_sizes)
        g = ref.num_groups(k, self.cfg.group_size)
        check_row_groups(layer, self.cfg.group_size, f"{layer.prefix} (AWQ)", act_order=False)
        psize = lambda size: size // 8  # noqa: E731
        # input_dim: the dim a row-parallel (tensor-parallel) shard splits
        add_param(layer, "qweight", empty_param((k, n // 8), torch.int32, output_dim=1, packed_dim=1, pack_factor=8, input_dim=0),
                  (torch.int32,), packed_size=psize)
        add_param(layer, "qzeros", empty_param((g, n // 8), torch.int32, output_dim=1, packed_dim=1, pack_factor=8, input_dim=0),
                  (torch.int32,), packed_size=psize)
        add_param(layer, "scales", empty_param((g, n), torch.float32, output_dim=1, input_dim=0), FLOAT_DTYPES)

    def decode(self, layer: nn.Module) -> tuple[CanonicalWeight, str]:
        require_loaded(layer, ["qweight", "scales"] + (["qzeros"] if self.cfg.zero_point else []))
        codes = ref.unpack_awq(layer.qweight.data)
        zeros = ref.unpack_awq(layer.qzeros.data) if is_loaded(layer, "qzeros") else None
        cw = build_canonical(codes, layer.scales.data, zeros, None, ref.AWQ_BITS, self.cfg.group_size)
        zp = "zero-point" if zeros is not None else "sym"
        return cw, f"awq 4-bit {group_label(self.cfg.group_size)} {zp}"
