"""The frontend process: a starlette app served by uvicorn (DESIGN §2, §7).

Startup order: connect to the engine and complete the handshake (Hello -> EngineInfo,
retried with a deadline of cfg.startup_timeout_s), load the tokenizer and chat template
from the engine's model_path, and only then bind cfg.host:cfg.port (uvicorn runs the ASGI
lifespan startup before it opens its listening socket). If the engine never answers, the
process exits non-zero.

Run alone: `python -m services.frontend.server --engine-address ipc://... --port 8000`
(the same flags as `kestrel`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from services.frontend.auth import APIKeyMiddleware
from services.frontend.anthropic_api import ANY_METHOD, AnthropicServing, anthropic_endpoint
from services.frontend.anthropic_errors import AnthropicEnvelopeMiddleware
from services.frontend.chat_features import ChatFeatures, load_chat_template
from services.frontend.engine_client import EngineCallError, EngineClient, EngineUnavailable
from services.frontend.lifecycle import (DrainMiddleware, beat_forever, debug_routes,
                                         frontend_name, serve)
from services.frontend.errors import (APIError, InternalError, MethodNotAllowed, NotFound,
                                      error_response)
from services.frontend.metrics import MetricsEndpoint
from services.frontend.openai_api import OpenAIServing
from services.frontend.openai_sampling import warm_xgrammar
from services.frontend.tokenizer import Tokenizer
from shared.config import KestrelConfig, add_cli_arguments, build_config
from shared.liveness import Beacon
from shared.procutil import die_with_parent, set_title, setup_logging

log = logging.getLogger("kestrel.frontend")

PROCESS_TITLE = "kestrel:frontend"


def _endpoint(method: str):
    """A route endpoint that calls `method` of the OpenAIServing built at startup."""

    async def endpoint(request: Request) -> Response:
        return await getattr(request.app.state.serving, method)(request)

    endpoint.__name__ = method
    return endpoint


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    err: APIError
    if exc.status_code == 404:
        err = NotFound(f"No route for {request.method} {request.url.path}.")
    elif exc.status_code == 405:
        err = MethodNotAllowed(f"Method {request.method} is not allowed on {request.url.path}.")
    else:
        err = APIError(str(exc.detail))
        err.status = exc.status_code
        err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(err)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s: %s", request.method, request.url.path, exc)
    return error_response(InternalError("Internal server error."))


async def _metrics(request: Request) -> Response:
    """GET /metrics: Prometheus text (services/frontend/metrics.py). Open without a key."""
    return await request.app.state.metrics(request)


async def _reset_prefix_cache(request: Request) -> Response:
    """POST /reset_prefix_cache: drop every cached KV block of the engine's prefix cache.

    Calls the engine's `reset_prefix_cache` utility. 200 `{"ok": true}` when done; 409
    `{"ok": false, "error": {...}}` (type `conflict`) when requests still hold blocks (the
    engine refuses; retry when idle); 503 when the engine does not answer within 10 s.
    """
    engine = request.app.state.serving.engine
    try:
        result = await engine.call_utility("reset_prefix_cache", timeout=10.0)
    except (EngineUnavailable, EngineCallError, TimeoutError) as e:
        return Response(orjson.dumps({"ok": False, "error": {
            "message": f"The engine did not reset its prefix cache: {e or 'timeout'}.",
            "type": "service_unavailable", "param": None, "code": None}}),
            status_code=503, media_type="application/json")
    if result.get("ok"):
        return Response(orjson.dumps({"ok": True}), media_type="application/json")
    return Response(orjson.dumps({"ok": False, "error": {
        "message": "Requests are using KV blocks; the prefix cache was not reset. Retry when "
                   "the server is idle.", "type": "conflict", "param": None, "code": None}}),
        status_code=409, media_type="application/json")


async def _build_serving(cfg: KestrelConfig, engine: EngineClient) -> OpenAIServing:
    """Handshake with the engine, then load the tokenizer and chat template it names."""
    info = await engine.connect(cfg.startup_timeout_s)
    tokenizer = Tokenizer(info.model_path)
    template = None
    try:  # --chat-template (a bundled name or a path), else the model's own
        template = load_chat_template(cfg.chat_template, tokenizer)
        if template is None:
            log.warning("model at %s has no chat template; chat completions will fail",
                        info.model_path)
    except ValueError as e:
        log.error("%s; chat completions will fail", e)
    name = cfg.served_model_name or info.model_name
    return OpenAIServing(engine, tokenizer, template, name, info.max_model_len, cfg.keepalive_s,
                         cfg.max_request_body_bytes,
                         ChatFeatures(cfg.tool_call_parser, cfg.reasoning_parser), info.max_num_waiting)


def create_app(cfg: KestrelConfig, index: int = 0) -> Starlette:
    """The ASGI app of frontend `index` (named `frontend-<index>` to the engine and the
    watchdog). Its lifespan connects to the engine at cfg.engine_address (raising
    TimeoutError after cfg.startup_timeout_s without an answer), beats the watchdog beacon,
    warms xgrammar in a background thread (its first import takes seconds and must not
    block the event loop on the first json_schema request), and closes the client at
    shutdown (lifecycle.py: draining, debug routes)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        name = frontend_name(index)
        engine = EngineClient(cfg.engine_address, name=name)
        app.state.draining = False
        beats = asyncio.create_task(beat_forever(Beacon(cfg.runtime_dir, name)))
        threading.Thread(target=warm_xgrammar, name="xgrammar-warmup", daemon=True).start()
        try:
            app.state.serving = await _build_serving(cfg, engine)
            app.state.anthropic = AnthropicServing(app.state.serving,
                                                   app.state.serving.features)
            app.state.metrics = MetricsEndpoint(engine, app.state.serving.model_name,
                                                cfg.runtime_dir)
            log.info("serving %s on http://%s:%d", app.state.serving.model_name, cfg.host,
                     cfg.port)
            yield
        finally:
            beats.cancel()
            await engine.close()

    routes = [
        Route("/health", _endpoint("health"), methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
        Route("/reset_prefix_cache", _reset_prefix_cache, methods=["POST"]),
        Route("/v1/models", _endpoint("list_models"), methods=["GET"]),
        Route("/v1/models/{model:path}", _endpoint("get_model"), methods=["GET"]),
        Route("/v1/chat/completions", _endpoint("chat_completions"), methods=["POST"]),
        Route("/v1/completions", _endpoint("completions"), methods=["POST"]),
        Route("/v1/messages", anthropic_endpoint("messages"), methods=ANY_METHOD),
        Route("/v1/messages/count_tokens", anthropic_endpoint("count_tokens"), methods=ANY_METHOD),
        Route("/tokenize", _endpoint("tokenize"), methods=["POST"]),
        Route("/detokenize", _endpoint("detokenize"), methods=["POST"]),
        Route("/openapi.json", _endpoint("openapi"), methods=["GET"]),
        Route("/internal/stats", _endpoint("internal_stats"), methods=["GET"]),
        *debug_routes(cfg),
    ]
    # Every route but /health and /metrics needs the key when one is set (auth.py).
    middleware = [Middleware(APIKeyMiddleware, api_key=cfg.api_key)] if cfg.api_key else []
    middleware.insert(0, Middleware(DrainMiddleware))  # 503 to everything while draining
    # Outermost: every error under /v1/messages in Anthropic's envelope (anthropic_errors.py).
    middleware.insert(0, Middleware(AnthropicEnvelopeMiddleware))
    return Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                     exception_handlers={HTTPException: _http_error, Exception: _internal_error})


def run_frontend(cfg: KestrelConfig, index: int = 0) -> None:
    """Run frontend `index` until SIGINT/SIGTERM (then drain up to cfg.shutdown_timeout s).

    Sets the process title `kestrel:frontend:<index>`, configures logging at cfg.log_level,
    and serves HTTP on cfg.host:cfg.port (SO_REUSEPORT when cfg.frontends > 1) once the
    engine at cfg.engine_address has answered.
    Exits non-zero (uvicorn's startup failure, status 3) if the engine does not answer
    within cfg.startup_timeout_s or the model folder cannot be read.
    """
    set_title(f"{PROCESS_TITLE}:{index}")
    die_with_parent()
    setup_logging(frontend_name(index), cfg.log_level)
    serve(create_app(cfg, index), cfg, index)


def main(argv: list[str] | None = None) -> None:
    """`python -m services.frontend.server [--setting value ...]` (the config's CLI flags)."""
    parser = argparse.ArgumentParser(prog="kestrel-frontend", description=__doc__)
    add_cli_arguments(parser)
    run_frontend(build_config(vars(parser.parse_args(argv))))


if __name__ == "__main__":
    main()
