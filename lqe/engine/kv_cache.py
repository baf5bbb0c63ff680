"""The paged KV cache: its bytes, how many blocks a memory budget holds, its allocation, and the fp8 setup.

One tensor ``[layers, 2 (K, V), blocks, block_size, kv_heads, head_dim]`` in the cache's element type (the model's
dtype, or fp8 with ``kv_cache_dtype``). An fp8 cache also holds one float32 k and v scale per layer (from the
checkpoint, else from the first prefill) and, with ``kv_cache_key_rotation``, one key rotation shared by all layers
(:func:`lqe.layers.attention.key_rotation`); both are its fixed overhead, counted before blocks are.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from lqe.config import EngineConfig
from lqe.distributed.comm import tp_min_int
from lqe.layers.attention import Attention, key_rotation

logger = logging.getLogger("lqe")

DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int  # this rank's
    head_dim: int
    dtype: torch.dtype  # the cache's element type: fp8, or the model's dtype
    query_dtype: torch.dtype  # the model's dtype (the query side of the key rotation)
    key_rotation: bool  # kv_cache_key_rotation (fp8 caches only)

    @property
    def fp8(self) -> bool:
        return self.dtype.itemsize == 1

    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers, K and V, at the cache's element size (1 for fp8)."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def fixed_bytes(self) -> int:
        """An fp8 cache's fixed overhead: one float32 k and v scale per layer, and the key rotation's two
        ``[head_dim, head_dim]`` matrices (query dtype and float32) shared by all layers; 0 for a 16-bit cache."""
        if not self.fp8:
            return 0
        d = self.head_dim
        rotation = d * d * (self.query_dtype.itemsize + 4) if self.key_rotation else 0
        return 2 * self.num_layers * 4 + rotation

    def num_blocks(self, config: EngineConfig, device: torch.device, max_model_len: int) -> int:
        """Blocks the budget holds (``num_kv_blocks``; else ``kv_cache_memory_bytes``; else on CUDA the free memory
        up to ``gpu_memory_utilization`` less 1 GiB of headroom, on CPU 1 GiB), the same on every tensor-parallel
        rank. Raises ``MemoryError`` when one request of ``max_model_len`` tokens would not fit."""
        per_block = self.bytes_per_block()
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        else:
            budget = config.kv_cache_memory_bytes
            if not budget and device.type == "cuda":
                torch.cuda.empty_cache()  # load-time temporaries (weight checks, repacks) are free, not used memory
                free, total = torch.cuda.mem_get_info(device)
                budget = int(total * config.gpu_memory_utilization - (total - free) - (1 << 30))
            elif not budget:
                budget = DEFAULT_CPU_KV_BYTES
            num_blocks = max(0, (budget - self.fixed_bytes()) // per_block)
        # slots (block * block_size + offset) travel as int32 in the step buffers and the kernels: at most 2^31
        limit = (2**31 - 1) // self.block_size
        if num_blocks > limit:
            logger.info("KV cache: %d blocks fit the budget; %d used (int32 slot numbers)", num_blocks, limit)
            num_blocks = limit
        num_blocks = tp_min_int(num_blocks)  # identity with one rank
        needed = self.blocks_per_request(max_model_len)
        if num_blocks < needed:
            raise MemoryError(
                f"KV cache too small: {num_blocks} blocks of {self.block_size} tokens fit the budget, but one request of "
                f"max_model_len={max_model_len} tokens needs {needed} blocks ({needed * per_block / 2**20:.1f} MiB). "
                "Raise kv_cache_memory_bytes / gpu_memory_utilization or lower max_model_len.")
        return num_blocks

    def blocks_per_request(self, max_model_len: int) -> int:
        return -(-max_model_len // self.block_size)

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
                           dtype=self.dtype, device=device)


def setup_fp8_layers(model: nn.Module, spec: KVCacheSpec, device: torch.device) -> list[Attention]:
    """Give every attention layer of an fp8 cache the shared key rotation (unless ``key_rotation`` is off or no
    Hadamard matrix of order ``head_dim`` is known); return the layers without checkpoint scales, whose scales the
    first prefill computes (``[]`` for a 16-bit cache)."""
    if not spec.fp8:
        return []
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    calibrate = [m for m in layers if m.kv_scales_loaded != {"k_scale", "v_scale"}]
    rotation = key_rotation(spec.head_dim, spec.query_dtype, device) if spec.key_rotation else None
    if spec.key_rotation and rotation is None:
        logger.warning("KV cache: no Hadamard matrix of order head_dim=%d is known; keys are stored unrotated",
                       spec.head_dim)
    for m in layers:
        m.set_key_rotation(rotation)
    logger.info("KV cache %s%s: scales from the checkpoint for %d layers, from the first prefill for %d",
                str(spec.dtype).removeprefix("torch."), ", keys rotated" if rotation is not None else "",
                len(layers) - len(calibrate), len(calibrate))
    return calibrate
