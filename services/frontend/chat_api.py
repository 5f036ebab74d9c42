"""POST /v1/chat/completions: OpenAI's Chat Completions API, with tool calls and reasoning.

The prompt is the chat template rendered with the request's messages, its `tools` (unless
tool_choice is "none"; through `tool_prompt.py`'s fallback when the template cannot render
them), the tool-call format of `--tool-call-parser` and `chat_template_kwargs`. Each choice's text goes through its own output parser
(`parsers/output.py`): the `--reasoning-parser` splits off the reasoning (when
`chat_template_kwargs.enable_thinking` is not false), stop strings apply to the content
only, and the `--tool-call-parser` (or the `forced` parser, when tool_choice is "required"
or names a tool and the engine constrains the output to the call JSON) turns calls into
`tool_calls`. Without reasoning, stop strings are applied by `generation.generate` as for
any other request (the same thing: everything is content).

Response (OpenAI API reference): `chat.completion` with per choice `message` {"role":
"assistant", "content" (null when the message is only tool calls), "reasoning_content"
(vLLM's field, present when there is reasoning), "tool_calls": [{"id", "type": "function",
"function": {"name", "arguments": JSON text}}] (absent when empty)} and finish_reason
"tool_calls" when an answer that ended by itself made calls ("length" when cut by max_tokens; "stop"
when EOS or a stop string ended it inside a call, closed at a prefix: `ToolCallCut`).
Streaming (`chat.completion.chunk`): a role chunk per choice, then deltas `reasoning_content`,
`content` and `tool_calls: [{"index", "id", "type", "function": {"name", "arguments": ""}}]`
at a call's start and `tool_calls: [{"index", "function": {"arguments": piece}}]` after;
per call index the argument pieces concatenate to the non-streaming arguments, valid JSON.
Then the finish chunk, the usage chunk (stream_options.include_usage) and `data: [DONE]`.
With stream_options.continuous_usage_stats (and include_usage; vLLM's extension) every chunk
carries `usage` {prompt_tokens, completion_tokens of its choice so far, total_tokens}
instead of null.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from services.frontend.body import read_body
from services.frontend.context import ServingContext
from services.frontend.errors import InternalError, context_error, model_not_found
from services.frontend.fanout import (Collected, Deltas, FanOut, check_choices, collect,
                                      fan_out)
from services.frontend.generation import TextDelta, end_by_stop_string
from services.frontend.guard import CLIENT_CLOSED, guard, json_response
from services.frontend.sse import SSE_DONE, sse, start_stream, stream_items
from services.frontend.openai_protocol import ChatCompletionRequest, parse_chat_request
from services.frontend.parsers.output import (ChatOutputParser, OutEvent, ParsedMessage,
                                              Reasoning)
from services.frontend.parsers.tool_parsers import Content, ToolCallArgs, ToolCallCut, ToolCallStart
from shared.protocol import FinishReason, TokenLogprob

log = logging.getLogger("kestrel.frontend.chat")


@dataclass
class ChatDelta(TextDelta):
    """A TextDelta whose text has been parsed: `events` (reasoning, content, tool calls)
    replace `text` (always '')."""

    events: list[OutEvent] = field(default_factory=list)


async def parse_deltas(gen: Deltas, parser: ChatOutputParser) -> Deltas:
    """Follow `generation.generate` and yield ChatDeltas (errors pass through unchanged).
    When the parser's stop string matched, `gen` is ended with `end_by_stop_string` (the
    request stops in the engine, and finishes as "stop") and the last delta has
    finish_reason "stop"."""
    try:
        async for d in gen:
            if d is None or d.error is not None:
                yield d
                if d is not None:
                    return
                continue
            events = parser.feed(d.text) if d.text else []
            reason = d.finish_reason
            if parser.stopped is not None:
                reason = FinishReason.STOP
                await end_by_stop_string(gen, parser.stopped)
            elif reason is not None:
                events += parser.finish()
            yield ChatDelta("", reason, None, d.prompt_tokens, d.completion_tokens, None,
                            d.logprobs, d.prompt_logprobs, events=events)
            if reason is not None:
                return
    finally:
        await gen.aclose()


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _finish_reason(reason: FinishReason | None, has_calls: bool, cut: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" for an answer that ended by itself with calls,
    unless it ended inside its last call (cut: EOS or a stop string in the call's text; the
    call is closed at a prefix, so the answer is no finished call: "stop")."""
    return "tool_calls" if reason == FinishReason.STOP and has_calls and not cut else reason


class ChatCollected(Collected):
    """One choice's parsed message (non-streaming)."""

    def __init__(self) -> None:
        super().__init__()
        self.message = ParsedMessage()

    def add(self, d: TextDelta) -> None:
        super().add(d)
        if isinstance(d, ChatDelta):
            self.message.add(d.events)

    def as_message(self) -> dict[str, Any]:
        m = self.message
        msg: dict[str, Any] = {"role": "assistant",
                               "content": m.content if m.content or not m.calls else None}
        if m.reasoning:
            msg["reasoning_content"] = m.reasoning
        if m.calls:
            msg["tool_calls"] = [{"id": _call_id(), "type": "function",
                                  "function": {"name": name, "arguments": args or "{}"}}
                                 for name, args in m.calls]
        return msg


def _event_deltas(events: list[OutEvent], args_seen: set[int]) -> list[dict[str, Any]]:
    """The chunk deltas of parser events (one per event). args_seen: call indices that got
    argument text (updated)."""
    out: list[dict[str, Any]] = []
    for e in events:
        if isinstance(e, Reasoning):
            out.append({"reasoning_content": e.text})
        elif isinstance(e, Content):
            out.append({"content": e.text})
        elif isinstance(e, ToolCallStart):
            out.append({"tool_calls": [{"index": e.index, "id": _call_id(), "type": "function",
                                        "function": {"name": e.name, "arguments": ""}}]})
        elif isinstance(e, ToolCallArgs) and e.text:
            args_seen.add(e.index)
            out.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
    return out


class ChatServing:
    """The /v1/chat/completions route, built once at startup from the serving context
    (engine, tokenizer, template, limits, and `features`: the tool-call and reasoning
    parsers)."""

    def __init__(self, ctx: ServingContext):
        self.ctx = ctx
        self.features = ctx.features

    def _prepare(self, raw: bytes) -> tuple[ChatCompletionRequest, str, list[int], int]:
        """Parse the body and build the prompt: (request, prompt text, its token ids,
        max_tokens to send); raises APIError. CPU work that grows with the body (JSON,
        schema compile, template, tokenizer): run it off the event loop."""
        req = parse_chat_request(raw, self.ctx.tokenizer.vocab_size, self.ctx.defaults)
        return (req, *self._prompt(req))

    def _prompt(self, req: ChatCompletionRequest) -> tuple[str, list[int], int]:
        """(prompt text, its token ids, max_tokens to send); raises APIError."""
        ctx = self.ctx
        if req.model != ctx.model_name:
            raise model_not_found(req.model)
        check_choices(ctx, req.sampling.n, "n")
        if ctx.template is None:
            raise InternalError("The model has no chat template.")
        kwargs = self.features.template_kwargs() | req.chat_template_kwargs
        prompt = ctx.template.render(req.messages, add_generation_prompt=req.add_generation_prompt,
                                     tools=req.tools.tools if req.tools.active else None,
                                     continue_final_message=req.continue_final_message, **kwargs)
        prompt_ids = ctx.tokenizer.encode(prompt)
        n, max_tokens = len(prompt_ids), req.sampling.max_tokens
        max_model_len = ctx.limits.max_model_len
        room = max_model_len - n
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise context_error("messages", max_model_len, n, max_tokens, "messages")
        return prompt, prompt_ids, req.sampling.max_tokens_for(room)

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions (streaming and not).

        Errors: 400 invalid JSON / fields (tools, tool_choice naming an unknown tool, ...) /
        too long, 404 unknown model, 413 body too large, 503 engine not answering or
        overloaded (Retry-After), 500 internal faults."""
        ctx = self.ctx
        request_id = f"chatcmpl-{uuid.uuid4().hex}"

        async def handle() -> Response:
            # Off the loop: a big body takes seconds to render and tokenize, and the loop
            # must keep serving other streams and the engine heartbeats meanwhile.
            req, prompt, prompt_ids, max_tokens = await asyncio.to_thread(
                self._prepare, await read_body(request, ctx.limits.max_body_bytes, ctx.limits.body_timeout_s))
            sr, tools = req.sampling, req.tools
            reasons = self.features.reasons(req.thinking, tools.forced)
            # Stop strings apply to the content: in the parser when there is reasoning,
            # else on the whole text in `generate` (the same, and the engine stops at once).
            parser_stops = sr.stop if reasons else []

            parsers = [self.features.output_parser(prompt, parser_stops, req.thinking,
                                                   tools.schemas if tools.active else None, tools.forced,
                                                   tools.parallel)
                       for _ in range(sr.n)]

            def wrap(index: int, gen: Deltas) -> Deltas:
                return parse_deltas(gen, parsers[index])

            fan = fan_out(ctx, request_id, [
                (prompt_ids, sr.to_params(max_tokens, i, logprobs=req.logprobs))
                for i in range(sr.n)], sr, wrap=wrap, stop=[] if reasons else sr.stop,
                stop_probes=[p.stop_probe for p in parsers])
            log.info("%s added: %d prompt tokens, n %d, max_tokens %d, stream %s, tools %d "
                     "(%s)", request_id, len(prompt_ids), sr.n, max_tokens, sr.stream,
                     len(tools.tools), tools.choice)
            if sr.stream:
                return await start_stream(
                    request, request_id, fan, ctx.limits.keepalive_s,
                    lambda first, f: self._events(request_id, req, len(prompt_ids), first, f))
            res = await collect(request, request_id, fan, sr.n, ChatCollected)
            if res is None:
                return Response(status_code=CLIENT_CLOSED)
            return json_response(self._body(request_id, req, res, len(prompt_ids)))

        return await guard(request_id, handle)

    def _logprobs(self, req: ChatCompletionRequest, lps: list[TokenLogprob]
                  ) -> dict[str, Any] | None:
        if req.logprobs is None:
            return None
        return {"content": self.ctx.lp.chat_content(lps, req.logprobs)}

    def _body(self, request_id: str, req: ChatCompletionRequest, res: list[ChatCollected],
              n_prompt: int) -> dict[str, Any]:
        completion = sum(c.final.completion_tokens for c in res if c.final)
        choices = []
        for i, c in enumerate(res):
            choices.append({"index": i, "message": c.as_message(),
                            "logprobs": self._logprobs(req, c.logprobs),
                            "finish_reason": _finish_reason(
                                c.final.finish_reason if c.final else None,
                                bool(c.message.calls), c.message.cut)})
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.ctx.model_name, "choices": choices,
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": completion,
                          "total_tokens": n_prompt + completion}}

    async def _events(self, request_id: str, req: ChatCompletionRequest, n_prompt: int,
                      first: tuple[int, TextDelta] | None, fan: FanOut) -> AsyncIterator[bytes]:
        """The SSE chunks of a streamed chat answer (see the module docstring), `data:
        [DONE]` last. n_prompt: the prompt's tokens. With stream_options.include_usage each
        chunk has `usage: null`, or with continuous_usage_stats too (vLLM's) {prompt_tokens,
        completion_tokens of that chunk's choice so far (0 in the role chunks),
        total_tokens}; the final usage chunk counts every choice's tokens."""
        created = int(time.time())
        sr = req.sampling
        model = self.ctx.model_name
        counts = [0] * sr.n  # completion tokens of each choice so far

        def chunk(index: int, delta: dict[str, Any], finish: str | None,
                  logprobs: dict[str, Any] | None = None) -> bytes:
            c: dict[str, Any] = {
                "id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [{"index": index, "delta": delta,
                                             "logprobs": logprobs, "finish_reason": finish}]}
            if sr.continuous_usage:
                c["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": counts[index],
                              "total_tokens": n_prompt + counts[index]}
            elif sr.include_usage:
                c["usage"] = None
            return sse(c)

        for i in range(sr.n):
            yield chunk(i, {"role": "assistant", "content": ""}, None)
        completion = 0
        calls: list[set[int]] = [set() for _ in range(sr.n)]  # indices of started calls
        args_seen: list[set[int]] = [set() for _ in range(sr.n)]
        cut = [False] * sr.n  # the choice's output ended inside a call

        async for item in stream_items(first, fan):
            if item is None:  # a choice failed: its error event and [DONE] went out
                return
            if isinstance(item, bytes):
                yield item
                continue
            i, d = item
            counts[i] = d.completion_tokens
            events = d.events if isinstance(d, ChatDelta) else []
            calls[i].update(e.index for e in events if isinstance(e, ToolCallStart))
            cut[i] = cut[i] or any(isinstance(e, ToolCallCut) for e in events)
            deltas = _event_deltas(events, args_seen[i])
            if d.finish_reason is not None:  # a call with no argument text gets "{}"
                deltas += [{"tool_calls": [{"index": k, "function": {"arguments": "{}"}}]}
                           for k in sorted(calls[i] - args_seen[i])]
            lps = self._logprobs(req, d.logprobs) if d.logprobs else None
            if lps is not None and not deltas:
                deltas = [{"content": ""}]
            for k, delta in enumerate(deltas):
                yield chunk(i, delta, None, lps if k == 0 else None)
            if d.finish_reason is not None:
                completion += d.completion_tokens
                yield chunk(i, {}, _finish_reason(d.finish_reason, bool(calls[i]), cut[i]))
        if sr.include_usage:
            yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                       "model": model, "choices": [],
                       "usage": {"prompt_tokens": n_prompt, "completion_tokens": completion,
                                 "total_tokens": n_prompt + completion}})
        yield SSE_DONE
