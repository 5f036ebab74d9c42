"""One chat response's text turned into reasoning, content and tool-call events.

The pipeline, per request: raw text -> reasoning parser (optional) -> stop strings, on the
content only (a stop string inside the reasoning does not stop it) -> tool parser
(optional). Both APIs stream these events and build their non-streaming answer from the same
events, so the two always agree (a call cut by max_tokens included).

`run_parsed(gen, parser)` follows `generation.generate` (started with no stop strings: they
are applied here) and yields lists of events, None for keep-alive ticks, then a `Finish`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from collections.abc import AsyncGenerator, AsyncIterator

from services.frontend.generation import StopProbe, StopStringMatcher, TextDelta, end_by_stop_string
from services.frontend.parsers.reasoning import Qwen3ReasoningParser
from services.frontend.parsers.tool_parsers import (Content, Event, ToolCallArgs, ToolCallCut,
                                                    ToolCallStart, ToolParser)
from shared.protocol import ErrorKind, FinishReason

# Finish.reason of a response a stop string of its parser ended (the engine saw "stop")
STOP_STRING = "stop_string"


@dataclass
class Reasoning:
    text: str


OutEvent = Event | Reasoning


class _StopMatcher(StopStringMatcher):
    """StopStringMatcher that also records which stop string matched (Anthropic reports it)."""

    matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        buf = self._held + text
        hits = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:
            i, self.matched = min(hits)
            self._held = ""
            return buf[:i], True
        return super().feed(text)


class ChatOutputParser:
    """reasoning: a reasoning parser or None. tools: a tool parser or None. stops: stop
    strings (applied to content). After a stop string matched, `stopped` holds it and the
    rest of the output must be dropped (the caller aborts the request). max_calls: the most
    tool calls passed on (1: parallel calls off, `parallel_tool_calls: false` /
    `disable_parallel_tool_use`); the events of later calls are dropped, the text around
    them is still content. None: no limit."""

    def __init__(self, reasoning: Qwen3ReasoningParser | None, tools: ToolParser | None,
                 stops: list[str], max_calls: int | None = None):
        self._reasoning = reasoning
        self._tools = tools
        self._max_calls = max_calls
        self._stop = _StopMatcher(stops) if stops else None
        self.stopped: str | None = None
        self._finished = False

    def stop_probe(self) -> StopProbe | None:
        """`generation.StopProbe` over copies of this parser's reasoning parser and stop matcher in
        their state now (the tool parser does not decide stops): whether text fed after what
        this parser has seen completes a stop string in the content. None without stop strings,
        or once stopped or finished."""
        if self._stop is None or self.stopped is not None or self._finished:
            return None
        reasoning, stop = copy.copy(self._reasoning), copy.copy(self._stop)

        def probe(text: str) -> bool:
            content = text if reasoning is None else reasoning.feed(text)[1]
            return bool(content) and stop.feed(content)[1]
        return probe

    def _content(self, text: str, final: bool) -> list[OutEvent]:
        out: list[OutEvent] = []
        if self._stop is not None and self.stopped is None:
            text, matched = self._stop.feed(text)
            if matched:
                self.stopped, final = self._stop.matched, True
            elif final:
                text += self._stop.flush()
        if self._tools is None:
            if text:
                out.append(Content(text))
        else:
            out += self._tools.feed(text) if text else []
            if final:
                out += self._tools.finish()
            if self._max_calls is not None:
                out = [e for e in out if not isinstance(e, (ToolCallStart, ToolCallArgs, ToolCallCut))
                       or e.index < self._max_calls]
        return out

    def feed(self, text: str) -> list[OutEvent]:
        """Events for new raw text (nothing once stopped)."""
        if self.stopped is not None or self._finished:
            return []
        if self._reasoning is None:
            return self._content(text, False)
        reasoning, content = self._reasoning.feed(text)
        out: list[OutEvent] = [Reasoning(reasoning)] if reasoning else []
        return out + self._content(content, False)

    def finish(self) -> list[OutEvent]:
        """The remaining events at the end of the output."""
        if self.stopped is not None or self._finished:
            return []
        self._finished = True
        out: list[OutEvent] = []
        content = ""
        if self._reasoning is not None:
            reasoning, content = self._reasoning.finish()
            if reasoning:
                out.append(Reasoning(reasoning))
        return out + self._content(content, True)


@dataclass
class ParsedMessage:
    """The events of a whole response, gathered. calls: [name, arguments JSON text]. cut: the
    output ended inside its last call (`ToolCallCut`)."""

    reasoning: str = ""
    content: str = ""
    calls: list[list[str]] = field(default_factory=list)
    cut: bool = False

    def add(self, events: list[OutEvent]) -> None:
        for e in events:
            if isinstance(e, Reasoning):
                self.reasoning += e.text
            elif isinstance(e, Content):
                self.content += e.text
            elif isinstance(e, ToolCallStart):
                self.calls.append([e.name, ""])
            elif isinstance(e, ToolCallArgs):
                self.calls[e.index][1] += e.text
            elif isinstance(e, ToolCallCut):
                self.cut = True


@dataclass
class Finish:
    """The end of a response. reason: a FinishReason ("stop": EOS / stop token, "length",
    "error": then error is set, and error_kind is the engine's ErrorKind, None meaning
    internal) or "stop_string" (STOP_STRING: a stop string of the request's parser matched,
    then stop_string is set; the engine counts it as "stop")."""

    reason: FinishReason | str
    prompt_tokens: int
    completion_tokens: int
    stop_string: str | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None


async def run_parsed(gen: AsyncGenerator[TextDelta | None, None], parser: ChatOutputParser
                     ) -> AsyncIterator[list[OutEvent] | None | Finish]:
    """Yield event lists (never empty), None for keep-alive ticks, and finally a Finish.
    When the parser's stop string matched, `gen` is ended with `end_by_stop_string` (the
    request stops in the engine and finishes as "stop") as soon as it matched. The caller
    closes `gen` afterwards (which aborts the request in the engine if it is still
    running: the client went away)."""
    async for d in gen:
        if d is None:
            yield None
            continue
        if d.error is not None:
            yield Finish(FinishReason.ERROR, d.prompt_tokens, d.completion_tokens, error=d.error,
                         error_kind=d.error_kind)
            return
        events = parser.feed(d.text) if d.text else []
        if parser.stopped is None and d.finish_reason is not None:
            events += parser.finish()
        if parser.stopped is not None:
            await end_by_stop_string(gen, parser.stopped)  # the engine stops at once
        if events:
            yield events
        if parser.stopped is not None:
            yield Finish(STOP_STRING, d.prompt_tokens, d.completion_tokens,
                         stop_string=parser.stopped)
            return
        if d.finish_reason is not None:
            yield Finish(d.finish_reason, d.prompt_tokens, d.completion_tokens)
            return
