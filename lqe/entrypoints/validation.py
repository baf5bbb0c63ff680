"""Request validation for the server: OpenAI-style errors, the body-size limit, JSON parsing into the protocol
models with the failing field named, and the mapping of structured-output and logit-bias fields onto
``SamplingParams``."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from lqe.entrypoints import protocol as P


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
class ServingLimits:
    max_body_bytes: int = 16 << 20  # a request body above this gets 413
    request_timeout_s: float | None = None  # a request still running after this is aborted (None = no limit)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit`` bytes (also without Content-Length)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {int(declared)} bytes; this server accepts at most {limit} "
                       "(--max-request-body-bytes)", None, "request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body passed {limit} bytes, the most this server accepts "
                           "(--max-request-body-bytes)", None, "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class RequestTimedOut(Exception):
    pass


def parse(body: bytes, model):
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


def field_of(message: str, default: str) -> str:
    m = re.match(r"(\w+)=", message)
    return m.group(1) if m else default


def structured_params(req) -> dict:
    """``structured_outputs=StructuredOutputsParams(...)`` from response_format / guided_* / structured_outputs."""
    spec, field = {}, None
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            spec, field = {"json_object": True}, "response_format"
        elif kind == "json_schema":
            schema = (rf.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                               "response_format")
            spec, field = {"json": schema}, "response_format"
        elif kind != "text":
            raise APIError(400, f"response_format type {kind!r} is not supported; use 'text', 'json_object' or "
                           "'json_schema'", "response_format")
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice")):
        value = getattr(req, name)
        if value is not None:
            if spec:
                raise APIError(400, f"{name} and {field} both ask for structured output; send one", name)
            spec, field = {key: value}, name
    if req.structured_outputs:
        if spec:
            raise APIError(400, f"structured_outputs and {field} both ask for structured output; send one",
                           "structured_outputs")
        spec, field = dict(req.structured_outputs), "structured_outputs"
    if not spec:
        return {}
    import lqe

    cls = getattr(lqe, "StructuredOutputsParams", None)
    if cls is None or "structured_outputs" not in getattr(lqe.SamplingParams, "__dataclass_fields__", {}):
        raise APIError(400, f"{field}: structured output is not supported yet by this lqe build", field,
                       "unsupported")
    try:
        return {"structured_outputs": cls(**spec)}
    except (TypeError, ValueError) as e:
        raise APIError(400, f"{field}: {e}", field) from e


def logit_bias(bias: dict[str, float], vocab: int) -> dict:
    from lqe.sampling_params import SamplingParams

    if "logit_bias" not in getattr(SamplingParams, "__dataclass_fields__", {}):
        raise APIError(400, "logit_bias is not supported yet by this lqe build", "logit_bias", "unsupported")
    out = {}
    for k, v in bias.items():
        if not k.lstrip("-").isdigit() or not 0 <= int(k) < vocab:
            raise APIError(400, f"logit_bias key {k!r} must be a token id in [0, {vocab})", "logit_bias")
        out[int(k)] = max(-100.0, min(100.0, float(v)))
    return {"logit_bias": out}


_SHAPES = {"prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
           "stop": "a string or a list of strings"}
