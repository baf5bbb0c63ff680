"""Linear layers that delegate their weights and forward to a quant method.

``LinearBase`` covers plain layers (one output shard) and fused ones: ``QKVLinear`` (q, k, v) and
``MergedLinear`` (gate, up). A fused layer loads each HF tensor (``q_proj.qweight`` ...) into its slice of the
fused parameter: the slice is found from the parameter's ``output_dim`` and, when the output dim is also the
packed dim (GPTQ ``qzeros``, AWQ ``qweight``), divided by ``pack_factor``. A method whose parameter does not fit
that rule (a per-shard scalar scale, say) attaches its own ``weight_loader``.

Tensor parallelism (Megatron): ``ColumnParallelLinear``, ``QKVLinear`` and ``MergedLinear`` keep a rank's slice
of the output features, ``RowParallelLinear`` a rank's slice of the input features and all-reduces its output.
Parameters are created with the rank's sizes; :meth:`LinearBase.tp_slice` cuts each checkpoint tensor along the
parameter's ``output_dim`` (column) or ``input_dim`` (row) before the loader sees it, so the quant methods'
loaders are unchanged. With one rank none of this runs.
"""
from __future__ import annotations

import torch
from torch import nn

from lqe.distributed.comm import tp_all_reduce
from lqe.distributed.parallel_state import get_tp_rank, get_tp_size
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
        tp_mode: str | None = None,
        tp_chunks: list[tuple[int, int]] | None = None,
    ) -> None:
        """``input_size`` / ``output_sizes`` are this rank's sizes. ``tp_mode``: ``"column"`` or ``"row"`` when
        tensor-parallel; ``tp_chunks[i]``: (number of chunks, this rank's chunk) of output shard ``i`` in the
        checkpoint (KV heads replicated over ranks have fewer chunks than ranks)."""
        super().__init__()
        self.tp_size = get_tp_size() if tp_mode is not None else 1
        self.tp_rank = get_tp_rank() if self.tp_size > 1 else 0
        self.tp_mode = tp_mode if self.tp_size > 1 else None
        self.tp_chunks = tp_chunks or [(self.tp_size, self.tp_rank)] * len(output_sizes)
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.prefix = prefix
        self.params_dtype = params_dtype
        self.shard_ids = list(shard_ids) if shard_ids is not None else list(range(len(output_sizes)))
        method = quant_config.get_linear_method(self, prefix) if quant_config is not None else None
        self.quant_method: LinearMethod = method if method is not None else UnquantizedLinearMethod()
        if self.tp_mode is not None and not self.quant_method.supports_tensor_parallel:
            raise ValueError(f"{prefix}: {type(self.quant_method).__name__} layers cannot be sharded for "
                             f"tensor_parallel_size={self.tp_size} yet (use tensor_parallel_size=1)")
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

    def tp_slice(self, name: str, param: nn.Parameter, loaded, shard_id: str | int | None):
        """This rank's part of checkpoint tensor ``loaded`` (a tensor, or a lazy safetensors slice that reads
        only that part); ``loaded`` itself for a parameter replicated over the ranks."""
        if self.tp_mode == "column":
            dim = getattr(param, "output_dim", None)
            if dim is None:
                return loaded
            if shard_id is None and len(self.output_sizes) > 1:
                raise ValueError(f"{self.prefix}.{name}: a pre-fused checkpoint tensor cannot be split for tensor "
                                 "parallelism; store the q/k/v (gate/up) projections separately")
            n, idx = self.tp_chunks[self.shard_ids.index(shard_id) if len(self.output_sizes) > 1 else 0]
        else:
            dim = getattr(param, "input_dim", None)
            if dim is None or loaded.shape[dim] == param.shape[dim]:
                return loaded  # replicated along the input (per-channel scales of a one-group layer, a bias)
            n, idx = self.tp_size, self.tp_rank
        full = loaded.shape[dim]
        if full % n:
            raise ValueError(f"tensor {self.prefix}.{name}: dim {dim} of size {full} cannot be split into {n} equal "
                             f"tensor-parallel shards; use a tensor_parallel_size that divides it")
        size = full // n
        return loaded.narrow(dim, idx * size, size)

    def load_weight(self, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None) -> None:
        if self.tp_mode is not None:
            loaded = self.tp_slice(name, param, loaded, shard_id)
        if not isinstance(loaded, torch.Tensor):
            loaded = loaded.materialize()
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
        if self.tp_mode == "row":  # partial sums: reduce, then add the (replicated) bias once
            out = tp_all_reduce(self.quant_method.apply(self, x, None))
            return out if self.bias is None else out + self.bias
        return self.quant_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        tp = f", tp={self.tp_mode} {self.tp_rank}/{self.tp_size}" if self.tp_mode else ""
        return f"in={self.input_size}, out={self.output_sizes}, method={self.quant_method.describe(self)}{tp}"


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
        """``num_heads`` / ``num_kv_heads`` are the model's; the layer keeps this rank's heads."""
        n = get_tp_size()
        if n == 1:
            sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
            super().__init__(hidden_size, sizes, bias, quant_config, prefix, params_dtype, shard_ids=["q", "k", "v"])
            return
        q_heads = _split(num_heads, "num_attention_heads", prefix)
        kv_heads, kv_chunks = kv_heads_per_rank(num_kv_heads, prefix)
        sizes = [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, quant_config, prefix, params_dtype, shard_ids=["q", "k", "v"],
                         tp_mode="column", tp_chunks=[(n, get_tp_rank()), kv_chunks, kv_chunks])


class MergedLinear(LinearBase):
    """Fused gate/up; column-parallel (each output shard split over the ranks) when tensor-parallel."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, quant_config: QuantConfig | None,
                 prefix: str, params_dtype: torch.dtype) -> None:
        if get_tp_size() > 1:
            output_sizes = [_split(s, "output size", prefix) for s in output_sizes]
        super().__init__(input_size, output_sizes, bias, quant_config, prefix, params_dtype, tp_mode="column")


def _split(total: int, what: str, prefix: str) -> int:
    n = get_tp_size()
    if total % n:
        raise ValueError(f"{prefix}: {what}={total} is not divisible by tensor_parallel_size={n}")
    return total // n


class ColumnParallelLinear(LinearBase):
    """Output features split over the ranks; each rank's output is its slice (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, quant_config: QuantConfig | None,
                 prefix: str, params_dtype: torch.dtype) -> None:
        super().__init__(input_size, [_split(output_size, "output size", prefix)], bias, quant_config, prefix,
                         params_dtype, tp_mode="column")


class RowParallelLinear(LinearBase):
    """Input features split over the ranks; the partial outputs are summed with one all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool, quant_config: QuantConfig | None,
                 prefix: str, params_dtype: torch.dtype) -> None:
        super().__init__(_split(input_size, "input size", prefix), [output_size], bias, quant_config, prefix,
                         params_dtype, tp_mode="row")


def kv_heads_per_rank(num_kv_heads: int, prefix: str = "attention") -> tuple[int, tuple[int, int]]:
    """(KV heads this rank holds, (chunks of the checkpoint's K/V, this rank's chunk)): split when the ranks
    divide the heads, replicated (one head per rank, shared by N / heads ranks) when there are fewer heads."""
    n, r = get_tp_size(), get_tp_rank()
    if num_kv_heads % n == 0:
        return num_kv_heads // n, (n, r)
    if n % num_kv_heads == 0:
        return 1, (num_kv_heads, r // (n // num_kv_heads))
    raise ValueError(f"{prefix}: num_key_value_heads={num_kv_heads} and tensor_parallel_size={n} do not divide one "
                     "another, so the KV heads cannot be split or replicated evenly")
