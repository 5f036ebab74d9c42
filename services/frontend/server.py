"""The frontend process: a starlette app served by uvicorn (docs/ARCHITECTURE.md §2, §7).

Startup order: connect to the engine and complete the handshake (Hello -> EngineInfo,
retried with a deadline of cfg.startup_timeout_s), load the tokenizer and chat template
from the engine's model_path, and only then bind cfg.host:cfg.port (uvicorn runs the ASGI
lifespan startup before it opens its listening socket). If the engine never answers, the
process exits non-zero.

The serving context (context.py: engine client, tokenizer, template, features, limits,
model name, metrics) is built once at startup, and from it each API's serving object
(`Servings`); the route table (`routes`) binds their methods.

Run alone: `python -m services.frontend.server --engine-address ipc://... --port 8000`
(the same flags as `kestrel`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from services.frontend.anthropic_api import ANY_METHOD, AnthropicServing
from services.frontend.anthropic_errors import AnthropicEnvelopeMiddleware
from services.frontend.auth import APIKeyMiddleware
from services.frontend.chat_api import ChatServing
from services.frontend.completions_api import CompletionsServing
from services.frontend.context import ServingContext, build_context
from services.frontend.engine_client import EngineClient
from services.frontend.errors import (APIError, InternalError, MethodNotAllowed, NotFound,
                                      error_response)
from services.frontend.info_api import InfoServing
from services.frontend.lifecycle import DrainMiddleware, beat_forever, frontend_name, serve
from services.frontend.structured_fields import warm_xgrammar
from services.frontend.responses_api import ResponsesServing
from services.frontend.tokenize_api import TokenizeServing
from shared.config import KestrelConfig, add_cli_arguments, build_config
from shared.liveness import Beacon
from shared.procutil import die_with_parent, set_title, setup_logging

log = logging.getLogger("kestrel.frontend")

PROCESS_TITLE = "kestrel:frontend"

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Servings:
    """The serving object of each API, built once at startup from one ServingContext."""

    context: ServingContext
    info: InfoServing
    chat: ChatServing
    completions: CompletionsServing
    tokenize: TokenizeServing
    anthropic: AnthropicServing
    responses: ResponsesServing

    @classmethod
    def build(cls, ctx: ServingContext, runtime_dir: str | None) -> Servings:
        """Every API's serving object on `ctx`. runtime_dir: cfg.runtime_dir (/metrics reads
        the supervisor's restart counts there)."""
        return cls(ctx, InfoServing(ctx, runtime_dir), ChatServing(ctx),
                   CompletionsServing(ctx), TokenizeServing(ctx), AnthropicServing(ctx),
                   ResponsesServing(ctx))


def _bind(name: str, method: Callable[[Servings], Handler]) -> Handler:
    """A route endpoint that calls `method(servings)` of the app's Servings (built at
    startup, in app.state.servings), e.g. `_bind("chat", lambda s: s.chat.chat_completions)`.
    The route table is built before the startup (so that it can be read without an
    engine); the serving objects exist from the startup on."""

    async def endpoint(request: Request) -> Response:
        return await method(request.app.state.servings)(request)

    endpoint.__name__ = name
    return endpoint


def routes(cfg: KestrelConfig) -> list[Route]:
    """The route table: each path bound to a method of its API's serving object."""
    table = [
        Route("/health", _bind("health", lambda s: s.info.health), methods=["GET"]),
        Route("/metrics", _bind("metrics", lambda s: s.info.metrics), methods=["GET"]),
        Route("/reset_prefix_cache",
              _bind("reset_prefix_cache", lambda s: s.info.reset_prefix_cache),
              methods=["POST"]),
        Route("/v1/models", _bind("list_models", lambda s: s.info.list_models),
              methods=["GET"]),
        Route("/v1/models/{model:path}", _bind("get_model", lambda s: s.info.get_model),
              methods=["GET"]),
        Route("/v1/chat/completions",
              _bind("chat_completions", lambda s: s.chat.chat_completions), methods=["POST"]),
        Route("/v1/completions",
              _bind("completions", lambda s: s.completions.completions), methods=["POST"]),
        Route("/v1/responses", _bind("responses", lambda s: s.responses.responses),
              methods=["POST"]),
        Route("/v1/messages", _bind("anthropic_messages", lambda s: s.anthropic.messages),
              methods=ANY_METHOD),
        Route("/v1/messages/count_tokens",
              _bind("anthropic_count_tokens", lambda s: s.anthropic.count_tokens),
              methods=ANY_METHOD),
        Route("/tokenize", _bind("tokenize", lambda s: s.tokenize.tokenize), methods=["POST"]),
        Route("/detokenize", _bind("detokenize", lambda s: s.tokenize.detokenize),
              methods=["POST"]),
        Route("/openapi.json", _bind("openapi", lambda s: s.info.openapi), methods=["GET"]),
        Route("/internal/stats", _bind("internal_stats", lambda s: s.info.internal_stats),
              methods=["GET"]),
    ]
    if cfg.debug_utilities:  # debug-only: the engine sleeps in a step (watchdog tests), and
        # speculation switched at runtime (benchmarks/spec_serve.py --one-server)
        table.append(Route("/debug/sleep", _bind("debug_sleep", lambda s: s.info.debug_sleep),
                           methods=["POST"]))
        table.append(Route("/debug/speculation",
                           _bind("debug_speculation", lambda s: s.info.debug_speculation),
                           methods=["POST"]))
    return table


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


def create_app(cfg: KestrelConfig, index: int = 0) -> Starlette:
    """The ASGI app of frontend `index` (named `frontend-<index>` to the engine and the
    watchdog). Its lifespan connects to the engine at cfg.engine_address (raising
    TimeoutError after cfg.startup_timeout_s without an answer), builds the serving context
    and every API's serving object once (`Servings`), beats the watchdog beacon, warms
    xgrammar in a background thread (its first import takes seconds and must not block
    the event loop on the first json_schema request), and closes the client at shutdown
    (lifecycle.py: draining)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        name = frontend_name(index)
        engine = EngineClient(cfg.engine_address, name=name)
        app.state.draining = False
        beats = asyncio.create_task(beat_forever(Beacon(cfg.runtime_dir, name)))
        threading.Thread(target=warm_xgrammar, name="xgrammar-warmup", daemon=True).start()
        try:
            ctx = await build_context(cfg, engine)
            app.state.servings = Servings.build(ctx, cfg.runtime_dir)
            app.state.end_requests = engine.end_requests  # the drain's timeout (lifecycle.py)
            log.info("serving %s on http://%s:%d", ctx.model_name, cfg.host, cfg.port)
            yield
        finally:
            beats.cancel()
            await engine.close()

    # Every route but /health and /metrics needs the key when one is set (auth.py).
    middleware = [Middleware(APIKeyMiddleware, api_key=cfg.api_key)] if cfg.api_key else []
    middleware.insert(0, Middleware(DrainMiddleware))  # 503 to everything while draining
    # Outermost: every error under /v1/messages in Anthropic's envelope (anthropic_errors.py).
    middleware.insert(0, Middleware(AnthropicEnvelopeMiddleware))
    return Starlette(routes=routes(cfg), lifespan=lifespan, middleware=middleware,
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
