"""Incremental detokenization that is correct for multi-byte characters and leading spaces.

Each step decodes a short window ending at the newest token (starting a few tokens back, so tokenizers that
drop a word's leading space at the start of a decode still get it) and emits only what extends the text
decoded before; while the window ends in an incomplete UTF-8 sequence (U+FFFD), nothing is emitted.
"""
from __future__ import annotations

from lqe.engine.sequence import Sequence

_CONTEXT = 5


def init_offsets(seq: Sequence) -> None:
    seq.read_offset = seq.num_prompt_tokens
    seq.prefix_offset = max(seq.num_prompt_tokens - _CONTEXT, 0)


def decode_new_text(tokenizer, seq: Sequence, flush: bool = False) -> str:
    ids = seq.all_token_ids
    skip = seq.params.skip_special_tokens
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
    if len(full) > len(prefix) and (flush or not full.endswith("\ufffd")):
        new = full[len(prefix):]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        return new
    return ""
