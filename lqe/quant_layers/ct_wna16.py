"""compressed-tensors ``pack-quantized`` W4A16 / W8A16: ``weight_packed [N, ceil(K/pf)]``, ``weight_scale
[N, G]``, optional ``weight_zero_point [ceil(N/pf), G]``, ``weight_g_idx [K]``, ``weight_shape [2]``
(FORMATS.md §3.2). Decodes to the same CanonicalWeight (and kernels) as GPTQ."""
from __future__ import annotations

import torch
from torch import nn

from lqe.quant_layers import reference as ref
from lqe.quant_layers.base import empty_param
from lqe.quant_layers.canonical import CanonicalWeight, build_canonical
from lqe.quant_layers.ct_scheme import CTScheme
from lqe.quant_layers.loading import FLOAT_DTYPES, INT_DTYPES, add_param, is_loaded, require_loaded
from lqe.quant_layers.weight_only import WeightOnlyMethod, group_label


class CTWNA16Method(WeightOnlyMethod):
    CHECKPOINT_PARAMS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")

    def __init__(self, scheme: CTScheme) -> None:
        super().__init__()
        self.s = scheme
        self.bits = scheme.weights.num_bits

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype) -> None:
        n, k, b = sum(output_sizes), input_size, self.bits
        g = ref.num_groups(k, self.s.group_size)
        hint = self.s.dtype_hint
        psize = lambda size: ref.packed_size(size, b)  # noqa: E731
        add_param(layer, "weight_packed", empty_param((n, psize(k)), torch.int32, output_dim=0, packed_dim=1), (torch.int32,), hint=hint)
        add_param(layer, "weight_scale", empty_param((n, g), torch.float32, output_dim=0), FLOAT_DTYPES)
        if not self.s.weights.symmetric:
            zp_rows = sum(psize(s) for s in output_sizes)
            add_param(layer, "weight_zero_point", empty_param((zp_rows, g), torch.int32, output_dim=0, packed_dim=0),
                      (torch.int32,), packed_size=psize)
        if self.s.weights.actorder == "group":
            add_param(layer, "weight_g_idx", empty_param((k,), torch.int32), (torch.int32, torch.int64), mode="shared")
        # one [N_shard, K] row per shard; checked against the layer shape after loading
        add_param(layer, "weight_shape", empty_param((len(output_sizes), 2), torch.int64), INT_DTYPES, mode="per_shard")

    def decode(self, layer: nn.Module) -> tuple[CanonicalWeight, str]:
        sym = self.s.weights.symmetric
        require_loaded(layer, ["weight_packed", "weight_scale", "weight_shape"] + ([] if sym else ["weight_zero_point"]))
        k, b = layer.input_size, self.bits
        for (rows, cols), size in zip(layer.weight_shape.data.tolist(), layer.output_sizes):
            if cols != k or rows not in (size, layer.output_size):
                raise ValueError(f"tensor {layer.prefix}.weight_shape: expected [{size}, {k}], found [{rows}, {cols}]")
        codes = (ref.unpack_from_int32(layer.weight_packed.data, b, k, dim=1).to(torch.int16) + (1 << (b - 1)))
        zeros = None
        if not sym:
            parts, row = [], 0
            for size in layer.output_sizes:  # each shard's zero points were padded to whole words separately
                rows = ref.packed_size(size, b)
                parts.append(ref.unpack_from_int32(layer.weight_zero_point.data[row:row + rows], b, size, dim=0))
                row += rows
            zeros = (torch.cat(parts).to(torch.int16) + (1 << (b - 1))).to(torch.uint8).t().contiguous()
        g_idx = layer.weight_g_idx.data if is_loaded(layer, "weight_g_idx") else None
        cw = build_canonical(codes.to(torch.uint8).t().contiguous(), layer.weight_scale.data.t(), zeros, g_idx, b, self.s.group_size)
        return cw, f"compressed-tensors w{b}a16 {group_label(self.s.group_size)} {'sym' if sym else 'asym'}"
