"""The `output` items of an OpenAI Responses answer and their stream events, built from the
output parser's events (parsers/output.py: reasoning, content, tool calls).

Shapes follow the openai SDK's types (openai/types/responses/): `ResponseReasoningItem`
{"id": "rs_...", "type": "reasoning", "summary": [], "content": [{"type":
"reasoning_text", "text"}], "status"}, `ResponseOutputMessage` {"id": "msg_...", "type":
"message", "role": "assistant", "status", "content": [{"type": "output_text", "text",
"annotations": [], "logprobs": []}]} and `ResponseFunctionToolCall` {"id": "fc_...",
"type": "function_call", "call_id": "call_...", "name", "arguments": JSON text, "status"}.
Items are made in the order the model wrote them: a change of kind (reasoning, text, a new
call) closes the open item and opens the next. Whitespace-only text before anything else is
held back (it is not a message), and kept only when the answer has no other item; an answer
with no item at all gets an empty message. A call with no argument text gets "{}".

Stream events, per item (each a dict with "type"; the route adds `sequence_number`):
`response.output_item.added`; for a message or reasoning `response.content_part.added`,
then `response.output_text.delta` / `response.reasoning_text.delta` per piece, then
`.done` with the whole text and `response.content_part.done`; for a call
`response.function_call_arguments.delta` per piece and `.done`; then
`response.output_item.done` with the finished item. The items built for a non-streamed
answer are the same, from the same events, so both agree.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from services.frontend.parsers.output import OutEvent, Reasoning
from services.frontend.parsers.tool_parsers import Content, ToolCallArgs, ToolCallCut, ToolCallStart


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _part(kind: str, text: str) -> dict[str, Any] | None:
    """The content part of an item of type `kind` holding `text` (None: a call has none)."""
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return None


class OutputItems:
    """The output items of one answer. `add(events)` and `finish(status)` return the stream
    events of that step (see the module docstring); `items` holds the items, each finished
    with `finish`. status: "completed", or "incomplete" (max_output_tokens reached: the
    open item is marked incomplete)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._text = ""  # the open message's or reasoning item's text so far
        self._calls: dict[int, dict[str, Any]] = {}  # parser call index -> item
        self._cut: dict[str, Any] | None = None  # the call item the output ended in (`ToolCallCut`)
        self._held = ""  # leading whitespace-only text, not yet a message
        self.reasoning = ""  # every reasoning text, for usage.output_tokens_details
        self._index: dict[str, int] = {}  # item id -> output_index

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self._index[item["id"]]}

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close("completed")
        self._index[item["id"]] = len(self.items)
        self.items.append(item)
        self._open, self._text = item, ""
        out.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                    "item": copy.deepcopy(item)})
        part = _part(item["type"], "")
        if part is not None:
            out.append({"type": "response.content_part.added", **self._where(item),
                        "content_index": 0, "part": part})
        return out

    def _close(self, status: str) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        self._open = None
        where = self._where(item)
        out: list[dict[str, Any]] = []
        if item["type"] == "function_call":
            if not item["arguments"]:
                item["arguments"] = "{}"
                out.append({"type": "response.function_call_arguments.delta", **where,
                            "delta": "{}"})
            out.append({"type": "response.function_call_arguments.done", **where,
                        "arguments": item["arguments"]})
        else:
            part = _part(item["type"], self._text)
            assert part is not None
            item["content"] = [part]
            done = ("response.output_text.done" if item["type"] == "message"
                    else "response.reasoning_text.done")
            extra: dict[str, Any] = {"logprobs": []} if item["type"] == "message" else {}
            out += [{"type": done, **where, "content_index": 0, "text": self._text, **extra},
                    {"type": "response.content_part.done", **where, "content_index": 0,
                     "part": part}]
        item["status"] = status
        out.append({"type": "response.output_item.done", "output_index": where["output_index"],
                    "item": copy.deepcopy(item)})
        return out

    def _text_delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            if kind == "message":
                out = self._start({"id": _id("msg"), "type": "message", "role": "assistant",
                                   "status": "in_progress", "content": []})
            else:
                out = self._start({"id": _id("rs"), "type": "reasoning", "summary": [],
                                   "content": [], "status": "in_progress"})
        self._text += text
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        delta = ("response.output_text.delta" if kind == "message"
                 else "response.reasoning_text.delta")
        assert self._open is not None
        out.append({"type": delta, **self._where(self._open), "content_index": 0,
                    "delta": text, **extra})
        return out

    def add(self, events: list[OutEvent]) -> list[dict[str, Any]]:
        """Take parser events; return the stream events they make."""
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, Reasoning) and e.text:
                self.reasoning += e.text
                out += self._text_delta("reasoning", e.text)
            elif isinstance(e, Content) and e.text:
                in_message = self._open is not None and self._open["type"] == "message"
                if not in_message and not self.items and not (self._held + e.text).strip():
                    self._held += e.text
                    continue
                text = e.text if in_message or self.items else self._held + e.text
                self._held = ""
                out += self._text_delta("message", text)
            elif isinstance(e, ToolCallStart):
                item = {"id": _id("fc"), "type": "function_call", "status": "in_progress",
                        "call_id": _id("call"), "name": e.name, "arguments": ""}
                out += self._start(item)
                self._calls[e.index] = item
            elif isinstance(e, ToolCallArgs) and e.text and e.index in self._calls:
                item = self._calls[e.index]
                item["arguments"] += e.text
                out.append({"type": "response.function_call_arguments.delta",
                            **self._where(item), "delta": e.text})
            elif isinstance(e, ToolCallCut) and e.index in self._calls:
                self._cut = self._calls[e.index]
        return out

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Close the open item with `status` (an answer with no item gets a message of the
        held-back text, maybe empty; a call the output ended in, `ToolCallCut`, is
        "incomplete" whatever the answer's status); return the stream events."""
        out: list[dict[str, Any]] = []
        if not self.items:
            out += self._text_delta("message", self._held)
            self._held = ""
        if self._open is not None and self._open is self._cut:
            status = "incomplete"
        return out + self._close(status)

    @property
    def has_calls(self) -> bool:
        return bool(self._calls)


def usage(n_prompt: int, n_output: int, reasoning_tokens: int) -> dict[str, Any]:
    """The Responses `usage` object (ResponseUsage). Cached-token counts are 0: the engine
    does not report prefix-cache hits per request."""
    return {"input_tokens": n_prompt,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": n_output,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, n_output)},
            "total_tokens": n_prompt + n_output}


def response_object(response_id: str, created_at: int, model: str, echo: dict[str, Any],
                    status: str, output: list[dict[str, Any]],
                    usage_obj: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `response` object (the SDK's `Response`). echo: the request fields it repeats
    (ResponsesRequest.echo). status: "in_progress", "completed", "incomplete" (then
    incomplete_details names max_output_tokens) or "failed" (then `error` is {"code",
    "message"})."""
    return {"id": response_id, "object": "response", "created_at": created_at,
            "status": status, "background": False, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "model": model, "output": output, "previous_response_id": None, "store": False,
            "usage": usage_obj, **echo}
