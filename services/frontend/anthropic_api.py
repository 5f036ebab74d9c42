"""Anthropic Messages API routes: POST /v1/messages and POST /v1/messages/count_tokens.

Shapes follow Anthropic's API reference. A response is a `message` object with content
blocks (`thinking`, `text`, `tool_use`), `stop_reason` (end_turn, max_tokens, stop_sequence
with `stop_sequence` set, tool_use) and `usage` (input_tokens, output_tokens, and the cache
counts cache_creation_input_tokens / cache_read_input_tokens, 0: see `usage`). With
`stream: true` the answer is Server-Sent Events `event: <type>\\ndata: <JSON>\\n\\n` in the
documented order: message_start, ping, then per content block content_block_start,
content_block_delta (text_delta / thinking_delta / input_json_delta), content_block_stop,
then message_delta (stop_reason, stop_sequence, and the usage of the message: input_tokens,
output_tokens, cache_creation_input_tokens and cache_read_input_tokens) and message_stop; a
`ping` event is also sent every keepalive_s while waiting. The non-streaming content is built
from the same events as the stream, so both agree (a tool call cut by max_tokens included:
its input is the partial JSON closed, parsed with partial-json-parser if needed).

count_tokens renders system, tools and messages exactly as /v1/messages does and returns
{"input_tokens": N}, equal to that route's usage.input_tokens for the same body.

Errors use Anthropic's envelope (anthropic_errors.py; its middleware covers errors raised
outside these handlers): 400 invalid_request_error for a body that is not valid JSON (NaN /
Infinity tokens, strings with lone surrogates included) or fails validation, or whose
prompt + max_tokens exceeds the context ("prompt is too long: ..." when the prompt alone
leaves no room, else "max_tokens: N > room, ..."), 404 not_found_error, 413
request_too_large (bodies over --max-request-body-bytes), 500 api_error, 529
overloaded_error with a Retry-After header (engine busy or not answering). The engine's
refusal of a request maps by its error_kind, as on the OpenAI routes (`finish_error`):
"overloaded" (waiting queue full) is 529 overloaded_error + Retry-After, "invalid" (e.g. a
forced tool_use whose input_schema the engine cannot compile) is 400 invalid_request_error,
anything else 500 api_error. A stream awaits its first engine output (up to keepalive_s)
before it starts, so that a refusal is still an HTTP status; an error after the stream
started is an `error` event of the same type. Every response carries a `request-id`
header (`msg_...`, or `req_...` on count_tokens). The `x-api-key`, `anthropic-version` and
`anthropic-beta` headers are accepted (the key is checked by the server's auth, if set; the
others change nothing), and so is the `?beta=true` query of the SDK's beta client.

Structured output: `output_config.format` (anthropic_fields.py) is sent to the engine as its
grammar constraint, as OpenAI's response_format is; the text is then the JSON and nothing
else (no reasoning part, and no room for a tool call unless tool_choice forces one, whose
constraint then replaces the format).

Sampling: a temperature below 1e-5 is sent to the engine as 0.0 (greedy, as vLLM does) and a
top_p below 1e-6 as 1e-6 (openai_sampling's `engine_temperature` / `engine_top_p`); the
server's sampling defaults fill what the request does not set (anthropic_protocol.py).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from services.frontend.anthropic_blocks import Blocks, sse_event
from services.frontend.anthropic_errors import (anthropic_error_body, anthropic_error_response,
                                                new_request_id)
from services.frontend.anthropic_protocol import MessagesRequest, is_prefill, parse_messages_request
from services.frontend.body import read_body
from services.frontend.context import ServingContext
from services.frontend.engine_client import EngineUnavailable
from services.frontend.errors import (APIError, InternalError, InvalidRequest, NotFound,
                                      ServiceUnavailable, engine_error, error_headers)
from services.frontend.fanout import until_disconnect
from services.frontend.generation import TextDelta, generate
from services.frontend.guard import CLIENT_CLOSED
from services.frontend.openai_sampling import engine_temperature, engine_top_p
from services.frontend.parsers.output import STOP_STRING, Finish, OutEvent, run_parsed
from services.frontend.parsers.tool_choice import forced_call_constraint
from shared.protocol import FinishReason, SamplingParams

log = logging.getLogger("kestrel.frontend.anthropic")

# Routes take every method, so that a wrong one gets Anthropic's envelope (405).
ANY_METHOD = ["GET", "POST", "PUT", "PATCH", "DELETE"]
STOP_REASONS = {FinishReason.LENGTH: "max_tokens", STOP_STRING: "stop_sequence"}

# The request's text deltas (`generate`), and the parser's items made of them
# (`run_parsed`: event lists, None for keep-alive ticks, the Finish last).
Deltas = AsyncGenerator[TextDelta | None, None]
Items = AsyncIterator[list[OutEvent] | None | Finish]


def finish_error(fin: Finish) -> APIError:
    """The error of a response that ended with an engine error, by the engine's error_kind
    (as the OpenAI routes map it): "overloaded" (waiting queue full) -> Overloaded (529
    overloaded_error with Retry-After in Anthropic's envelope), "invalid" (the engine
    rejected the request, e.g. a forced tool call's schema it cannot compile) ->
    InvalidRequest (400 invalid_request_error), anything else -> InternalError (500
    api_error); `services.frontend.errors.engine_error`, shared with the OpenAI routes."""
    return engine_error(fin.error, fin.error_kind)


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    """The `usage` of a message, and of the final message_delta (the same four counts, as
    Anthropic's reference has them): the cache counts are 0, as no prompt tokens are
    billed or written as Anthropic's explicit cache (the engine's prefix cache is
    transparent), so input_tokens is the whole prompt (= count_tokens)."""
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def _error_event(err: APIError) -> bytes:
    """The SSE `error` event of `err` (in a stream that already started)."""
    _, body = anthropic_error_body(err.status, err.message)
    return sse_event("error", body)


class AnthropicServing:
    """The Anthropic routes, built once at startup from the serving context the OpenAI
    routes share (engine client, tokenizer, chat template, features: the tool and reasoning
    parsers, limits)."""

    def __init__(self, ctx: ServingContext):
        self.ctx = ctx
        self.engine = ctx.engine
        self.tokenizer = ctx.tokenizer
        self.template = ctx.template
        self.model_name = ctx.model_name
        self.max_model_len = ctx.limits.max_model_len
        self.keepalive_s = ctx.limits.keepalive_s
        self.features = ctx.features

    async def _read(self, request: Request, count_only: bool) -> MessagesRequest:
        if request.method != "POST":
            err = APIError(f"Method {request.method} is not allowed on {request.url.path}; use POST.")
            err.status = 405
            raise err
        # 413 past --max-request-body-bytes (the OpenAI routes' reader and limit)
        body = await read_body(request, self.ctx.limits.max_body_bytes,
                               self.ctx.limits.body_timeout_s)
        # parsing, rendering and tokenizing scale with the body: off the event loop
        return await asyncio.to_thread(parse_messages_request, body, count_only,
                                       self.ctx.defaults)

    def _render(self, req: MessagesRequest) -> tuple[str, list[int]]:
        if req.model != self.model_name:
            raise NotFound(f"model: {req.model} (this server serves {self.model_name})")
        if self.template is None:
            raise InternalError("The model has no chat template.")
        tools = req.tools if req.tool_choice != "none" and req.tools else None
        kwargs = self.features.template_kwargs() | {"enable_thinking": req.thinking.on}
        prefill = is_prefill(req.messages)  # the answer continues the final assistant text
        prompt = self.template.render(req.messages, add_generation_prompt=not prefill, tools=tools,
                                      continue_final_message=prefill, **kwargs)
        return prompt, self.tokenizer.encode(prompt)

    async def count_tokens(self, request: Request) -> Response:
        """POST /v1/messages/count_tokens: {"input_tokens": N}. Errors as /v1/messages (no
        engine involved: 400, 404, 413, 500); logs and headers name a `req_...` id."""
        request_id = new_request_id()
        try:
            req = await self._read(request, count_only=True)
            _, ids = await asyncio.to_thread(self._render, req)
            return Response(orjson.dumps({"input_tokens": len(ids)}),
                            media_type="application/json", headers={"request-id": request_id})
        except APIError as e:
            return self._error(request_id, e)
        except Exception:
            log.exception("%s (count_tokens) failed with an internal error", request_id)
            return anthropic_error_response(500, f"Internal error (request {request_id}).",
                                            request_id)

    def _check_length(self, n_prompt: int, max_tokens: int) -> None:
        """Raise InvalidRequest (400) when a prompt of n_prompt tokens and max_tokens do not
        fit in max_model_len: "prompt is too long" when the prompt leaves no room for one
        token, else a message naming max_tokens and the room the prompt leaves. (Anthropic's
        envelope has no field name: the message says which one is at fault.)"""
        room = self.max_model_len - n_prompt
        if room < 1:
            raise InvalidRequest("messages", f"prompt is too long: {n_prompt} tokens + "
                                 f"max_tokens {max_tokens} > {self.max_model_len} maximum")
        if max_tokens > room:
            raise InvalidRequest("max_tokens", f"max_tokens: {max_tokens} > {room}, the room "
                                 f"left after the {n_prompt}-token prompt (context "
                                 f"{self.max_model_len})")

    def _error(self, request_id: str, e: APIError) -> Response:
        """The response of `e` in Anthropic's envelope (503 -> 529 overloaded_error), with its
        `errors.error_headers` (Retry-After for ServiceUnavailable / Overloaded, Connection:
        close for a body timeout's 408)."""
        status = e.status
        if status >= 500:
            log.error("%s failed: %s", request_id, e.message)
        else:
            log.info("%s rejected (%d): %s", request_id, status, e.message)
        return anthropic_error_response(status, e.message, request_id, error_headers(e))

    async def messages(self, request: Request) -> Response:
        """POST /v1/messages (Anthropic Messages, streaming and not). Errors: 400 bad body,
        prompt too long or max_tokens past the room it leaves (`_check_length`), or refused
        by the engine as invalid; 404 unknown model, 413 body too large, 529 (Retry-After)
        engine unavailable or overloaded, 500 internal faults (logged with the request
        id). See `finish_error`."""
        request_id = f"msg_{uuid.uuid4().hex[:24]}"
        try:
            req = await self._read(request, count_only=False)
            prompt, ids = await asyncio.to_thread(self._render, req)
            n = len(ids)
            max_tokens = req.max_tokens
            assert max_tokens is not None  # parse_messages_request requires it here
            self._check_length(n, max_tokens)
            if req.max_tokens_cap is not None:  # the server's ceiling (--override-generation-config)
                max_tokens = min(max_tokens, req.max_tokens_cap)
            forced = req.tool_choice in ("any", "tool")
            # A forced call is the whole answer: output_config.format (which constrains
            # the text) has nothing to apply to then.
            sampling = SamplingParams(  # tiny temperature / top_p: as on the OpenAI routes
                temperature=engine_temperature(req.temperature),
                top_p=engine_top_p(req.top_p), top_k=req.top_k, min_p=req.min_p,
                repetition_penalty=req.repetition_penalty, max_tokens=max_tokens,
                structured=forced_call_constraint(req.tool_schemas, req.tool_name,
                                                  req.parallel_tool_use) if forced
                else req.output_format)
            parser = self.features.output_parser(
                prompt, req.stop_sequences, req.thinking.on,
                req.tool_schemas if req.tool_choice != "none" else None, forced,
                req.parallel_tool_use)
            stream = self.engine.open_request(request_id, ids, sampling,
                                              merge=not req.stop_sequences)
            gen = generate(self.engine, self.tokenizer, self.ctx.metrics, stream, ids, [],
                           tick_s=self.keepalive_s if req.stream else None, stop_probe=parser.stop_probe)
            log.info("%s added: %d prompt tokens, max_tokens %d, stream %s", request_id, n,
                     max_tokens, req.stream)
            events = run_parsed(gen, parser)
            blocks = Blocks(omit_thinking=req.thinking.omit_text)
            if req.stream:
                first = await self._first(gen, events)
                return StreamingResponse(self._stream(request_id, n, gen, events, first,
                                                      blocks),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache",
                                                  "request-id": request_id})
            return await self._complete(request, request_id, n, gen, events, blocks)
        except APIError as e:
            return self._error(request_id, e)
        except EngineUnavailable as e:
            log.warning("%s refused: %s", request_id, e)
            return anthropic_error_response(
                529, f"The engine is unavailable: {e}.", request_id,
                {"Retry-After": str(ServiceUnavailable.retry_after_s)})
        except Exception:
            log.exception("%s failed with an internal error", request_id)
            return anthropic_error_response(500, f"Internal error (request {request_id}).",
                                            request_id)

    def _message(self, request_id: str, content: list[dict[str, Any]], stop_reason: str | None,
                 stop_sequence: str | None, input_tokens: int, output_tokens: int) -> dict[str, Any]:
        return {"id": request_id, "type": "message", "role": "assistant",
                "model": self.model_name, "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": usage(input_tokens, output_tokens)}

    @staticmethod
    def _stop_reason(fin: Finish, blocks: Blocks) -> str:
        if fin.reason == FinishReason.STOP and blocks.has_tool_use():
            return "tool_use"
        return STOP_REASONS.get(fin.reason, "end_turn")

    async def _first(self, gen: Deltas, events: Items
                     ) -> asyncio.Future[list[OutEvent] | None | Finish]:
        """Start awaiting the first item of `events` and give it up to keepalive_s (the
        streamed `generate` ticks by then), so that an engine refusal of the request
        (`finish_error`) is raised here, before the stream starts: an HTTP error status.
        Returns the future of that item (maybe still pending) for `_stream`. On a refusal
        or a fault, `gen` is closed (the request released or aborted in the engine)."""
        first = asyncio.ensure_future(events.__anext__())
        try:
            await asyncio.wait({first}, timeout=self.keepalive_s)
            if first.done():
                item = first.result()  # a fault raises here: a 500 from the handler
                if isinstance(item, Finish) and item.error is not None:
                    raise finish_error(item)
        except BaseException:
            if not first.done():
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
            await gen.aclose()
            raise
        return first

    async def _stream(self, request_id: str, n_prompt: int, gen: Deltas, events: Items,
                      first: asyncio.Future[list[OutEvent] | None | Finish], blocks: Blocks
                      ) -> AsyncIterator[bytes]:
        """The SSE events of a streamed answer: `first` (from `_first`) is the first item
        of `events`; `blocks` (empty) builds the content blocks."""

        async def items() -> Items:
            yield await first
            async for it in events:
                yield it

        try:
            yield sse_event("message_start", {"type": "message_start", "message": self._message(
                request_id, [], None, None, n_prompt, 0)})
            yield sse_event("ping", {"type": "ping"})
            async for item in items():
                if item is None:
                    yield sse_event("ping", {"type": "ping"})
                elif isinstance(item, Finish):
                    if item.error is not None:
                        err = finish_error(item)
                        log.log(logging.ERROR if err.status >= 500 else logging.INFO,
                                "%s failed while streaming (%d): %s", request_id,
                                err.status, err.message)
                        yield _error_event(err)
                        return
                    out: list[bytes] = []
                    blocks.close(out)
                    for chunk in out:
                        yield chunk
                    yield sse_event("message_delta", {
                        "type": "message_delta",
                        "delta": {"stop_reason": self._stop_reason(item, blocks),
                                  "stop_sequence": item.stop_string},
                        "usage": usage(n_prompt, item.completion_tokens)})
                    yield sse_event("message_stop", {"type": "message_stop"})
                    return
                else:
                    for chunk in blocks.add(item):
                        yield chunk
        except Exception:
            log.exception("%s failed while streaming", request_id)
            yield _error_event(InternalError(f"Internal error (request {request_id})."))
        finally:
            if not first.done():
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
            await gen.aclose()
            self.engine.abort(request_id)  # no-op unless the request is still running

    async def _complete(self, request: Request, request_id: str, n_prompt: int,
                        gen: Deltas, events: Items, blocks: Blocks) -> Response:
        """Collect the whole answer into `blocks` (empty); abort the request if the client
        disconnects first."""

        async def collect() -> Finish:
            try:
                async for item in events:
                    if isinstance(item, Finish):
                        return item
                    if item is not None:
                        blocks.add(item)
                raise InternalError("The output ended without a finish reason.")
            finally:
                await gen.aclose()

        done, fin = await until_disconnect(request, collect())
        if not done:
            self.engine.abort(request_id)
            log.info("%s: client disconnected", request_id)
            return Response(status_code=CLIENT_CLOSED)
        assert fin is not None  # collect() returns a Finish or raises
        if fin.error is not None:
            raise finish_error(fin)
        reason = self._stop_reason(fin, blocks)
        body = self._message(request_id, blocks.final(), reason, fin.stop_string, n_prompt,
                             fin.completion_tokens)
        return Response(orjson.dumps(body), media_type="application/json",
                        headers={"request-id": request_id})
