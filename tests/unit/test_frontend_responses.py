"""Responses API output items and request parsing, checked against the openai SDK's own
pydantic types (every stream event and the response object) and the request's meaning."""

from __future__ import annotations

import json

import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from services.frontend.errors import InvalidRequest
from services.frontend.parsers.output import Reasoning
from services.frontend.parsers.tool_parsers import Content, ToolCallArgs, ToolCallStart
from services.frontend.responses_output import OutputItems, response_object, usage
from services.frontend.responses_protocol import parse_responses_request

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]


def _run(batches: list[list], status: str = "completed") -> tuple[OutputItems, list[dict]]:
    out, events = OutputItems(), []
    for batch in batches:
        events += out.add(batch)
    events += out.finish(status)
    for seq, e in enumerate(events):
        EVENTS.validate_python({**e, "sequence_number": seq})
    return out, events


def _check_response(out: OutputItems, status: str) -> Response:
    req = parse_responses_request(json.dumps({"model": "m", "input": "x", "tools": TOOLS})
                                  .encode(), 1000)
    return Response.model_validate(response_object(
        "resp_1", 0, "m", req.echo, status, out.items, usage(3, 4, 1)))


def test_calls_after_leading_whitespace_are_items_in_order_with_concatenating_deltas():
    out, events = _run([[Content("\n ")], [ToolCallStart(0, "f"), ToolCallArgs(0, '{"a"')],
                        [ToolCallArgs(0, ": 1}"), ToolCallStart(1, "f")]])
    assert [i["type"] for i in out.items] == ["function_call", "function_call"]
    assert [i["arguments"] for i in out.items] == ['{"a": 1}', "{}"]
    for k, item in enumerate(out.items):
        deltas = "".join(e["delta"] for e in events if e.get("item_id") == item["id"]
                         and e["type"] == "response.function_call_arguments.delta")
        assert deltas == item["arguments"] and item["status"] == "completed"
        added = [e for e in events if e["type"] == "response.output_item.added"][k]
        assert added["output_index"] == k and added["item"]["status"] == "in_progress"
    resp = _check_response(out, "completed")
    assert resp.output_text == "" and len(resp.output) == 2


def test_reasoning_then_text_make_two_items_and_the_cut_one_is_incomplete():
    out, events = _run([[Reasoning("hm")], [Reasoning(" ok"), Content("Hi")], [Content("!")]],
                       status="incomplete")
    assert [i["type"] for i in out.items] == ["reasoning", "message"]
    assert out.items[0]["content"] == [{"type": "reasoning_text", "text": "hm ok"}]
    assert out.items[0]["status"] == "completed" and out.items[1]["status"] == "incomplete"
    assert out.reasoning == "hm ok"
    done = [e["type"] for e in events if e.get("output_index") == 0][-3:]
    assert done == ["response.reasoning_text.done", "response.content_part.done",
                    "response.output_item.done"]
    resp = _check_response(out, "incomplete")
    assert resp.output_text == "Hi!" and resp.incomplete_details.reason == "max_output_tokens"


def test_an_answer_with_no_text_is_one_empty_message():
    out, events = _run([[Content("  ")]])
    assert [i["type"] for i in out.items] == ["message"]
    assert out.items[0]["content"][0]["text"] == "  "
    assert events[-1]["type"] == "response.output_item.done"


def test_request_maps_input_items_to_template_messages():
    body = {"model": "m", "instructions": "Be kind.", "tools": TOOLS, "input": [
        {"role": "developer", "content": "Sys."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [
            {"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Calling.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "done"}]}
    req = parse_responses_request(json.dumps(body).encode(), 1000)
    assert req.messages == [
        {"role": "system", "content": "Be kind."}, {"role": "system", "content": "Sys."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Calling.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    assert req.tools.choice == "auto" and req.echo["tool_choice"] == "auto"


def test_a_forced_call_constraint_wins_over_text_format_and_stateful_fields_are_400():
    body = {"model": "m", "input": "x", "tools": TOOLS, "tool_choice": "required",
            "text": {"format": {"type": "json_object"}}}
    req = parse_responses_request(json.dumps(body).encode(), 1000)
    assert req.sampling.structured == req.tools.constraint()
    for name, value in (("previous_response_id", "resp_1"), ("conversation", "conv_1"),
                        ("background", True)):
        with pytest.raises(InvalidRequest) as e:
            parse_responses_request(json.dumps({"model": "m", "input": "x", name: value})
                                    .encode(), 1000)
        assert e.value.param == name


def test_a_failure_mid_stream_is_an_error_event_then_response_failed():
    import asyncio
    from types import SimpleNamespace

    from services.frontend.chat_api import ChatDelta
    from services.frontend.generation import TextDelta
    from services.frontend.responses_api import ResponsesServing

    class Fan:  # the FanOut after the first item: one failed delta
        def __aiter__(self):
            return self

        async def __anext__(self):
            if getattr(self, "done", False):
                raise StopAsyncIteration
            self.done = True
            return 0, TextDelta("", "error", "worker died", 3, 1, "internal")

    ctx = SimpleNamespace(model_name="m", features=None, tokenizer=None)
    serving = ResponsesServing(ctx)  # type: ignore[arg-type]
    req = parse_responses_request(b'{"model": "m", "input": "x", "stream": true}', 1000)
    first = (0, ChatDelta("", None, None, 3, 1, events=[Content("Hel")]))

    async def run() -> list[bytes]:
        return [b async for b in serving._events("resp_1", 0, req, 3, first, Fan())]

    events = []
    for frame in asyncio.run(run()):
        name, data = frame.decode().strip().split("\n")
        events.append(json.loads(data[len("data: "):]))
        assert name == "event: " + events[-1]["type"]
        EVENTS.validate_python(events[-1])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "worker died" in failed["error"]["message"]
