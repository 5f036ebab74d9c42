"""Server-Sent Events of the OpenAI routes: framing, keep-alives, and the start of a stream.

Each event is `data: <JSON>\\n\\n`; a stream ends with `data: [DONE]\\n\\n`. While waiting,
a comment line `: keep-alive\\n\\n` goes out every keepalive_s seconds. A request is
validated completely before the first SSE byte, and `start_stream` awaits the first engine
output (up to keepalive_s) so that an engine refusal (overloaded: 503 + Retry-After,
invalid: 400) is an HTTP status too; a failure after that is sent as `data: {"error":
{...}}\\n\\n` followed by `data: [DONE]\\n\\n`. The chunk formats are the routes' own
(chat_api, completions_api); the Anthropic stream has its own framing (anthropic_api).

`SSEResponse` is a StreamingResponse that always watches for the client's disconnect (also
on ASGI 2.4 servers, where Starlette would notice only at the next write), so a request
whose client went away is cancelled, and aborted in the engine, at once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from services.frontend.errors import InternalError, error_body
from services.frontend.fanout import FanOut, delta_error, until_disconnect
from services.frontend.generation import TextDelta
from services.frontend.guard import CLIENT_CLOSED

log = logging.getLogger("kestrel.frontend.openai")

SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keep-alive\n\n"

# A stream's events: the first item (None when keepalive_s passed without one) and the
# rest of the FanOut -> SSE bytes, ending with SSE_DONE.
Events = Callable[[tuple[int, TextDelta] | None, FanOut], AsyncIterator[bytes]]


def sse(obj: Any) -> bytes:
    """One `data: <JSON>\\n\\n` event of `obj` (orjson)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def stream_items(first: tuple[int, TextDelta] | None, fan: FanOut
                       ) -> AsyncIterator[tuple[int, TextDelta] | bytes | None]:
    """The SSE loop's input: `first` (if any), then the items of `fan`. Yields (index,
    delta) to render; bytes to send as they are (a keep-alive comment); on a choice that
    failed, its error event and [DONE] as bytes, then None: the stream must end there."""
    async def items() -> AsyncIterator[tuple[int, TextDelta] | None]:
        if first is not None:
            yield first
        async for it in fan:
            yield it

    async for item in items():
        if item is None:
            yield SSE_KEEPALIVE
        elif item[1].error is not None:
            yield sse(error_body(delta_error(item[1])))
            yield SSE_DONE
            yield None
            return
        else:
            yield item


class SSEResponse(StreamingResponse):
    """text/event-stream that stops (cancelling its iterator) when the client disconnects."""

    def __init__(self, content: AsyncIterator[bytes]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def run(func: Callable[[], Awaitable[None]]) -> None:
                try:
                    await func()
                except OSError:  # the socket is gone: same as a disconnect
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(run, functools.partial(self.stream_response, send))
            await run(functools.partial(self.listen_for_disconnect, receive))


async def start_stream(request: Request, request_id: str, fan: FanOut, keepalive_s: float,
                       events: Events) -> Response:
    """Start an SSE response once the first output (or keepalive_s of silence) is in: an
    engine refusal on the first output is still an HTTP error status (raises its APIError,
    `delta_error`). `events` turns the first item and the rest of `fan` into SSE bytes (it
    ends with [DONE]); a fault in it ends the stream with an error event and [DONE].
    Returns CLIENT_CLOSED when the client went away before the first output."""
    try:
        done, first = await until_disconnect(request, fan.next(keepalive_s))
    except StopAsyncIteration:
        done, first = True, None
    except BaseException:
        await fan.aclose()
        raise
    if not done:
        await fan.aclose()
        log.info("%s: client disconnected before the first chunk", request_id)
        return Response(status_code=CLIENT_CLOSED)
    if first is not None and first[1].error is not None:
        await fan.aclose()
        raise delta_error(first[1])

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in events(first, fan):
                yield chunk
        except Exception:
            log.exception("%s failed while streaming", request_id)
            yield sse(error_body(InternalError(f"Internal error (request {request_id}).")))
            yield SSE_DONE
        finally:
            await fan.aclose()

    return SSEResponse(body())
