"""The user-facing facade: ``LLM(model).generate(...)``, ``chat(...)``, ``stream(...)``."""
from __future__ import annotations

import itertools
from typing import Any, Iterator, Sequence as Seq

from tqdm.auto import tqdm

from lqe.config import EngineConfig
from lqe.engine.llm_engine import LLMEngine
from lqe.inputs import PromptType, parse_prompt, parse_prompts
from lqe.outputs import RequestOutput
from lqe.sampling_params import SamplingParams

Prompt = PromptType
Message = dict[str, str]


class LLM:
    """An offline engine.

    >>> llm = LLM("smollm2-135m-instruct")
    >>> llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text

    ``llm.shutdown()``, the end of a ``with LLM(...) as llm:`` block, or ``del llm`` (with garbage collection)
    releases the weights, the KV cache, the CUDA graphs and the tensor-parallel workers, so another LLM can follow
    in the same process.
    """

    def __init__(self, model: str, quantization: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model, quantization=quantization, **kwargs)
        self.llm_engine = LLMEngine(self.config)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Release the engine (weights, KV cache, CUDA graphs, tensor-parallel workers and process group);
        idempotent. Later calls of ``generate`` / ``chat`` / ``stream`` raise a clear error."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the sampling fields of the model's ``generation_config.json`` (vLLM's rule)."""
        return self.llm_engine.default_sampling_params()

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs come back in prompt order.

        ``prompts`` is a string, a list of token ids, a ``TextPrompt`` / ``TokensPrompt`` dict, or a list of
        these. Without ``sampling_params`` the model's ``generation_config.json`` gives the defaults."""
        prompts = parse_prompts(prompts)
        params = _broadcast(sampling_params, len(prompts), self.get_default_sampling_params)
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = f"gen-{next(self._ids)}"
                self.llm_engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies through the tokenizer's chat template; one conversation or a list of them."""
        if not messages:
            raise ValueError("messages is empty: give at least one {'role': ..., 'content': ...} message")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        return self.generate([self.apply_chat_template(c, add_generation_prompt) for c in convs], sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        tok = self.get_tokenizer()
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        if not messages:
            raise ValueError("messages is empty: give at least one {'role': ..., 'content': ...} message")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        out = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the request's cumulative output after every step that changed it; the last one is finished.

        ``prompt`` is one prompt in any form ``generate`` takes (checked here, before the first step). Other
        requests already in the engine keep being served while this iterator is consumed."""
        if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], int):
            raise TypeError("stream() takes one prompt; call it once per prompt, or use generate() for a list")
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams or None, got {type(sampling_params).__name__}")
        return self._stream(parse_prompt(prompt), sampling_params)

    def _stream(self, prompt: str | list[int], sampling_params: SamplingParams | None) -> Iterator[RequestOutput]:
        rid = f"stream-{next(self._ids)}"
        self.llm_engine.add_request(rid, prompt, sampling_params)
        try:
            while True:
                for out in self.llm_engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.llm_engine.abort_request(rid)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending, results = set(ids), {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm)
        try:
            while pending:
                for out in self.llm_engine.step():
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            self.llm_engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]


def _broadcast(params, n: int, default) -> list[SamplingParams]:
    if params is None:
        return [default() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
        raise TypeError(f"sampling_params must be a SamplingParams, a list of them, or None; got {params!r:.80}")
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts; give one, or one per prompt")
    return params
