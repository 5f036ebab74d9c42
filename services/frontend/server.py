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
import contextlib
import logging
from typing import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from services.frontend.chat_template import ChatTemplate
from services.frontend.engine_client import EngineClient
from services.frontend.errors import (APIError, InternalError, MethodNotAllowed, NotFound,
                                      error_response)
from services.frontend.openai_api import OpenAIServing
from services.frontend.tokenizer import Tokenizer
from shared.config import KestrelConfig, add_cli_arguments, build_config
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


async def _build_serving(cfg: KestrelConfig, engine: EngineClient) -> OpenAIServing:
    """Handshake with the engine, then load the tokenizer and chat template it names."""
    info = await engine.connect(cfg.startup_timeout_s)
    tokenizer = Tokenizer(info.model_path)
    template = None
    if tokenizer.chat_template is None:
        log.warning("model at %s has no chat template; chat completions will fail",
                    info.model_path)
    else:
        try:
            template = ChatTemplate(tokenizer.chat_template, tokenizer.special_tokens)
        except ValueError as e:
            log.error("%s; chat completions will fail", e)
    name = cfg.served_model_name or info.model_name
    return OpenAIServing(engine, tokenizer, template, name, info.max_model_len, cfg.keepalive_s)


def create_app(cfg: KestrelConfig) -> Starlette:
    """The ASGI app. Its lifespan connects to the engine at cfg.engine_address (raising
    TimeoutError after cfg.startup_timeout_s without an answer) and closes the client at
    shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine = EngineClient(cfg.engine_address, name=f"frontend@{cfg.host}:{cfg.port}")
        try:
            app.state.serving = await _build_serving(cfg, engine)
            log.info("serving %s on http://%s:%d", app.state.serving.model_name, cfg.host,
                     cfg.port)
            yield
        finally:
            await engine.close()

    routes = [
        Route("/health", _endpoint("health"), methods=["GET"]),
        Route("/v1/models", _endpoint("list_models"), methods=["GET"]),
        Route("/v1/models/{model:path}", _endpoint("get_model"), methods=["GET"]),
        Route("/v1/chat/completions", _endpoint("chat_completions"), methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: _http_error, Exception: _internal_error})


def run_frontend(cfg: KestrelConfig) -> None:
    """Run the frontend process until SIGINT/SIGTERM.

    Sets the process title `kestrel:frontend`, configures logging at cfg.log_level, and
    serves HTTP on cfg.host:cfg.port once the engine at cfg.engine_address has answered.
    Exits non-zero (uvicorn's startup failure, status 3) if the engine does not answer
    within cfg.startup_timeout_s or the model folder cannot be read.
    """
    set_title(PROCESS_TITLE)
    die_with_parent()
    setup_logging("frontend", cfg.log_level)
    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_config=None,
                log_level=cfg.log_level.lower(), timeout_keep_alive=30,
                timeout_graceful_shutdown=5)


def main(argv: list[str] | None = None) -> None:
    """`python -m services.frontend.server [--setting value ...]` (the config's CLI flags)."""
    parser = argparse.ArgumentParser(prog="kestrel-frontend", description=__doc__)
    add_cli_arguments(parser)
    run_frontend(build_config(vars(parser.parse_args(argv))))


if __name__ == "__main__":
    main()
