"""SamplingParams: how one request is decoded. Validated on construction with messages that name the value."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain a request's output, as vLLM's ``StructuredOutputsParams``: exactly one of ``json`` (a JSON
    schema, as a dict or a JSON string), ``regex``, ``choice`` (the output is one of these strings),
    ``grammar`` (EBNF, xgrammar's dialect) or ``json_object=True`` (any JSON object). Applied in the sampler as
    a token mask compiled by xgrammar; the request finishes when the grammar is complete."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    backend: str | None = None  # accepted for vLLM compatibility; lqe always uses xgrammar
    whitespace_pattern: str | None = None  # accepted for vLLM compatibility; must be None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                _json_loads(self.json)
            except ValueError as e:
                raise ValueError(f"StructuredOutputsParams.json is a string but not valid JSON: {e}") from None
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"StructuredOutputsParams.json must be a JSON schema dict or string, got {type(self.json).__name__}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"StructuredOutputsParams.choice must be a non-empty list of strings, got {self.choice!r}")
            self.choice = list(self.choice)
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"StructuredOutputsParams.{k} must be a non-empty string, got {v!r}")
        if self.backend not in (None, "auto", "xgrammar"):
            raise ValueError(f"structured output backend {self.backend!r} is not available; lqe uses 'xgrammar'")
        if self.whitespace_pattern is not None:
            raise ValueError("whitespace_pattern is not supported (xgrammar backend); use disable_any_whitespace")

    def kind(self) -> tuple[str, Any]:
        """``(kind, value)``: the one constraint that is set."""
        for k in ("json", "regex", "choice", "grammar", "json_object"):
            v = getattr(self, k)
            if v not in (None, False):
                return k, v
        raise AssertionError("unreachable: validated in __post_init__")


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


def _check_logit_bias(bias: Any) -> dict[int, float]:
    """``{token id: bias}`` with integer ids >= 0 and finite biases in [-100, 100] (OpenAI's range)."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
    out = {}
    for k, v in bias.items():
        try:
            tid, val = int(k), float(v)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias entry {k!r}: {v!r} must map an integer token id to a number") from None
        if tid < 0 or not math.isfinite(val) or not -100.0 <= val <= 100.0:
            raise ValueError(f"logit_bias entry {k!r}: {v!r}: token ids are >= 0 and biases finite in [-100, 100]")
        out[tid] = val
    return out


def _json_loads(text: str) -> Any:
    return json.loads(text)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs of each generated token (the sampled one is always included)
    prompt_logprobs: int | None = None  # 0 = only the logprob of each prompt token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> value added to its logit before sampling (OpenAI)
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older spelling; moved to structured_outputs
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be an integer >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name}={v} must be in [-2, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens={self.max_tokens!r} must be a positive integer or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens!r} must be a non-negative integer")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0 or v > 20):
                raise ValueError(f"{name}={v!r} must be None or an integer in [0, 20]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an integer or None")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop={self.stop!r} must be a string or a list of non-empty strings")
        self._stop_list = stop
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias)
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding (its older name), not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
