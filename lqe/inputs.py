"""The prompt forms ``LLM.generate`` / ``LLM.stream`` accept, as in vLLM: a string, a list of token ids, a
``TextPrompt`` (``{"prompt": str}``) or a ``TokensPrompt`` (``{"prompt_token_ids": list[int]}``), or a list of
any of these."""
from __future__ import annotations

from typing import Any, TypedDict, Union

try:
    from typing import NotRequired
except ImportError:  # Python 3.10
    from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[Any]  # accepted for vLLM compatibility; must be empty


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # ignored: the token ids are what runs
    multi_modal_data: NotRequired[Any]


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]

ACCEPTED = ("a str, a list[int] of token ids, a TextPrompt {'prompt': str}, a TokensPrompt "
            "{'prompt_token_ids': list[int]}, or a list of these")


def _is_token_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_prompt(p: Any, where: str = "prompt") -> str | list[int]:
    """One prompt in any accepted form -> the text or the token ids the engine takes."""
    if isinstance(p, str):
        return p
    if _is_token_list(p) or (isinstance(p, (list, tuple)) and not p):  # empty: the engine says "prompt is empty"
        return [int(t) for t in p]
    if isinstance(p, dict):
        if p.get("multi_modal_data"):
            raise ValueError(f"{where}: multi_modal_data is not supported (lqe runs text-only models)")
        unknown = set(p) - {"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"}
        if unknown:
            raise TypeError(f"{where}: unknown prompt keys {sorted(unknown)}; expected {ACCEPTED}")
        if "prompt_token_ids" in p:
            ids = p["prompt_token_ids"]
            if not (_is_token_list(ids) or ids == []):
                raise TypeError(f"{where}: 'prompt_token_ids' must be a list of int, got {ids!r:.80}")
            return [int(t) for t in ids]
        if "prompt" in p:
            if not isinstance(p["prompt"], str):
                raise TypeError(f"{where}: 'prompt' must be a str, got {type(p['prompt']).__name__}")
            return p["prompt"]
    raise TypeError(f"{where}: unsupported prompt {p!r:.80} of type {type(p).__name__}; expected {ACCEPTED}")


def parse_prompts(prompts: Any) -> list[str | list[int]]:
    """A single prompt or a sequence of prompts -> a list of texts / token-id lists."""
    if isinstance(prompts, (str, dict)) or _is_token_list(prompts):
        return [parse_prompt(prompts)]
    if isinstance(prompts, (list, tuple)):
        return [parse_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
    raise TypeError(f"unsupported prompts {prompts!r:.80} of type {type(prompts).__name__}; expected {ACCEPTED}")
