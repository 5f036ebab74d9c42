"""The request guard of the OpenAI-shaped routes: one place that turns what a handler
raises into the response (docs/ARCHITECTURE.md §7).

A client's mistake (APIError below 500) is logged at INFO and answered with its status and
OpenAI's envelope; an APIError of 500 or more is logged as an error; EngineUnavailable is
a 503 with Retry-After; a client that went away while sending its body gets CLIENT_CLOSED
(nobody reads it); any other exception is a logged 500 naming the request id. The
Anthropic routes keep their own envelope (anthropic_api.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from services.frontend.engine_client import EngineUnavailable
from services.frontend.errors import APIError, InternalError, ServiceUnavailable, error_response

log = logging.getLogger("kestrel.frontend.openai")

CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; nobody reads it


def json_response(obj: Any, status: int = 200) -> Response:
    """`obj` as an application/json response (orjson), with HTTP status `status`."""
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


async def guard(request_id: str, handler: Callable[[], Awaitable[Response]]) -> Response:
    """Run a route handler; map APIError / EngineUnavailable / faults to responses (see the
    module docstring). Never raises, except for cancellation."""
    try:
        return await handler()
    except APIError as e:
        if e.status >= 500:
            log.error("%s failed: %s", request_id, e.message)
        else:
            log.info("%s rejected (%d, %s): %s", request_id, e.status, e.param, e.message)
        return error_response(e)
    except EngineUnavailable as e:
        log.warning("%s refused: %s", request_id, e)
        return error_response(ServiceUnavailable(f"The engine is unavailable: {e}."))
    except ClientDisconnect:
        log.info("%s: client disconnected while sending the body", request_id)
        return Response(status_code=CLIENT_CLOSED)
    except Exception:
        log.exception("%s failed with an internal error", request_id)
        return error_response(InternalError(f"Internal error (request {request_id})."))
