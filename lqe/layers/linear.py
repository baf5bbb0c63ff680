"""Linear layers that delegate their weights and forward to a quant method.

``LinearBase`` covers plain layers (one output shard) and fused ones: ``QKVLinear`` (q, k, v) and
``MergedLinear`` (gate, up). A fused layer loads each HF tensor (``q_proj.qweight`` ...) into its slice of the
fused parameter: the slice is found from the parameter's ``output_dim`` and, when the output dim is also the
packed dim (GPTQ ``qzeros``, AWQ ``qweight``), divided by ``pack_factor``. A method whose parameter does not fit
that rule (a per-shard scalar scale, say) attaches its own ``weight_loader``.
"""
from __future__ import annotations

import torch
from torch import nn

from lqe.quant_layers.base import LinearMethod, QuantConfig, empty_param
from lqe.quant_layers.unquantized import UnquantizedLinearMethod


class LinearBase(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        quant_config: QuantConfig | None,
        prefix: str,
        params_dtype: torch.dtype,
        shard_ids: list[str | int] | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.prefix = prefix
        self.params_dtype = params_dtype
        self.shard_ids = list(shard_ids) if shard_ids is not None else list(range(len(output_sizes)))
        method = quant_config.get_linear_method(self, prefix) if quant_config is not None else None
        self.quant_method: LinearMethod = method if method is not None else UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size, self.output_sizes, params_dtype)
        if bias:
            self.register_parameter("bias", empty_param((self.output_size,), params_dtype, output_dim=0))
        else:
            self.bias = None

    def shard_slice(self, shard_id: str | int | None) -> tuple[int, int]:
        """(offset, size) in output features of a fused shard; the whole output for ``None``."""
        if shard_id is None:
            return 0, self.output_size
        if shard_id not in self.shard_ids:
            raise KeyError(f"{self.prefix}: unknown shard {shard_id!r}; this layer has shards {self.shard_ids}")
        i = self.shard_ids.index(shard_id)
        return sum(self.output_sizes[:i]), self.output_sizes[i]

    def load_weight(self, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, loaded, shard_id)
            return
        target = param.data
        output_dim = getattr(param, "output_dim", None)
        if shard_id is not None and len(self.output_sizes) > 1:
            if output_dim is None:
                raise ValueError(f"{self.prefix}.{name}: parameter is not split along the output; cannot load shard {shard_id!r}")
            offset, size = self.shard_slice(shard_id)
            if getattr(param, "packed_dim", None) == output_dim:
                factor = param.pack_factor
                offset, size = offset // factor, size // factor
            target = target.narrow(output_dim, offset, size)
        copy_checked(f"{self.prefix}.{name}" + (f" (shard {shard_id})" if shard_id is not None else ""), target, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, method={self.quant_method.describe(self)}"


def copy_checked(name: str, target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into a parameter, refusing shape mismatches and lossy dtype changes."""
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(
            f"tensor {name}: expected shape {tuple(target.shape)}, found {tuple(loaded.shape)} in the checkpoint. "
            "The checkpoint does not match its config (wrong group size, bits or model shape?)."
        )
    if target.is_floating_point() != loaded.is_floating_point():
        raise ValueError(
            f"tensor {name}: expected dtype {target.dtype}, found {loaded.dtype} in the checkpoint "
            "(a quantized tensor where a float one belongs, or the reverse: is the quantization config right?)"
        )
    target.copy_(loaded)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool, quant_config: QuantConfig | None,
                 prefix: str, params_dtype: torch.dtype) -> None:
        super().__init__(input_size, [output_size], bias, quant_config, prefix, params_dtype)


class QKVLinear(LinearBase):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 quant_config: QuantConfig | None, prefix: str, params_dtype: torch.dtype) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, quant_config, prefix, params_dtype, shard_ids=["q", "k", "v"])


class MergedLinear(LinearBase):
    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, quant_config: QuantConfig | None,
                 prefix: str, params_dtype: torch.dtype) -> None:
        super().__init__(input_size, output_sizes, bias, quant_config, prefix, params_dtype)
