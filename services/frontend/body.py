"""Request bodies: read within the size limit and the body timeout, and parsed as a JSON
object.

`read_body` is shared by every API (the Anthropic routes included, whose envelope turns
the 413 into `request_too_large`, and the 408 into its `invalid_request_error`). uvicorn
times out neither a body nor a request (only idle kept-alive connections), and the header
guard (header_guard.py) stops at the end of the headers: a client that sends its headers
and then a part of its body would hold its connection and handler forever. So the whole
body must arrive within `timeout_s` of the handler starting to read it (right after the
headers; docs/ARCHITECTURE.md §8.6), else RequestTimeout: 408 in the API's envelope with
`Connection: close`, on which uvicorn closes the connection. `json_object` is the plain parse of the routes that
have no protocol module of their own (/tokenize, /detokenize); the chat, completions and
messages bodies are parsed by openai_protocol / anthropic_protocol.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import Request

from services.frontend.errors import InvalidRequest, PayloadTooLarge, RequestTimeout
from services.frontend.strict_json import BODY_TOO_DEEP


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body. Raises PayloadTooLarge (413) past `limit` bytes, checked on
    Content-Length and on the bytes actually received; RequestTimeout (408) when the whole
    body has not arrived `timeout_s` seconds after this call (module docstring);
    starlette's ClientDisconnect when the client goes away while sending it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"The request body ({declared} bytes) exceeds the limit of "
                              f"{limit} bytes.")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes.")
                chunks.append(chunk)
    except TimeoutError:
        of = f" of {declared}" if declared is not None else ""
        raise RequestTimeout(f"The request body was not received within {timeout_s:g} s "
                             f"({size}{of} bytes arrived).") from None
    return b"".join(chunks)


def json_object(raw: bytes) -> dict[str, Any]:
    """`raw` parsed as a JSON object. Raises InvalidRequest (400, no field) when it is not
    valid JSON, nested past orjson's 1024 levels ("nested too deeply") or not an object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if "depth limit" in str(e):  # orjson's 1024 levels
            raise InvalidRequest(None, BODY_TOO_DEEP) from None
        raise InvalidRequest(None, "The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise InvalidRequest(None, "The request body must be a JSON object.")
    return body
