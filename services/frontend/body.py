"""Request bodies: read within the size limit, and parsed as a JSON object.

`read_body` is shared by every API (the Anthropic routes included, whose envelope turns
the 413 into `request_too_large`). `json_object` is the plain parse of the routes that
have no protocol module of their own (/tokenize, /detokenize); the chat, completions and
messages bodies are parsed by openai_protocol / anthropic_protocol.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from services.frontend.errors import InvalidRequest, PayloadTooLarge


async def read_body(request: Request, limit: int) -> bytes:
    """The request body. Raises PayloadTooLarge (413) past `limit` bytes, checked on
    Content-Length and on the bytes actually received; starlette's ClientDisconnect when
    the client goes away while sending it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body ({declared} bytes) exceeds the limit of "
                              f"{limit} bytes.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


def json_object(raw: bytes) -> dict[str, Any]:
    """`raw` parsed as a JSON object. Raises InvalidRequest (400, no field) when it is not
    valid JSON or not an object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequest(None, "The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise InvalidRequest(None, "The request body must be a JSON object.")
    return body
