"""API key check of the frontend (issue 7, security defaults).

With `--api-key KEY` (or `KESTREL_API_KEY`, read by the config builder), every HTTP route
requires the key, except `/health` and `/metrics` (and only those two). The key is accepted
as `Authorization: Bearer KEY` or as `x-api-key: KEY`, and compared in constant time
(`hmac.compare_digest` on UTF-8 bytes). A missing or wrong key gets 401 in the route's own
envelope:
- Anthropic routes (`/v1/messages` and below):
  `{"type": "error", "error": {"type": "authentication_error", "message": ...}}`
- every other route (OpenAI's envelope):
  `{"error": {"message": ..., "type": "authentication_error", "param": null,
  "code": "invalid_api_key"}}`
It is a pure ASGI middleware, so streaming responses pass through untouched.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any
from collections.abc import Awaitable, Callable

import orjson

from services.frontend.anthropic_errors import is_anthropic_path

log = logging.getLogger("kestrel.frontend.auth")

OPEN_PATHS = frozenset({"/health", "/metrics"})

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]],
                   Awaitable[None]]


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request presents: `Authorization: Bearer KEY`, else `x-api-key: KEY`."""
    bearer = api_key = None
    for name, value in headers:
        name = name.lower()
        if name == b"authorization" and bearer is None:
            scheme, _, rest = value.strip().partition(b" ")
            if scheme.lower() == b"bearer":
                bearer = rest.strip()
        elif name == b"x-api-key" and api_key is None:
            api_key = value.strip()
    return bearer if bearer is not None else api_key


def auth_error_body(path: str, message: str) -> dict[str, Any]:
    """The 401 body for `path` in its API's envelope (Anthropic or OpenAI)."""
    if is_anthropic_path(path):
        return {"type": "error", "error": {"type": "authentication_error", "message": message}}
    return {"error": {"message": message, "type": "authentication_error", "param": None,
                      "code": "invalid_api_key"}}


class APIKeyMiddleware:
    """Reject HTTP requests without the right key (see the module docstring).

    app: the ASGI app to protect. api_key: the key (non-empty)."""

    def __init__(self, app: ASGIApp, api_key: str):
        if not api_key:
            raise ValueError("setting api_key: must not be empty")
        self.app = app
        self._key = api_key.encode()

    def check(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """None when the key is right, else the message for the client."""
        got = presented_key(headers)
        if got is None:
            return ("Missing API key: send it as 'Authorization: Bearer <key>' or "
                    "'x-api-key: <key>'.")
        # compare_digest is constant-time in the contents (lengths may differ: it then
        # returns False, still without an early exit on the first differing byte).
        if not hmac.compare_digest(got, self._key):
            return "Invalid API key."
        return None

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path", "") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        message = self.check(scope.get("headers") or [])
        if message is None:
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        log.info("401 on %s %s: %s", scope.get("method"), path, message)
        body = orjson.dumps(auth_error_body(path, message))
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
