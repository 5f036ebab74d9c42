"""Anthropic's error envelope, and the middleware that keeps every error of the Anthropic
routes (`/v1/messages` and below) in it.

Envelope: {"type": "error", "error": {"type": <kind>, "message": <sentence>}} with the kinds
of Anthropic's API reference: invalid_request_error 400 (also other 4xx),
authentication_error 401, permission_error 403, not_found_error 404, request_too_large 413,
rate_limit_error 429, api_error 500, overloaded_error 529 (our 503: engine busy, not
answering, or the server draining).

The route handlers answer their own errors in this envelope. `AnthropicEnvelopeMiddleware`
covers what happens outside them: an error response written by another layer (the drain
middleware's 503, starlette's 404 for an unknown sub-path, any OpenAI-shaped body) is
rewritten into Anthropic's envelope, and an exception that escapes the app before the
response started becomes a logged 500 `api_error` (instead of starlette's OpenAI-shaped
500). Responses below 400 and error bodies already in the envelope pass untouched.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import orjson
from starlette.responses import Response

log = logging.getLogger("kestrel.frontend.anthropic")

ANTHROPIC_PREFIX = "/v1/messages"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    """Whether `path` is served by the Anthropic API (its envelope applies)."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def new_request_id() -> str:
    """An id for a request that has no message id (count_tokens, errors outside a route)."""
    return f"req_{uuid.uuid4().hex[:24]}"


def anthropic_error_body(status: int, message: str) -> tuple[int, dict[str, Any]]:
    """(HTTP status, Anthropic error envelope) for a status; 503 becomes 529 overloaded.
    A message that is not valid Unicode (it may quote the client's input) has its lone
    surrogates replaced, so the envelope can always be encoded."""
    if status == 503:
        status = 529
    kind = ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    message = message.encode("utf-8", "replace").decode("utf-8")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error_response(status: int, message: str, request_id: str | None = None,
                             headers: dict[str, str] | None = None) -> Response:
    """The HTTP response of an error on the Anthropic routes (`request-id` header when
    request_id is given; extra headers such as Retry-After)."""
    status, body = anthropic_error_body(status, message)
    headers = dict(headers or {})
    if request_id is not None:
        headers["request-id"] = request_id
    return Response(orjson.dumps(body), status_code=status, media_type="application/json",
                    headers=headers)


def _message_of(body: bytes, status: int) -> str | None:
    """The message of an error body in another envelope, or None if `body` already is
    Anthropic's envelope."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict):
        if doc.get("type") == "error" and isinstance(doc.get("error"), dict):
            return None
        err = doc.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
    return f"The request failed with HTTP status {status}."


class AnthropicEnvelopeMiddleware:
    """ASGI middleware (the outermost of the app's own): every error response on an
    Anthropic path is in Anthropic's envelope (see the module docstring). Buffers only error
    responses (small JSON bodies); other responses, streams included, pass through."""

    _KEEP_HEADERS = (b"retry-after", b"www-authenticate", b"request-id", b"connection")

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not is_anthropic_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        held: dict[str, Any] = {}  # the start message of an error response being rewritten
        body = bytearray()
        sent_start = False

        async def wrapped(message: dict) -> None:
            nonlocal sent_start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held.update(message)
                return
            if message["type"] == "http.response.body" and held:
                body.extend(message.get("body", b""))
                if message.get("more_body", False):
                    return
                await self._send_rewritten(send, held, bytes(body))
                sent_start = True
                return
            if message["type"] == "http.response.start":
                sent_start = True
            await send(message)

        try:
            await self.app(scope, receive, wrapped)
        except Exception:
            if sent_start:
                raise  # the response is under way: nothing can be said any more
            request_id = new_request_id()
            log.exception("%s failed on %s %s with an internal error", request_id,
                          scope.get("method"), scope.get("path"))
            response = anthropic_error_response(500, f"Internal error (request {request_id}).",
                                                request_id)
            await response(scope, receive, send)

    async def _send_rewritten(self, send, start: dict, body: bytes) -> None:
        status = start["status"]
        message = _message_of(body, status)
        if message is None:  # already Anthropic's envelope
            await send(start)
            await send({"type": "http.response.body", "body": body})
            return
        status, doc = anthropic_error_body(status, message)
        new_body = orjson.dumps(doc)
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() in self._KEEP_HEADERS]
        headers += [(b"content-type", b"application/json"),
                    (b"content-length", str(len(new_body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": new_body})
