"""Anthropic's content blocks, built from the output parser's events, with the stream
events that build them (anthropic_api.py serves both forms from them, so they agree).

A stream is `event: <type>\ndata: <JSON>\n\n` events (`sse_event`): per block
content_block_start (the empty block), content_block_delta (text_delta / thinking_delta /
input_json_delta) and content_block_stop. The non-streaming content is the same blocks
(`Blocks.final`); a tool_use block's input is its arguments JSON, kept verbatim when it is
a valid object (big integers exact), else completed with partial-json-parser (a call cut by
max_tokens).
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson
import partial_json_parser

from services.frontend import strict_json
from services.frontend.parsers.output import OutEvent, Reasoning
from services.frontend.parsers.tool_parsers import Content, ToolCallArgs, ToolCallCut, ToolCallStart


def sse_event(event: str, data: dict[str, Any]) -> bytes:
    """One Anthropic SSE event: `event: <event>\ndata: <JSON of data>\n\n`."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def tool_input(args: str) -> Any:
    """A tool_use block's input from its arguments JSON text. Valid JSON objects are kept
    verbatim (big integers exact); anything else goes through partial-json-parser."""
    try:
        if isinstance(strict_json.loads(args), dict):
            return orjson.Fragment(args)
    except ValueError:
        pass
    try:
        value = partial_json_parser.loads(args)
        return value if isinstance(value, dict) else {}
    except Exception:  # the library raises several types on text it cannot complete
        return {}


class Blocks:
    """Content blocks built from parser events, with the stream events that build them.
    omit_thinking: thinking `display: "omitted"`: thinking blocks are kept, their text is
    left out (no thinking_delta)."""

    def __init__(self, omit_thinking: bool = False) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open = False
        self.omit_thinking = omit_thinking
        self.cut = False  # the output ended inside a tool_use (`ToolCallCut`)

    def _start(self, block: dict[str, Any], out: list[bytes]) -> None:
        self.close(out)
        self.blocks.append(block)
        self._open = True
        out.append(sse_event("content_block_start", {"type": "content_block_start",
                                                "index": len(self.blocks) - 1,
                                                "content_block": block}))
        self.blocks[-1] = dict(block)  # the start event shows the empty block

    def _delta(self, delta: dict[str, Any], out: list[bytes]) -> None:
        out.append(sse_event("content_block_delta", {"type": "content_block_delta",
                                                "index": len(self.blocks) - 1, "delta": delta}))

    def close(self, out: list[bytes]) -> None:
        if self._open:
            out.append(sse_event("content_block_stop", {"type": "content_block_stop",
                                                   "index": len(self.blocks) - 1}))
            self._open = False

    def _current(self, kind: str) -> dict[str, Any] | None:
        return self.blocks[-1] if self._open and self.blocks[-1]["type"] == kind else None

    def add(self, events: list[OutEvent]) -> list[bytes]:
        out: list[bytes] = []
        for e in events:
            if isinstance(e, Reasoning):
                if self._current("thinking") is None:
                    self._start({"type": "thinking", "thinking": "", "signature": ""}, out)
                if self.omit_thinking:
                    continue
                self.blocks[-1]["thinking"] += e.text
                self._delta({"type": "thinking_delta", "thinking": e.text}, out)
            elif isinstance(e, Content):
                if self._current("text") is None:
                    self._start({"type": "text", "text": ""}, out)
                self.blocks[-1]["text"] += e.text
                self._delta({"type": "text_delta", "text": e.text}, out)
            elif isinstance(e, ToolCallStart):
                self._start({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                             "name": e.name, "input": {}}, out)
                self.blocks[-1]["_args"] = ""
            elif isinstance(e, ToolCallArgs):
                self.blocks[-1]["_args"] += e.text
                self._delta({"type": "input_json_delta", "partial_json": e.text}, out)
            elif isinstance(e, ToolCallCut):
                self.cut = True
        return out

    def final(self) -> list[dict[str, Any]]:
        """The blocks as the non-streaming message shows them."""
        out = []
        for b in self.blocks:
            if b["type"] == "tool_use":
                b = {k: v for k, v in b.items() if k != "_args"} | {"input": tool_input(b["_args"])}
            out.append(b)
        return out

    def has_tool_use(self) -> bool:
        """Whether the answer is a finished tool use: it has a tool_use block and did not end
        inside one (`ToolCallCut`: its input closed at a prefix)."""
        return not self.cut and any(b["type"] == "tool_use" for b in self.blocks)
