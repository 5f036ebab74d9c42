"""The choices of one API request run as separate engine requests, merged into one stream.

`n > 1` (and several completions prompts) fan out as one engine request per choice, ids
`<request id>-<index>` (the bare request id when there is one choice): `fan_out` opens
them (after `check_choices` bounded their number). `FanOut` pumps each choice's `generate`
iterator in its own task (one choice: iterates it directly) and yields `(index,
TextDelta)` in arrival order, or None every `tick_s` seconds of silence (for SSE
keep-alives). Closing it cancels the pumps; each `generate` then aborts its request in the
engine if it had not finished. `collect` runs a FanOut to its end for a non-streaming
answer (sse.py streams one).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TypeVar

from starlette.requests import Request

from services.frontend.context import ServingContext
from services.frontend.engine_client import EngineUnavailable
from services.frontend.errors import APIError, InvalidRequest, engine_error
from services.frontend.generation import StopProbe, TextDelta, generate
from services.frontend.mailbox import Mailbox
from services.frontend.openai_sampling import SamplingRequest
from shared.protocol import FinishReason, SamplingParams, TokenLogprob

log = logging.getLogger("kestrel.frontend.openai")

T = TypeVar("T")
C = TypeVar("C", bound="Collected")

# A choice's deltas, as `generate` yields them (None: a keep-alive tick).
Deltas = AsyncGenerator[TextDelta | None, None]


class FanOut:
    """Merge per-choice TextDelta iterators. Iterate with `async for` (ends once every
    choice has yielded its final delta); always `await aclose()` at the end.

    One choice (the common case) is iterated directly, with no pump task and no queue: the
    iterator must then tick by itself (`generate(tick_s=...)`, which `fan_out` arranges),
    and `next`'s timeout is not used. Several choices are pumped in tasks into a mailbox.
    """

    def __init__(self, gens: list[Deltas], tick_s: float | None):
        self._tick_s = tick_s
        self._open = len(gens)
        self._single = gens[0] if len(gens) == 1 else None
        self._box: Mailbox[tuple[int, TextDelta]] = Mailbox()
        self._tasks = [] if self._single is not None else \
            [asyncio.ensure_future(self._pump(i, g)) for i, g in enumerate(gens)]

    async def _pump(self, index: int, gen: Deltas) -> None:
        try:
            async for d in gen:
                if d is not None:
                    self._box.put((index, d))
        except Exception as e:  # a fault in one choice fails that choice, visibly
            self._box.put((index, TextDelta("", FinishReason.ERROR, f"internal error: {e}")))
        finally:
            await gen.aclose()

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
                d = TextDelta("", FinishReason.ERROR, f"internal error: {e}")
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
            await self._single.aclose()
            return
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def delta_error(d: TextDelta) -> APIError:
    """The API error for a choice that ended with finish_reason "error" (`engine_error`)."""
    return engine_error(d.error, d.error_kind)


def check_choices(ctx: ServingContext, count: int, param: str) -> None:
    """Raise InvalidRequest(param) (400) when one request would open more than
    ctx.limits.max_choices engine requests: the engine's waiting queue could never take it
    whole, so it would get 503 + Retry-After on every retry."""
    bound = ctx.limits.max_choices
    if bound and count > bound:
        raise InvalidRequest(param, f"this request needs {count} sequences (prompts x n), more "
                                    f"than the server queues at once ({bound}, "
                                    "--max-num-waiting); send it in smaller batches")


def fan_out(ctx: ServingContext, request_id: str,
            choices: list[tuple[list[int], SamplingParams]], sampling: SamplingRequest,
            wrap: Callable[[int, Deltas], Deltas] | None = None,
            stop: list[str] | None = None,
            stop_probes: Sequence[Callable[[], StopProbe | None]] | None = None) -> FanOut:
    """Open one engine request per choice (prompt token ids, engine sampling; ids
    `<request_id>-<index>` when several) and merge their text deltas. wrap(index, deltas):
    an iterator to merge instead of the choice's `generate` (the chat route's output
    parsers). stop: the stop strings for `generate` (default sampling.stop). stop_probes: per
    choice, `generate`'s stop_probe (the output parser's stop strings, when `wrap` applies
    them). Raises EngineUnavailable (aborting those already opened)."""
    engine, keepalive_s = ctx.engine, ctx.limits.keepalive_s
    gens: list[Deltas] = []
    opened: list[str] = []
    stop = sampling.stop if stop is None else stop
    try:
        for i, (prompt_ids, params) in enumerate(choices):
            rid = request_id if len(choices) == 1 else f"{request_id}-{i}"
            # no stop strings (sampling.stop, also when an output parser checks them):
            # queued outputs may merge into one chunk under load
            stream = engine.open_request(rid, prompt_ids, params, merge=not sampling.stop)
            opened.append(rid)
            # one streamed choice ticks by itself (FanOut iterates it directly)
            tick = keepalive_s if sampling.stream and len(choices) == 1 else None
            gen = generate(engine, ctx.tokenizer, ctx.metrics, stream, prompt_ids, stop,
                           sampling.skip_special_tokens, tick_s=tick,
                           stop_probe=stop_probes[i] if stop_probes is not None else None)
            gens.append(wrap(i, gen) if wrap is not None else gen)
    except EngineUnavailable:
        for rid in opened:
            engine.abort(rid)
        raise
    return FanOut(gens, keepalive_s if sampling.stream else None)


async def until_disconnect(request: Request, aw: Awaitable[T]) -> tuple[bool, T | None]:
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


class Collected:
    """Everything one choice produced (non-streaming)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] = []
        self.final: TextDelta | None = None

    def add(self, d: TextDelta) -> None:
        """Take one delta of this choice (the final one included)."""
        self.parts.append(d.text)
        self.logprobs.extend(d.logprobs)
        if d.prompt_logprobs:
            self.prompt_logprobs = d.prompt_logprobs

    @property
    def text(self) -> str:
        """The choice's text so far."""
        return "".join(self.parts)


async def collect(request: Request, request_id: str, fan: FanOut, n: int,
                  make: Callable[[], C]) -> list[C] | None:
    """Run every choice of `fan` to its end (non-streaming), gathering each of the `n` in a
    `make()`. None when the client went away (the requests are then aborted). Raises the
    APIError of a failed choice (`delta_error`)."""

    async def run() -> list[C]:
        res = [make() for _ in range(n)]
        async for item in fan:
            if item is None:
                continue
            i, d = item
            c = res[i]
            c.add(d)
            if d.finish_reason is not None:
                c.final = d
                if d.error is not None:
                    raise delta_error(d)
        return res

    try:
        done, res = await until_disconnect(request, run())
    finally:
        await fan.aclose()
    if not done:
        log.info("%s: client disconnected", request_id)
        return None
    return res

