"""compressed-tensors ``pack-quantized`` W4A16 / W8A16: ``weight_packed [N, ceil(K/pf)]``, ``weight_scale
[N, G]``, optional ``weight_zero_point [ceil(N/pf), G]``, ``weight_g_idx [K]``, ``weight_shape [2]``
(FORMATS.md §3.2). Decodes to the same CanonicalWeight (and kernels) as GPTQ."""
from __future__ import annotations

import torch
from torch import nn

from lqe.quant_layers import reference as ref
from lqe.quant_layers.base import empty_param
from lqe.kernels.canonical import CanonicalWeight
from lqe.quant_layers.ct_scheme import CTScheme
from lqe.quant_layers.loading import FLOAT_DTYPES, INT_DTYPES, add_param, is_loaded, require_loaded
from lqe.quant_layers.weight_only import (WeightOnlyMethod, check_row_groups, group_label, group_rows, replicated_groups,
                                          shard_canonical)


class CTWNA16Method(WeightOnlyMethod):
    CHECKPOINT_PARAMS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")

    def __init__(self, scheme: CTScheme) -> None:
        super().__init__()
        self.s = scheme
        self.bits = scheme.weights.num_bits

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], params_dtype: torch.dtype) -> None:
        n, k, b, gs = sum(output_sizes), input_size, self.bits, self.s.group_size
        where = f"{layer.prefix} (compressed-tensors w{b}a16)"
        if getattr(layer, "tp_mode", None) == "row" and k % (32 // b):
            raise ValueError(f"{where}: tensor_parallel_size={layer.tp_size} splits K={k * layer.tp_size} into shards of {k} "
                             f"rows, not whole {32 // b}-value words of weight_packed; use a tensor_parallel_size that keeps "
                             f"K / N a multiple of {32 // b}")
        check_row_groups(layer, gs, where, self.s.weights.actorder == "group")
        g = group_rows(layer, gs)
        # input_dim: the dim a row-parallel shard splits; absent on group parameters replicated over the ranks
        split = {} if replicated_groups(layer, gs) else {"input_dim": 1}
        hint = self.s.dtype_hint
        psize = lambda size: ref.packed_size(size, b)  # noqa: E731
        add_param(layer, "weight_packed", empty_param((n, psize(k)), torch.int32, output_dim=0, packed_dim=1, input_dim=1),
                  (torch.int32,), hint=hint)
        add_param(layer, "weight_scale", empty_param((n, g), torch.float32, output_dim=0, **split), FLOAT_DTYPES)
        if not self.s.weights.symmetric:
            zp_rows = sum(psize(s) for s in output_sizes)
            add_param(layer, "weight_zero_point", empty_param((zp_rows, g), torch.int32, output_dim=0, packed_dim=0, **split),
                      (torch.int32,), packed_size=psize)
        if self.s.weights.actorder == "group":
            add_param(layer, "weight_g_idx", empty_param((k,), torch.int32, input_dim=0), (torch.int32, torch.int64), mode="shared")
        # one [N_shard, K] row per shard (the checkpoint's whole shape, also under tensor parallelism); checked after loading
        add_param(layer, "weight_shape", empty_param((len(output_sizes), 2), torch.int64), INT_DTYPES, mode="per_shard")

    def decode(self, layer: nn.Module) -> tuple[CanonicalWeight, str]:
        sym = self.s.weights.symmetric
        require_loaded(layer, ["weight_packed", "weight_scale", "weight_shape"] + ([] if sym else ["weight_zero_point"]))
        k, b = layer.input_size, self.bits
        full_k = k * layer.tp_size if layer.tp_mode == "row" else k
        for (rows, cols), size, (chunks, _) in zip(layer.weight_shape.data.tolist(), layer.output_sizes, layer.tp_chunks):
            full = size * chunks if layer.tp_mode == "column" else size
            if cols != full_k or rows not in (full, layer.output_size):
                raise ValueError(f"tensor {layer.prefix}.weight_shape: expected [{full}, {full_k}], found [{rows}, {cols}]")
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
        cw = shard_canonical(layer, codes.to(torch.uint8).t().contiguous(), layer.weight_scale.data.t(), zeros, g_idx, b,
                             self.s.group_size)
        return cw, f"compressed-tensors w{b}a16 {group_label(self.s.group_size)} {'sym' if sym else 'asym'}"
