"""Serving /v1/completions and /v1/chat/completions: validate, tokenize, submit, then answer or stream.

A request with P prompts and ``n`` choices becomes P engine requests sharing one output queue; choice
``p * n + i`` is sample ``i`` of prompt ``p``. While streaming, text that could still turn out to be the start
of a stop string is held back until it cannot."""
from __future__ import annotations

import asyncio
import re
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from lqe.entrypoints import protocol as P
from lqe.entrypoints.async_engine import AsyncEngine, RequestFailed
from lqe.entrypoints.validation import (APIError, RequestTimedOut, ServingLimits, error_response, field_of,
                                        logit_bias, parse, read_body, structured_params)
from lqe.outputs import CompletionOutput, RequestOutput


@dataclass(slots=True)
class _Choice:
    text_len: int = 0  # characters already sent
    num_tokens: int = 0  # tokens whose logprobs were sent
    done: bool = False


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, histograms, limits: "ServingLimits | None" = None) -> None:
        self.engine, self.model_name, self.histograms = engine, model_name, histograms
        self.limits = limits or ServingLimits()

    async def handle(self, request: Request, model: type[P.CompletionRequest] | type[P.ChatCompletionRequest]):
        chat = model is P.ChatCompletionRequest
        try:
            req = parse(await read_body(request, self.limits.max_body_bytes), model)
            self.check_model(req.model)
            bad = req.unsupported_field()
            if bad is not None:
                raise APIError(400, f"{bad[0]} is not supported by lqe: {bad[1]}", bad[0], "unsupported")
            self._check_prompt_size(req)
            prompts = await self.engine.run_tokenizer(self._tokenize, req)
            params = [self._params(req, len(ids)) for ids in prompts]
        except APIError as e:
            return error_response(e)
        base = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        rids = [f"{base}-{i}" for i in range(len(prompts))]
        queue: asyncio.Queue = asyncio.Queue()
        try:
            for rid, ids, p in zip(rids, prompts, params):
                await self.engine.add_request(rid, ids, p, queue)
        except ValueError as e:
            self.engine.abort(rids)
            return error_response(APIError(400, str(e), field_of(str(e), "messages" if chat else "prompt")))
        except BaseException:
            self.engine.abort(rids)
            raise
        ctx = _Context(base, int(time.time()), self.model_name, req, rids, [len(ids) for ids in prompts], queue,
                       self.limits.request_timeout_s)
        if req.stream:
            return StreamingResponse(self._stream(ctx), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(ctx, request)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist here; this server serves {self.model_name!r} "
                           "(GET /v1/models lists it)", "model", "model_not_found", type="NotFoundError")

    # -- /tokenize and /detokenize (vLLM's extra endpoints) -----------------------------------------------
    async def tokenize(self, request: Request):
        try:
            req = parse(await read_body(request, self.limits.max_body_bytes), P.TokenizeRequest)
            self.check_model(req.model)
            if (req.prompt is None) == (req.messages is None):
                raise APIError(400, "give exactly one of prompt (a string) or messages (a chat)",
                               "prompt" if req.messages is None else "messages")
            self._check_prompt_size(req)
            ids, strs = await self.engine.run_tokenizer(self._tokenize_one, req)
        except APIError as e:
            return error_response(e)
        return P.TokenizeResponse(count=len(ids), max_model_len=self.engine.engine.max_model_len, tokens=ids,
                                  token_strs=strs)

    async def detokenize(self, request: Request):
        try:
            req = parse(await read_body(request, self.limits.max_body_bytes), P.DetokenizeRequest)
            self.check_model(req.model)
            tok = self.engine.engine.tokenizer
            if tok is None:
                raise APIError(400, "this model has no tokenizer", "tokens")
            vocab = self.engine.engine.model_config.vocab_size
            bad = [t for t in req.tokens if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
            text = await self.engine.run_tokenizer(lambda t: t.decode(req.tokens))
        except APIError as e:
            return error_response(e)
        return P.DetokenizeResponse(prompt=text)

    # -- validation ---------------------------------------------------------------------------------------
    def _check_prompt_size(self, req) -> None:
        """Refuse, before tokenizing, text that cannot fit max_model_len whatever its tokenization: no token of
        this vocabulary covers more than ``max_token_chars`` characters."""
        eng = self.engine.engine
        limit = (eng.max_model_len - 1) * self.engine.max_token_chars
        if isinstance(req, P.CompletionRequest):
            field, texts = "prompt", [p for p in req.prompts() if isinstance(p, str)]
        elif isinstance(req, P.TokenizeRequest) and req.prompt is not None:
            field, texts = "prompt", [req.prompt]
        else:
            field = "messages"
            texts = ["".join(m.content if isinstance(m.content, str) else "".join(x.text or "" for x in m.content)
                             for m in req.messages if m.content)]
        for t in texts:
            if len(t) > limit:
                raise APIError(400, f"the {field} has {len(t)} characters; no tokenization of that fits "
                               f"max_model_len={eng.max_model_len} tokens (a token of this vocabulary spans at most "
                               f"{self.engine.max_token_chars} characters, so at most {limit} characters can fit); "
                               "shorten the prompt", field, "context_length_exceeded")

    def _apply_template(self, tok, req) -> list[int]:
        field = "messages"
        if tok is None or not (req.chat_template or getattr(tok, "chat_template", None)):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions or send "
                           "chat_template", field)
        try:
            msgs = req.message_dicts()
            ids = tok.apply_chat_template(
                msgs, add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message, chat_template=req.chat_template, tokenize=True,
                **(req.chat_template_kwargs or {}))
        except ValueError as e:
            raise APIError(400, str(e), field) from e
        except Exception as e:  # a template that rejects the conversation (roles, ordering ...)
            raise APIError(400, f"the chat template rejected the messages: {e}", field) from e
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)

    def _tokenize_one(self, tok, req: P.TokenizeRequest) -> tuple[list[int], list[str] | None]:
        if req.messages is not None:
            ids = self._apply_template(tok, req)
        else:
            if tok is None:
                raise APIError(400, "this model has no tokenizer", "prompt")
            ids = tok.encode(req.prompt, add_special_tokens=True if req.add_special_tokens is None
                             else req.add_special_tokens)
        return ids, (tok.convert_ids_to_tokens(ids) if req.return_token_strs else None)

    # runs in the tokenizer thread, on that thread's own copy of the tokenizer
    def _tokenize(self, tok, req) -> list[list[int]]:
        max_len = self.engine.engine.max_model_len
        if isinstance(req, P.ChatCompletionRequest):
            field = "messages"
            prompts = [self._apply_template(tok, req)]
        else:
            field, prompts = "prompt", []
            for p in req.prompts():
                if isinstance(p, str):
                    if tok is None:
                        raise APIError(400, "this model has no tokenizer: send the prompt as token ids", field)
                    p = tok.encode(p, add_special_tokens=req.add_special_tokens)
                prompts.append(list(p))
            if not prompts:
                raise APIError(400, "prompt is empty: give a string, a list of strings or a list of token ids", field)
        for ids in prompts:
            if not ids:
                raise APIError(400, f"{field}: a prompt is empty (zero tokens)", field)
            if len(ids) >= max_len:
                raise APIError(400, f"the prompt has {len(ids)} tokens, but this model's context is max_model_len="
                               f"{max_len} tokens, which leaves room for at most {max_len - 1} prompt tokens",
                               field, "context_length_exceeded")
        return prompts

    def _params(self, req, prompt_len: int):
        chat = isinstance(req, P.ChatCompletionRequest)
        if not chat and req.echo:
            raise APIError(400, "echo=true is not supported by this server", "echo", "unsupported")
        max_len = self.engine.engine.max_model_len
        max_tokens = req.requested_max_tokens() if chat else req.max_tokens
        param = req.max_tokens_param if chat else "max_tokens"
        if req.max_tokens_given() and prompt_len + max_tokens > max_len:
            raise APIError(400, f"{param}={max_tokens} plus the prompt's {prompt_len} tokens exceeds the context "
                           f"max_model_len={max_len}; ask for at most {max_len - prompt_len} tokens", param,
                           "context_length_exceeded")
        if max_tokens is not None:
            max_tokens = min(max_tokens, max_len - prompt_len)
        extra = structured_params(req)
        if req.logit_bias:
            extra.update(logit_bias(req.logit_bias, self.engine.engine.model_config.vocab_size))
        try:
            return req.to_sampling_params(max_tokens, **extra)
        except ValueError as e:
            m = re.match(r"(\w+)=", str(e))
            name = m.group(1) if m else None
            if chat and name == "logprobs":
                name = "top_logprobs"
            raise APIError(400, str(e), name) from e

    # -- answering ----------------------------------------------------------------------------------------
    async def _complete(self, ctx: "_Context", request: Request):
        finals: dict[str, RequestOutput] = {}
        collect = asyncio.ensure_future(self._collect(ctx, finals))
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait([collect, watch], return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():  # the client went away: nobody to answer (499 is nginx's word for it)
                return Response(status_code=499)
            collect.result()
        except RequestFailed as e:
            return error_response(APIError(500, str(e), type="server_error"))
        except RequestTimedOut as e:
            return error_response(APIError(504, str(e), None, "request_timeout", type="server_error"))
        finally:
            watch.cancel()
            collect.cancel()
            self.engine.abort(ctx.rids)
        outs = [(i * ctx.n + o.index, o) for i, rid in enumerate(ctx.rids) for o in finals[rid].outputs]
        outs.sort(key=lambda x: x[0])
        usage = _usage(ctx.prompt_lens, sum(len(o.token_ids) for _, o in outs))
        if ctx.chat:
            choices = [P.ChatChoice(index=i, message=P.ChatMessageOut(content=o.text), logprobs=ctx.chat_lp(o, 0),
                                    finish_reason=o.finish_reason, stop_reason=o.stop_reason) for i, o in outs]
            return P.ChatCompletionResponse(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices, usage=usage)
        choices = [P.CompletionChoice(index=i, text=o.text, logprobs=ctx.cmpl_lp(o, 0, 0), finish_reason=o.finish_reason,
                                      stop_reason=o.stop_reason) for i, o in outs]
        return P.CompletionResponse(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices, usage=usage)

    async def _collect(self, ctx: "_Context", finals: dict[str, RequestOutput]) -> None:
        while len(finals) < len(ctx.rids):
            item = await ctx.next_item()
            if isinstance(item, Exception):
                raise item
            if item.finished:
                finals[item.request_id] = item
                self._observe(item)

    async def _stream(self, ctx: "_Context"):
        states = {i: _Choice() for i in range(len(ctx.rids) * ctx.n)}
        stops = [ctx.req.stop] if isinstance(ctx.req.stop, str) else ctx.req.stop or []
        hold = max((len(s) for s in stops), default=1) - 1
        index = {rid: i for i, rid in enumerate(ctx.rids)}
        finished: set[str] = set()
        try:
            if ctx.chat:
                yield _sse(ctx.chunk([P.ChatStreamChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))
                                      for i in states]))
            while len(finished) < len(ctx.rids):
                try:
                    item = await ctx.next_item()
                except RequestTimedOut as e:
                    item = e
                if isinstance(item, Exception):
                    status, code = (504, "request_timeout") if isinstance(item, RequestTimedOut) else (500, None)
                    yield _sse(APIError(status, str(item), None, code, type="server_error").body())
                    break
                choices = []
                for o in item.outputs:
                    idx = index[item.request_id] * ctx.n + o.index
                    st = states[idx]
                    if st.done:
                        continue
                    st.done = o.finish_reason is not None
                    end = len(o.text) if st.done else max(st.text_len, len(o.text) - hold)
                    text, ntok = o.text[st.text_len:end], st.num_tokens
                    if not text and ntok == len(o.token_ids) and not st.done:
                        continue
                    choices.append(ctx.delta(idx, o, text, ntok, st.text_len))
                    st.text_len, st.num_tokens = end, len(o.token_ids)
                if choices:
                    yield _sse(ctx.chunk(choices))
                if item.finished:
                    finished.add(item.request_id)
                    self._observe(item)
            if ctx.req.include_usage:
                n_out = sum(s.num_tokens for s in states.values())
                yield _sse(ctx.chunk([], _usage(ctx.prompt_lens, n_out)))
            yield "data: [DONE]\n\n"
        finally:  # also on a client disconnect (the response task is cancelled): free the KV blocks
            self.engine.abort(ctx.rids)

    def _observe(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is not None and m.first_token_time is not None:
            self.histograms.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            if m.finished_time is not None:
                self.histograms.e2e.observe(max(0.0, m.finished_time - m.arrival_time))


class _Context:
    """One HTTP request in flight: identity, its engine requests, and chunk builders."""

    def __init__(self, id: str, created: int, model: str, req, rids: list[str], prompt_lens: list[int],
                 queue: asyncio.Queue, timeout_s: float | None = None) -> None:
        self.id, self.created, self.model, self.req, self.rids = id, created, model, req, rids
        self.prompt_lens, self.queue, self.n = prompt_lens, queue, req.n
        self.chat = isinstance(req, P.ChatCompletionRequest)
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s

    async def next_item(self):
        """The next engine output (or failure) of this request; ``RequestTimedOut`` once its time is up."""
        if self.deadline is None:
            return await self.queue.get()
        try:
            return await asyncio.wait_for(self.queue.get(), max(0.0, self.deadline - time.monotonic()))
        except (asyncio.TimeoutError, TimeoutError):
            raise RequestTimedOut(f"the request did not finish within the server's per-request timeout of "
                                  f"{self.timeout_s:g} s (--request-timeout); it was aborted") from None

    def cmpl_lp(self, o: CompletionOutput, start: int, offset: int) -> P.CompletionLogprobs | None:
        if self.req.logprobs is None or o.logprobs is None:
            return None
        return P.completion_logprobs(o.token_ids[start:], o.logprobs[start:], self.req.logprobs, offset)

    def chat_lp(self, o: CompletionOutput, start: int) -> P.ChatChoiceLogprobs | None:
        if not self.req.logprobs or o.logprobs is None:
            return None
        return P.chat_logprobs(o.token_ids[start:], o.logprobs[start:], self.req.top_logprobs or 0)

    def delta(self, idx: int, o: CompletionOutput, text: str, start: int, offset: int):
        if self.chat:
            return P.ChatStreamChoice(index=idx, delta=P.DeltaMessage(content=text), logprobs=self.chat_lp(o, start),
                                      finish_reason=o.finish_reason, stop_reason=o.stop_reason)
        return P.CompletionChoice(index=idx, text=text, logprobs=self.cmpl_lp(o, start, offset),
                                  finish_reason=o.finish_reason, stop_reason=o.stop_reason)

    def chunk(self, choices: list, usage: P.UsageInfo | None = None):
        cls = P.ChatCompletionChunk if self.chat else P.CompletionResponse
        return cls(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)


def _usage(prompt_lens: list[int], completion_tokens: int) -> P.UsageInfo:
    prompt = sum(prompt_lens)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion_tokens, total_tokens=prompt + completion_tokens)


def _sse(obj) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass

