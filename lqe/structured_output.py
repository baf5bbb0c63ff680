"""Structured output (JSON schema, JSON object, regex, choice, EBNF grammar) through xgrammar.

One :class:`StructuredOutputs` per engine compiles each request's constraint once (cached by its text) against
the model's tokenizer and keeps one ``xgrammar.GrammarMatcher`` per sequence. Before each sampling step it fills
a packed token bitmask (int32, 32 tokens per word; rows of unconstrained sequences allow everything), which the
sampler applies on the logits' device with ``xgrammar.apply_token_bitmask_inplace``; after the step each matcher accepts its sampled
token. A sequence whose grammar is complete can only emit a stop token (EOS), and finishes then.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import torch

from lqe.sampling_params import StructuredOutputsParams

logger = logging.getLogger("lqe")


def _import_xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured output needs the xgrammar package, which is not installed: `pip install xgrammar`") from None
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of ``choices`` (JSON string escapes are xgrammar's literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        if tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer, and this engine has none")
        self.xgr = _import_xgrammar()
        self.vocab_size = vocab_size
        self.info = self.xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                             stop_token_ids=sorted(stop_token_ids))
        self.compiler = self.xgr.GrammarCompiler(self.info)
        self.cache: dict[tuple[str, str, bool], Any] = {}
        self.matchers: dict[int, Any] = {}  # seq_id -> GrammarMatcher

    def compile(self, p: StructuredOutputsParams):
        kind, value = p.kind()
        text = json.dumps(value, sort_keys=True) if kind == "json" and not isinstance(value, str) else str(value)
        if kind == "choice":
            text = choice_grammar(value)
        key = (kind, text, p.disable_any_whitespace)
        if key not in self.cache:
            try:
                if kind == "json":
                    g = self.compiler.compile_json_schema(text, any_whitespace=not p.disable_any_whitespace)
                elif kind == "json_object":
                    g = self.compiler.compile_builtin_json_grammar()
                elif kind == "regex":
                    g = self.compiler.compile_regex(text)
                else:  # grammar, choice
                    g = self.compiler.compile_grammar(text)
            except Exception as e:  # noqa: BLE001 -- xgrammar raises RuntimeError / its own errors for bad input
                raise ValueError(f"structured output: the {kind} constraint could not be compiled "
                                 f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
            self.cache[key] = g
        return self.cache[key]

    def add(self, seq_id: int, p: StructuredOutputsParams) -> None:
        self.matchers[seq_id] = self.xgr.GrammarMatcher(self.compile(p))

    def remove(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)

    def bitmask(self, seq_ids: list[int]) -> torch.Tensor | None:
        """``[len(seq_ids), ceil(vocab/32)]`` int32 allowed-token bits, or ``None`` when no row is constrained."""
        rows = [(i, self.matchers[s]) for i, s in enumerate(seq_ids) if s in self.matchers]
        if not rows:
            return None
        mask = self.xgr.allocate_token_bitmask(len(seq_ids), self.vocab_size)  # all ones: everything allowed
        for i, m in rows:
            m.fill_next_token_bitmask(mask, i)
        return mask

    def accept(self, seq_id: int, token: int) -> bool | None:
        """Advance the sequence's matcher; ``None`` = unconstrained, else whether its grammar is now complete.

        Raises ``RuntimeError`` if the token was not allowed (the mask makes that impossible)."""
        m = self.matchers.get(seq_id)
        if m is None:
            return None
        if not m.accept_token(token):
            raise RuntimeError(f"structured output: sampled token {token} is not allowed by the grammar")
        return m.is_terminated()
