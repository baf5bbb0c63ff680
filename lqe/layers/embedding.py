"""Token embedding. The LM head is an ordinary linear layer (``prefix="lm_head"``), so it can be quantized.

Tensor-parallel: each rank holds the rows of one contiguous vocabulary slice; ids outside it embed to zero and
one all-reduce sums the ranks' rows. The LM head is then column-parallel over the same slices and
:func:`gather_logits` concatenates them (on every rank).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lqe.distributed.comm import tp_all_gather_last, tp_all_reduce
from lqe.distributed.parallel_state import get_tp_rank, get_tp_size


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        if vocab_size % self.tp_size:
            raise ValueError(f"vocab_size={vocab_size} is not divisible by tensor_parallel_size={self.tp_size}")
        rows = vocab_size // self.tp_size
        self.vocab_start, self.vocab_end = self.tp_rank * rows, (self.tp_rank + 1) * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=params_dtype), requires_grad=False)

    def load_weight(self, loaded) -> None:
        """Copy this rank's rows of the checkpoint's ``[vocab, hidden]`` table (a tensor or a lazy slice)."""
        from lqe.layers.linear import copy_checked

        if self.tp_size > 1:
            loaded = loaded.narrow(0, self.vocab_start, self.vocab_end - self.vocab_start)
        if not isinstance(loaded, torch.Tensor):
            loaded = loaded.materialize()
        copy_checked("model.embed_tokens.weight", self.weight.data, loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[:, None], 0)
        return tp_all_reduce(out)


def gather_logits(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from a column-parallel LM head's per-rank slices (identity with one rank)."""
    return tp_all_gather_last(logits)
