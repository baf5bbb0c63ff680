"""Pydantic models of the OpenAI-compatible API: requests (strictly typed, unknown fields ignored) and responses.

Field names and defaults follow the OpenAI API; ``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens`` and the ``guided_*``
fields are the usual vLLM extensions. Fields of the OpenAI / vLLM APIs that lqe does not implement are listed in
``UNSUPPORTED`` and answered with a 400 naming them; fields nobody defines are ignored (as vLLM does)."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lqe.sampling_params import SamplingParams


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # extras are checked against UNSUPPORTED, then ignored

_INT64 = 2**63 - 1

# field -> why / what to do instead. Present with a value other than its "off" value => 400 naming the field.
UNSUPPORTED: dict[str, str] = {
    "tools": "tool calling is not implemented", "functions": "function calling is not implemented",
    "function_call": "function calling is not implemented", "audio": "audio output is not implemented",
    "prediction": "predicted outputs are not implemented", "web_search_options": "web search is not implemented",
    "reasoning_effort": "reasoning controls are not implemented", "use_beam_search": "beam search is not implemented",
    "length_penalty": "beam search is not implemented", "bad_words": "bad_words is not implemented",
    "allowed_token_ids": "allowed_token_ids is not implemented", "prompt_logprobs": "prompt_logprobs is not served "
    "over HTTP (use the Python API)", "truncate_prompt_tokens": "prompt truncation is not implemented",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not implemented", "suffix": "suffix (insertion) "
    "is not implemented", "guided_grammar": "grammar-guided decoding is not implemented; use guided_json, "
    "guided_regex or guided_choice", "structural_tag": "structural tags are not implemented",
    "guided_decoding_backend": "the structured-output backend cannot be chosen per request",
    "mm_processor_kwargs": "multimodal inputs are not supported", "documents": "documents (RAG templates) are not "
    "supported", "priority": "request priorities are not implemented",
}
# their "off" values: sending these is the same as not sending the field
_OFF: dict[str, tuple[Any, ...]] = {"tools": (None, []), "functions": (None, []), "use_beam_search": (None, False),
                                    "length_penalty": (None, 1, 1.0), "bad_words": (None, []),
                                    "allowed_token_ids": (None, []), "return_tokens_as_token_ids": (None, False),
                                    "suffix": (None, ""), "priority": (None, 0), "guided_decoding_backend": (None, "auto")}


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- errors -----------------------------------------------------------------------------------------------
class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# -- requests ---------------------------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-_INT64 - 1, le=_INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: Literal[True] = True
    logit_bias: dict[str, float] | None = None
    best_of: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def unsupported_field(self) -> tuple[str, str] | None:
        """``(field, reason)`` of the first field sent that lqe does not implement."""
        extra = self.model_extra or {}
        for name, why in UNSUPPORTED.items():
            if name in extra and extra[name] not in _OFF.get(name, (None,)):
                return name, why
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", f"best_of={self.best_of} differs from n={self.n}; lqe returns every sample (best_of=n)"
        return None

    def _params(self, max_tokens: int | None, logprobs: int | None, **extra: Any) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            max_tokens=max_tokens, logprobs=logprobs, **extra)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def max_tokens_given(self) -> bool:
        return "max_tokens" in self.model_fields_set and self.max_tokens is not None

    def to_sampling_params(self, max_tokens: int | None, **extra: Any) -> SamplingParams:
        return self._params(max_tokens, self.logprobs, **extra)


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None  # required, may be null (an assistant turn with no text)
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    echo: Literal[False] = False

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_given(self) -> bool:
        return self.requested_max_tokens() is not None

    def to_sampling_params(self, max_tokens: int | None, **extra: Any) -> SamplingParams:
        return self._params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, **extra)

    def message_dicts(self) -> list[dict[str, str]]:
        """Messages as the chat template expects them; raises ValueError naming the bad message."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported, got type "
                                         f"{part.type!r}")
                    texts.append(part.text)
                content = "".join(texts)
            d = {"role": m.role, "content": content or ""}
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a ``prompt`` (completions style) or ``messages`` (chat style)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def message_dicts(self) -> list[dict[str, str]]:
        return ChatCompletionRequest.message_dicts(self)  # type: ignore[arg-type]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


# -- responses --------------------------------------------------------------------------------------------
class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "lqe"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ChatMessageOut(_Response):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# -- engine outputs -> protocol objects ---------------------------------------------------------------------
def completion_logprobs(token_ids: list[int], logprobs: list[dict], num: int, offset: int) -> CompletionLogprobs:
    """Legacy completions logprobs of ``token_ids``; ``offset`` is the text offset of the first token."""
    out = CompletionLogprobs()
    for tid, d in zip(token_ids, logprobs):
        tok = _token_text(d[tid].decoded_token, tid)
        out.tokens.append(tok)
        out.token_logprobs.append(d[tid].logprob)
        top: dict[str, float] = {}
        for t, lp in sorted(d.items(), key=lambda kv: kv[1].rank):
            if lp.rank <= num or t == tid:
                top.setdefault(_token_text(lp.decoded_token, t), lp.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def chat_logprobs(token_ids: list[int], logprobs: list[dict], num: int) -> ChatChoiceLogprobs:
    content = []
    for tid, d in zip(token_ids, logprobs):
        tops = [_top(lp.decoded_token, t, lp.logprob) for t, lp in sorted(d.items(), key=lambda kv: kv[1].rank)
                if lp.rank <= num][:num]
        tok = _token_text(d[tid].decoded_token, tid)
        content.append(ChatTokenLogprob(token=tok, logprob=d[tid].logprob, bytes=list(tok.encode()), top_logprobs=tops))
    return ChatChoiceLogprobs(content=content)


def _top(text: str | None, tid: int, logprob: float) -> TopLogprob:
    tok = _token_text(text, tid)
    return TopLogprob(token=tok, logprob=logprob, bytes=list(tok.encode()))


def _token_text(text: str | None, tid: int) -> str:
    return text if text is not None else f"token_id:{tid}"
