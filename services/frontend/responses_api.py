"""POST /v1/responses: OpenAI's Responses API, stateless, on the chat machinery.

The request (responses_protocol.py, responses_input.py) becomes chat-template messages,
rendered as /v1/chat/completions renders them (tools unless tool_choice is "none", the
tool-call format of `--tool-call-parser`, enable_thinking off for `reasoning.effort:
"none"`); the output goes through the same output parser (`--reasoning-parser`,
`--tool-call-parser`, or the `forced` parser when tool_choice is "required" or names a
function: the engine then constrains the output to the call JSON) and becomes `output`
items (responses_output.py): reasoning, message, function_call. Nothing is stored
(`store` is treated as false; `previous_response_id` is a 400).

Response (the SDK's `Response`): {"id": "resp_...", "object": "response", "created_at",
"status": "completed" | "incomplete" (max_output_tokens reached; incomplete_details
{"reason": "max_output_tokens"}), "output", "usage": {"input_tokens",
"input_tokens_details": {"cached_tokens"}, "output_tokens", "output_tokens_details":
{"reasoning_tokens": the reasoning text re-encoded}, "total_tokens"}, and the request's
settings echoed}.

Streaming (`stream: true`): Server-Sent Events `event: <type>\\ndata: <JSON>\\n\\n`, each
with a `sequence_number` from 0: response.created, response.in_progress, the items' events
(responses_output.py), then response.completed (or response.incomplete) with the whole
response. As on the chat route, the stream starts once the first engine output is in (up to
keepalive_s), so an engine refusal is still an HTTP error; a failure after that is an
`error` event {"code", "message", "param"} followed by response.failed (status "failed",
`error` {"code": "server_error" | "invalid_prompt", "message"}). `: keep-alive` comments
go out while waiting. There is no `data: [DONE]` (OpenAI's Responses streams end with
their terminal event).

Errors before any output: OpenAI's envelope (errors.py) through the guard: 400 bad body or
fields, prompt too long (code context_length_exceeded); 404 unknown model; 413 body too
large; 503 engine unavailable or overloaded (Retry-After); 500 internal faults.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from services.frontend.body import read_body
from services.frontend.chat_api import ChatDelta, parse_deltas
from services.frontend.context import ServingContext
from services.frontend.errors import (APIError, InternalError, InvalidRequest, context_error,
                                      model_not_found)
from services.frontend.fanout import Collected, Deltas, FanOut, collect, delta_error, fan_out
from services.frontend.generation import TextDelta
from services.frontend.guard import CLIENT_CLOSED, guard, json_response
from services.frontend.responses_output import OutputItems, response_object, usage
from services.frontend.responses_protocol import ResponsesRequest, parse_responses_request
from services.frontend.sse import SSE_KEEPALIVE, start_stream
from shared.protocol import FinishReason

log = logging.getLogger("kestrel.frontend.responses")


def _status(finish_reason: FinishReason | None) -> str:
    return "incomplete" if finish_reason == FinishReason.LENGTH else "completed"


class ResponsesCollected(Collected):
    """The output items of a non-streamed answer, built from the parser's events."""

    def __init__(self) -> None:
        super().__init__()
        self.output = OutputItems()

    def add(self, d: TextDelta) -> None:
        super().add(d)
        if isinstance(d, ChatDelta):
            self.output.add(d.events)


class ResponsesServing:
    """The /v1/responses route, built once at startup from the serving context (engine,
    tokenizer, template, limits, and `features`: the tool-call and reasoning parsers)."""

    def __init__(self, ctx: ServingContext):
        self.ctx = ctx
        self.features = ctx.features

    def _prepare(self, raw: bytes) -> tuple[ResponsesRequest, str, list[int], int]:
        """Parse the body and build the prompt: (request, prompt text, its token ids,
        max_tokens to send). Raises APIError. CPU work that grows with the body: run it off
        the event loop."""
        ctx = self.ctx
        req = parse_responses_request(raw, ctx.tokenizer.vocab_size, ctx.defaults)
        if req.model != ctx.model_name:
            raise model_not_found(req.model)
        if ctx.template is None:
            raise InternalError("The model has no chat template.")
        kwargs = self.features.template_kwargs() | {"enable_thinking": req.thinking}
        prompt = ctx.template.render(req.messages, add_generation_prompt=True,
                                     tools=req.tools.tools if req.tools.active else None,
                                     **kwargs)
        ids = ctx.tokenizer.encode(prompt)
        max_tokens, max_model_len = req.sampling.max_tokens, ctx.limits.max_model_len
        room = max_model_len - len(ids)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            err = context_error("input", max_model_len, len(ids), max_tokens, "input")
            if room >= 1:  # the prompt fits: the fault is max_output_tokens
                err.param = "max_output_tokens"
            raise err
        return req, prompt, ids, req.sampling.max_tokens_for(room)

    async def responses(self, request: Request) -> Response:
        """POST /v1/responses (streaming and not); errors as the module docstring says."""
        ctx = self.ctx
        response_id = f"resp_{uuid.uuid4().hex}"

        async def handle() -> Response:
            req, prompt, ids, max_tokens = await asyncio.to_thread(
                self._prepare, await read_body(request, ctx.limits.max_body_bytes, ctx.limits.body_timeout_s))
            sr, tools = req.sampling, req.tools

            def wrap(index: int, gen: Deltas) -> Deltas:
                return parse_deltas(gen, self.features.output_parser(
                    prompt, [], req.thinking, tools.schemas if tools.active else None,
                    tools.forced, tools.parallel))

            fan = fan_out(ctx, response_id, [(ids, sr.to_params(max_tokens, 0))], sr,
                          wrap=wrap, stop=[])
            log.info("%s added: %d prompt tokens, max_output_tokens %d, stream %s, tools %d "
                     "(%s)", response_id, len(ids), max_tokens, sr.stream, len(tools.tools),
                     tools.choice)
            created = int(time.time())
            if sr.stream:
                return await start_stream(
                    request, response_id, fan, ctx.limits.keepalive_s,
                    lambda first, f: self._events(response_id, created, req, len(ids),
                                                  first, f))
            res = await collect(request, response_id, fan, 1, ResponsesCollected)
            if res is None:
                return Response(status_code=CLIENT_CLOSED)
            c = res[0]
            status = _status(c.final.finish_reason if c.final else None)
            c.output.finish(status)
            n_out = c.final.completion_tokens if c.final else 0
            return json_response(response_object(
                response_id, created, ctx.model_name, req.echo, status, c.output.items,
                self._usage(len(ids), n_out, c.output)))

        return await guard(response_id, handle)

    def _usage(self, n_prompt: int, n_out: int, output: OutputItems) -> dict[str, Any]:
        reasoning = len(self.ctx.tokenizer.encode(output.reasoning)) if output.reasoning else 0
        return usage(n_prompt, n_out, reasoning)

    async def _events(self, response_id: str, created: int, req: ResponsesRequest,
                      n_prompt: int, first: tuple[int, TextDelta] | None, fan: FanOut
                      ) -> AsyncIterator[bytes]:
        """The SSE events of a streamed answer (see the module docstring). first: the first
        item of `fan` (None when keepalive_s passed without one)."""
        seq = itertools.count()
        model, echo = self.ctx.model_name, req.echo

        def event(obj: dict[str, Any]) -> bytes:
            obj["sequence_number"] = next(seq)
            return (b"event: " + obj["type"].encode() + b"\ndata: " + orjson.dumps(obj)
                    + b"\n\n")

        def failed(err: APIError, output: list[dict[str, Any]]) -> list[bytes]:
            code = "invalid_prompt" if isinstance(err, InvalidRequest) else "server_error"
            log.log(logging.ERROR if err.status >= 500 else logging.INFO,
                    "%s failed while streaming (%d): %s", response_id, err.status, err.message)
            return [event({"type": "error", "code": code, "message": err.message,
                           "param": err.param}),
                    event({"type": "response.failed", "response": response_object(
                        response_id, created, model, echo, "failed", output,
                        error={"code": code, "message": err.message})})]

        async def items() -> AsyncIterator[tuple[int, TextDelta] | None]:
            if first is not None:
                yield first
            async for it in fan:
                yield it

        start = response_object(response_id, created, model, echo, "in_progress", [])
        yield event({"type": "response.created", "response": start})
        yield event({"type": "response.in_progress", "response": start})
        out = OutputItems()
        try:
            async for item in items():
                if item is None:
                    yield SSE_KEEPALIVE
                    continue
                d = item[1]
                if d.error is not None:
                    for chunk in failed(delta_error(d), out.items):
                        yield chunk
                    return
                for e in out.add(d.events if isinstance(d, ChatDelta) else []):
                    yield event(e)
                if d.finish_reason is not None:
                    status = _status(d.finish_reason)
                    for e in out.finish(status):
                        yield event(e)
                    yield event({"type": f"response.{status}", "response": response_object(
                        response_id, created, model, echo, status, out.items,
                        self._usage(n_prompt, d.completion_tokens, out))})
                    return
        except Exception:
            log.exception("%s failed while streaming", response_id)
            for chunk in failed(InternalError(f"Internal error (request {response_id})."),
                                out.items):
                yield chunk
