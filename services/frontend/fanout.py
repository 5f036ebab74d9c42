"""The choices of one API request run as separate engine requests, merged into one stream.

`n > 1` (and several completions prompts) fan out as one engine request per choice, ids
`<request id>-<index>` (the bare request id when there is one choice). `FanOut` pumps each
choice's `generate` iterator in its own task (one choice: iterates it directly) and yields
`(index, TextDelta)` in arrival order, or None every `tick_s` seconds of silence (for SSE
keep-alives). Closing it cancels
the pumps; each `generate` then aborts its request in the engine if it had not finished.

`SSEResponse` is a StreamingResponse that always watches for the client's disconnect (also
on ASGI 2.4 servers, where Starlette would notice only at the next write), so a request
whose client went away is cancelled, and aborted in the engine, at once.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.frontend.generation import TextDelta
from services.frontend.mailbox import Mailbox


class FanOut:
    """Merge per-choice TextDelta iterators. Iterate with `async for` (ends once every
    choice has yielded its final delta); always `await aclose()` at the end.

    One choice (the common case) is iterated directly, with no pump task and no queue: the
    iterator must then tick by itself (`generate(tick_s=...)`, which `fan_out` arranges),
    and `next`'s timeout is not used. Several choices are pumped in tasks into a mailbox.
    """

    def __init__(self, gens: list[AsyncIterator[TextDelta | None]], tick_s: float | None):
        self._tick_s = tick_s
        self._open = len(gens)
        self._single = gens[0] if len(gens) == 1 else None
        self._box: Mailbox[tuple[int, TextDelta]] = Mailbox()
        self._tasks = [] if self._single is not None else \
            [asyncio.ensure_future(self._pump(i, g)) for i, g in enumerate(gens)]

    async def _pump(self, index: int, gen: AsyncIterator[TextDelta | None]) -> None:
        try:
            async for d in gen:
                if d is not None:
                    self._box.put((index, d))
        except Exception as e:  # a fault in one choice fails that choice, visibly
            self._box.put((index, TextDelta("", "error", f"internal error: {e}")))
        finally:
            await gen.aclose()  # type: ignore[attr-defined]

    async def next(self, timeout: float | None) -> tuple[int, TextDelta] | None:
        """The next delta, or None after `timeout` seconds without one (one choice: when
        its iterator ticks). After the last final delta, raises StopAsyncIteration."""
        if self._open == 0:
            raise StopAsyncIteration
        if self._single is not None:
            try:
                d = await self._single.__anext__()
            except StopAsyncIteration:
                self._open = 0
                raise
            except Exception as e:  # a fault in the choice fails it, visibly (as _pump)
                d = TextDelta("", "error", f"internal error: {e}")
            if d is None:
                return None
            item = (0, d)
        else:
            try:
                item = await self._box.get(timeout)
            except TimeoutError:
                return None
        if item[1].finish_reason is not None:
            self._open -= 1
        return item

    def __aiter__(self) -> "FanOut":
        return self

    async def __anext__(self) -> tuple[int, TextDelta] | None:
        return await self.next(self._tick_s)

    async def aclose(self) -> None:
        """Cancel the pumps (aborting unfinished requests in the engine) and wait for them;
        one choice: close its iterator (which aborts it the same way)."""
        if self._single is not None:
            await self._single.aclose()  # type: ignore[attr-defined]
            return
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def until_disconnect(request: Request, aw) -> tuple[bool, object]:
    """Run awaitable `aw` until it finishes or the client disconnects.

    Returns (True, result) when it finished (its exception propagates), or (False, None)
    when the client went away first (then `aw` has been cancelled). The request body must
    already have been read."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        return False, None
    return True, work.result()


class SSEResponse(StreamingResponse):
    """text/event-stream that stops (cancelling its iterator) when the client disconnects."""

    def __init__(self, content: AsyncIterator[bytes]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:

            async def run(func) -> None:
                try:
                    await func()
                except OSError:  # the socket is gone: same as a disconnect
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(run, functools.partial(self.stream_response, send))
            await run(functools.partial(self.listen_for_disconnect, receive))
