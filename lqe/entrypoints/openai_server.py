"""`lqe serve MODEL`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one ``AsyncEngine``.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (``stream=true`` gives server-sent
events ending in ``data: [DONE]``), POST /tokenize and /detokenize, GET /version, GET /health, GET /metrics
(Prometheus text), GET /docs and /openapi.json. With an API key every path needs it except ``PUBLIC_PATHS``. Errors are OpenAI-style
``{"error": {"message", "type", "param", "code"}}``; a bad request never reaches the engine, an engine failure
answers 500 to the requests it hit and the server keeps serving.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import secrets
import sys

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from lqe.entrypoints.async_engine import AsyncEngine
from lqe.entrypoints.engine_args import add_engine_args, engine_kwargs
from lqe.entrypoints.help_format import HelpFormatter
from lqe.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from lqe.entrypoints.serving import OpenAIServing
from lqe.entrypoints.validation import APIError, ServingLimits, error_response

logger = logging.getLogger("lqe")

# answered without the API key: liveness, metrics, version and the API's own description (vLLM leaves these
# open too); everything that runs the model or the tokenizer needs the key
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version", "/docs", "/docs/oauth2-redirect", "/redoc",
                          "/openapi.json"})


def create_app(engine: AsyncEngine, served_model_name: str | None = None, api_key: str | None = None,
               limits: ServingLimits | None = None) -> FastAPI:
    """One app per engine; each app has its own Prometheus registry, so tests can build several."""
    name = served_model_name or engine.engine.config.model
    registry = CollectorRegistry()
    registry.register(_EngineCollector(engine))
    serving = OpenAIServing(engine, name, _Histograms(registry), limits)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="lqe OpenAI-compatible server", lifespan=lifespan)
    app.state.engine, app.state.registry, app.state.serving = engine, registry, serving

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key and request.url.path not in PUBLIC_PATHS:
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
                return error_response(APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                               type="authentication_error", code="invalid_api_key"))
        return await call_next(request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail), code=str(exc.status_code)))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception):
        logger.exception("lqe: unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(APIError(503, "the engine loop is not running", type="server_error"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=engine.engine.config.model, max_model_len=engine.engine.max_model_len)])

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.handle(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving.handle(request, ChatCompletionRequest)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await serving.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await serving.detokenize(request)

    @app.get("/version")
    async def version() -> dict:
        import lqe

        return {"version": lqe.__version__}

    return app


class _Histograms:
    """Per-request latency metrics, observed by the serving code when a request finishes."""

    def __init__(self, registry: CollectorRegistry) -> None:
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
        self.ttft = Histogram("lqe_time_to_first_token_seconds", "Time from arrival to the first generated token",
                              registry=registry, buckets=buckets)
        self.e2e = Histogram("lqe_e2e_request_latency_seconds", "Time from arrival to the last generated token",
                             registry=registry, buckets=buckets)


class _EngineCollector:
    """Reads the engine's statistics (as of its last step) at every scrape."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        yield GaugeMetricFamily("lqe_num_requests_running", "Sequences being generated", value=s.num_running)
        yield GaugeMetricFamily("lqe_num_requests_waiting", "Sequences waiting to be scheduled", value=s.num_waiting)
        yield GaugeMetricFamily("lqe_num_requests_in_flight", "HTTP-level requests in the engine",
                                value=self.engine.num_requests)
        yield GaugeMetricFamily("lqe_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)",
                                value=s.kv_cache_usage)
        yield GaugeMetricFamily("lqe_num_free_kv_blocks", "Free KV-cache blocks", value=s.num_free_blocks)
        yield GaugeMetricFamily("lqe_num_kv_blocks", "Total KV-cache blocks", value=s.num_total_blocks)
        yield GaugeMetricFamily("lqe_prefix_cache_hit_rate", "Prefix-cache hit rate", value=s.prefix_cache_hit_rate)
        yield CounterMetricFamily("lqe_num_preemptions", "Sequences preempted", value=s.num_preemptions)
        yield CounterMetricFamily("lqe_prompt_tokens", "Prompt tokens computed", value=s.prompt_tokens_total)
        yield CounterMetricFamily("lqe_generation_tokens", "Tokens generated", value=s.generation_tokens_total)
        yield CounterMetricFamily("lqe_engine_step_errors", "Engine steps that raised", value=self.engine.num_step_errors)


# -- command line ---------------------------------------------------------------------------------------------
def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``lqe serve``'s flags: the model, the server's own, and the engine's (:mod:`lqe.entrypoints.engine_args`)."""
    parser.add_argument("model", nargs="?", default=None,
                        help="local model directory, 'smollm2-135m-instruct', or a hub id (or use --model)")
    parser.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                        help="the same as the positional MODEL (vLLM's spelling; default: the positional one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $LQE_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="model name clients must send (default: MODEL)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or a file holding one (default: the tokenizer's)")
    parser.add_argument("--seed", type=int, default=None,
                        help="engine seed for requests without their own (default 0)")
    parser.add_argument("--max-request-body-bytes", type=int, default=16 << 20,
                        help="larger request bodies get 413 (default 16 MiB)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="abort a request still running after this many seconds (default: no limit)")
    parser.add_argument("--shutdown-grace-period", type=float, default=30.0,
                        help="on SIGTERM / Ctrl-C, let in-flight requests finish for this many seconds, then "
                             "abort the rest (default 30)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="server log level")
    return add_engine_args(parser)


def model_arg(args: argparse.Namespace) -> str:
    """The model from ``lqe serve MODEL`` or ``lqe serve --model MODEL`` (ValueError when neither or both differ)."""
    pos, flag = getattr(args, "model", None), getattr(args, "model_flag", None)
    if pos and flag and pos != flag:
        raise ValueError(f"two models given: {pos!r} (positional) and --model {flag!r}; give one")
    if not (pos or flag):
        raise ValueError("no model given: lqe serve MODEL, or lqe serve --model MODEL")
    return pos or flag


def _check_limits(args: argparse.Namespace) -> ServingLimits:
    if args.max_request_body_bytes <= 0:
        raise ValueError(f"--max-request-body-bytes {args.max_request_body_bytes} must be positive")
    if args.request_timeout is not None and args.request_timeout <= 0:
        raise ValueError(f"--request-timeout {args.request_timeout} must be positive (leave it out for no limit)")
    if args.shutdown_grace_period < 0:
        raise ValueError(f"--shutdown-grace-period {args.shutdown_grace_period} must be >= 0")
    return ServingLimits(args.max_request_body_bytes, args.request_timeout)


def build_engine(args: argparse.Namespace) -> AsyncEngine:
    from lqe.config import EngineConfig
    from lqe.engine.llm_engine import LLMEngine

    kwargs = engine_kwargs(args)
    if args.seed is not None:
        kwargs["seed"] = args.seed
    engine = LLMEngine(EngineConfig.from_kwargs(model_arg(args), **kwargs))
    if getattr(args, "chat_template", None):
        if engine.tokenizer is None:
            raise ValueError("--chat-template was given, but this model has no tokenizer")
        t = args.chat_template
        if os.path.isfile(t):
            with open(t, encoding="utf-8") as f:
                t = f.read()
        engine.tokenizer.chat_template = t
    return AsyncEngine(engine)


class GracefulServer:
    """uvicorn.Server whose shutdown (SIGTERM, Ctrl-C, ``should_exit``) first gives in-flight requests
    ``grace_s`` seconds, then aborts the rest with an error that says so (logged with their ids).

    At startup it freezes the heap (``gc.freeze()``, as vLLM does after loading): what is alive then (torch,
    transformers, the tokenizer, the model: about half a million objects) moves to the collector's permanent
    generation, which a full collection does not walk. Without it a full collection, which a few large requests'
    allocations can trigger, held the GIL for 0.25-0.36 s on 2 CPU cores and stalled every stream for that long
    (``tests/stress/test_stress_server.py::test_big_prompts_do_not_stall_a_stream``). Shutdown unfreezes, so a
    process that goes on (tests, an application embedding the server) collects those objects again."""

    def __new__(cls, config, engine: AsyncEngine, grace_s: float):
        import uvicorn

        class _Server(uvicorn.Server):
            async def startup(self, sockets=None):
                gc.collect()  # garbage of the load goes now, not into the permanent generation
                gc.freeze()
                await super().startup(sockets)
                if self.should_exit:  # startup failed (the port taken, ...): serve() returns without shutdown()
                    gc.unfreeze()

            async def shutdown(self, sockets=None):
                drain = asyncio.ensure_future(engine.drain(grace_s))
                try:
                    await super().shutdown(sockets)
                finally:
                    drain.cancel()
                    gc.unfreeze()

        config.timeout_graceful_shutdown = grace_s + 5  # backstop: connections still open then are cut
        return _Server(config)


def run_server(args: argparse.Namespace) -> None:
    import uvicorn

    model_arg(args)
    limits = _check_limits(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    lqe_logger = logging.getLogger("lqe")
    lqe_logger.setLevel(args.log_level.upper())
    lqe_logger.propagate = False  # its own handler already prints; the root handler would print it twice
    engine = build_engine(args)
    api_key = args.api_key or os.environ.get("LQE_API_KEY") or None
    app = create_app(engine, args.served_model_name, api_key, limits)
    logger.info("lqe: serving %s on http://%s:%d/v1%s", args.served_model_name or model_arg(args), args.host,
                args.port, " (API key required)" if api_key else "")
    try:
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
        GracefulServer(config, engine, args.shutdown_grace_period).run()
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lqe serve", description="OpenAI-compatible server for an lqe model",
                                     formatter_class=HelpFormatter)
    args = add_serve_args(parser).parse_args(argv)
    try:
        run_server(args)
    except (ValueError, FileNotFoundError, TypeError, MemoryError) as e:  # already explained: no traceback
        parser.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
