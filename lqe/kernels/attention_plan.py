"""Host-side planning of the split-K decode attention launch (no triton import: the engine plans CUDA-graph
buckets with it on any machine)."""
from __future__ import annotations

import math

import torch

from lqe.kernels.device_info import sm_count

def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                      min_tokens_per_split: int = 256, max_splits: int = 32) -> int:
    """Split long contexts until the grid covers the GPU about twice; never below ``min_tokens_per_split``."""
    by_len = max(1, math.ceil(max_seq_len / min_tokens_per_split))
    by_occupancy = max(1, math.ceil(2 * sm_count(device, cpu_default=16) / max(1, num_seqs * num_kv_heads)))
    return int(min(by_len, by_occupancy, max_splits))
