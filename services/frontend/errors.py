"""Typed API errors of the frontend and OpenAI's error envelope.

A client's mistake is raised as one of these at the edge (request parsing, model lookup,
chat template, length checks); `error_response` turns it into the HTTP response and
`error_body` into the JSON object of an SSE error event. Both follow OpenAI's envelope:

    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}

Messages are plain sentences for the client: no Python reprs, no tracebacks.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from shared.protocol import ErrorKind


class APIError(Exception):
    """An error that ends one request with an HTTP status and OpenAI's envelope.

    status: HTTP status code. type / code: OpenAI's `error.type` and `error.code`.
    param: the request field at fault (dotted path such as "messages.0.role"), or None.
    """

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class InvalidRequest(APIError):
    """A bad request (invalid JSON, a missing or bad field, a prompt too long): HTTP 400."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, param: str | None, message: str, *, code: str | None = None):
        super().__init__(message, param=param, code=code)


class NotFound(APIError):
    """An unknown model or route: HTTP 404, type invalid_request_error (as OpenAI answers
    for an unknown model, with code "model_not_found")."""

    status = 404
    type = "invalid_request_error"


class MethodNotAllowed(APIError):
    """A known route called with the wrong HTTP method: HTTP 405."""

    status = 405
    type = "invalid_request_error"


class ServiceUnavailable(APIError):
    """The engine is not answering or dropped the request: HTTP 503 with a Retry-After
    header (seconds)."""

    status = 503
    type = "service_unavailable"
    retry_after_s = 2


class PayloadTooLarge(APIError):
    """A request body over cfg.max_request_body_bytes: HTTP 413."""

    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RequestTimeout(APIError):
    """A request body that did not arrive within cfg.body_timeout seconds: HTTP 408, and the
    connection is closed after the answer (`Connection: close`: the rest of the body is
    never read)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class Overloaded(ServiceUnavailable):
    """The engine's waiting queue is full: HTTP 503 with a Retry-After header (seconds)."""

    code = "overloaded"
    retry_after_s = 1


class InternalError(APIError):
    """A fault inside Kestrel (engine error, bug): HTTP 500, type server_error."""

    status = 500
    type = "server_error"


def engine_error(error: str | None, error_kind: ErrorKind | None) -> APIError:
    """The API error of a request the engine ended with an error, by its error_kind:
    "overloaded" (waiting queue full) -> Overloaded (503 / Anthropic's 529, Retry-After),
    "unavailable" (the engine went away: a restart, a shutdown, or this frontend lost it) ->
    ServiceUnavailable (503 / 529, Retry-After), "invalid" (the engine rejected the request)
    -> InvalidRequest (400), anything else (None: internal) -> InternalError (500)."""
    if error_kind == ErrorKind.OVERLOADED:
        return Overloaded(f"The server is overloaded ({error}); retry later.")
    if error_kind == ErrorKind.UNAVAILABLE:
        return ServiceUnavailable(f"The server is unavailable ({error}); retry later.")
    if error_kind == ErrorKind.INVALID:
        return InvalidRequest(None, f"The engine rejected the request: {error}")
    return InternalError(f"The request failed: {error}")


def model_not_found(model: str) -> NotFound:
    """The error OpenAI returns for an unknown `model` (404, code model_not_found)."""
    return NotFound(f"The model `{model}` does not exist.", param="model", code="model_not_found")


def context_error(param: str, max_model_len: int, n_prompt: int, max_tokens: int | None,
                  what: str) -> InvalidRequest:
    """The 400 (code context_length_exceeded, naming `param`) for a prompt of n_prompt
    tokens (+ max_tokens) that does not fit in max_model_len tokens; `what` names the prompt
    in the message ("messages", "prompt")."""
    asked = (f"{n_prompt + max_tokens} tokens ({n_prompt} in the {what}, {max_tokens} in "
             "the completion)" if max_tokens else f"{n_prompt} tokens in the {what}")
    return InvalidRequest(param, f"This model's maximum context length is {max_model_len} "
                          f"tokens. However, you requested {asked}. Please reduce the length "
                          f"of the {what} or completion.", code="context_length_exceeded")


def error_body(err: APIError) -> dict[str, Any]:
    """OpenAI's error envelope for `err` as a dict (also the payload of an SSE error event)."""
    return {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.code}}


def error_headers(err: APIError) -> dict[str, str] | None:
    """The headers an error's response carries in every API's envelope: Retry-After
    (seconds) for ServiceUnavailable and Overloaded, Connection: close for RequestTimeout."""
    if isinstance(err, ServiceUnavailable):
        return {"Retry-After": str(err.retry_after_s)}
    if isinstance(err, RequestTimeout):
        return {"Connection": "close"}
    return None


def error_response(err: APIError) -> Response:
    """The HTTP response for `err`: its status, the JSON envelope and `error_headers`."""
    return Response(orjson.dumps(error_body(err)), status_code=err.status,
                    media_type="application/json", headers=error_headers(err))
