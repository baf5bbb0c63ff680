"""Serving /v1/completions and /v1/chat/completions: validate, tokenize, submit, then answer or stream.

A request with P prompts and ``n`` choices becomes P engine requests sharing one output queue; choice
``p * n + i`` is sample ``i`` of prompt ``p``. While streaming, text that could still turn out to be the start
of a stop string is held back until it cannot."""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from lqe.entrypoints import protocol as P
from lqe.entrypoints.async_engine import AsyncEngine, RequestFailed
from lqe.outputs import CompletionOutput, RequestOutput


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> P.ErrorResponse:
        return P.ErrorResponse(error=P.ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body().model_dump(), status_code=err.status)


@dataclass(slots=True)
class _Choice:
    text_len: int = 0  # characters already sent
    num_tokens: int = 0  # tokens whose logprobs were sent
    done: bool = False


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, histograms) -> None:
        self.engine, self.model_name, self.histograms = engine, model_name, histograms

    async def handle(self, request: Request, model: type[P.CompletionRequest] | type[P.ChatCompletionRequest]):
        try:
            req = _parse(await request.body(), model)
            if req.model is not None and req.model != self.model_name:
                raise APIError(400, f"model {req.model!r} is not served here; this server serves {self.model_name!r}",
                               "model", "model_not_found")
            chat = isinstance(req, P.ChatCompletionRequest)
            prompts = await self.engine.run(self._tokenize, req)
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
            return error_response(APIError(400, str(e), "messages" if chat else "prompt"))
        except BaseException:
            self.engine.abort(rids)
            raise
        ctx = _Context(base, int(time.time()), self.model_name, req, rids, [len(ids) for ids in prompts], queue)
        if req.stream:
            return StreamingResponse(self._stream(ctx), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(ctx, request)

    # -- validation (runs in the engine thread: the tokenizer is not shared across threads) --------------
    def _tokenize(self, req) -> list[list[int]]:
        eng = self.engine.engine
        tok, max_len = eng.tokenizer, eng.max_model_len
        if isinstance(req, P.ChatCompletionRequest):
            field = "messages"
            if tok is None or not getattr(tok, "chat_template", None):
                raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", field)
            try:
                msgs = req.message_dicts()
                ids = tok.apply_chat_template(msgs, add_generation_prompt=req.add_generation_prompt, tokenize=True)
            except ValueError as e:
                raise APIError(400, str(e), field) from e
            except Exception as e:  # a template that rejects the conversation (roles, ordering ...)
                raise APIError(400, f"the chat template rejected the messages: {e}", field) from e
            prompts = [list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)]
        else:
            field, prompts = "prompt", []
            for p in req.prompts():
                if isinstance(p, str):
                    if tok is None:
                        raise APIError(400, "this model has no tokenizer: send the prompt as token ids", field)
                    p = tok.encode(p)
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
        try:
            return req.to_sampling_params(max_tokens)
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
            item = await ctx.queue.get()
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
                item = await ctx.queue.get()
                if isinstance(item, Exception):
                    yield _sse(APIError(500, str(item), type="server_error").body())
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
                 queue: asyncio.Queue) -> None:
        self.id, self.created, self.model, self.req, self.rids = id, created, model, req, rids
        self.prompt_lens, self.queue, self.n = prompt_lens, queue, req.n
        self.chat = isinstance(req, P.ChatCompletionRequest)

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


def _parse(body: bytes, model):
    try:
        return model.model_validate_json(body or b"null")
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {err['msg']}", None, "invalid_json") from e
        param = str(err["loc"][0]) if err.get("loc") else None
        where = ".".join(str(x) for x in err.get("loc", ())) or "body"
        msg = f"{where}: {err['msg']}"
        if param in _SHAPES and len(e.errors()) > 1:  # a union: pydantic reports one error per alternative
            where, msg = param, f"{param} must be {_SHAPES[param]}"
        raise APIError(400, f"{msg} (got {json.dumps(err.get('input'), default=str)[:200]})", param,
                       "invalid_type" if "type" in err["type"] else "invalid_value") from e


_SHAPES = {"prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
           "stop": "a string or a list of strings"}


def _usage(prompt_lens: list[int], completion_tokens: int) -> P.UsageInfo:
    prompt = sum(prompt_lens)
    return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion_tokens, total_tokens=prompt + completion_tokens)


def _sse(obj) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass

