"""The qwen3 reasoning parser with stop strings and tool calls, through the output pipeline."""

from __future__ import annotations

import json

import pytest

from services.frontend.parsers.output import ChatOutputParser, ParsedMessage
from services.frontend.parsers.reasoning import Qwen3ReasoningParser
from services.frontend.parsers.tool_parsers import make_tool_parser

TEXT = "<think>\nThe user wants STOP here. Think.\n</think>\n\nThe answer is 4. STOP after."


def run(text, cuts=(), enabled=True, stops=(), tools=False, starts_inside=False):
    parser = ChatOutputParser(Qwen3ReasoningParser(enabled, starts_inside),
                              make_tool_parser("hermes", {}) if tools else None, list(stops))
    msg, prev = ParsedMessage(), 0
    for c in [*cuts, len(text)]:
        msg.add(parser.feed(text[prev:c]))
        prev = c
    msg.add(parser.finish())
    return msg, parser.stopped


def test_reasoning_is_split_from_content():
    msg, _ = run(TEXT)
    assert msg.reasoning == "\nThe user wants STOP here. Think.\n"
    assert msg.content == "The answer is 4. STOP after."


def test_thinking_off_gives_everything_as_content():
    msg, _ = run("plain answer", enabled=False)
    assert (msg.reasoning, msg.content) == ("", "plain answer")
    msg, _ = run("no think tag here")
    assert (msg.reasoning, msg.content) == ("", "no think tag here")


def test_prompt_that_opens_think_starts_inside_reasoning():
    msg, _ = run("pondering</think>done", starts_inside=True)
    assert (msg.reasoning, msg.content) == ("pondering", "done")


def test_stop_string_inside_reasoning_does_not_stop_it():
    msg, stopped = run(TEXT, stops=["STOP"])
    assert msg.reasoning == "\nThe user wants STOP here. Think.\n"
    assert msg.content == "The answer is 4. " and stopped == "STOP"


@pytest.mark.parametrize("stops", [[], ["STOP"]])
def test_streaming_at_every_split_equals_non_streaming(stops):
    whole = run(TEXT, stops=stops)
    for i in range(len(TEXT) + 1):
        assert run(TEXT, [i], stops=stops) == whole, i
    assert run(TEXT, list(range(len(TEXT))), stops=stops) == whole


def test_tool_call_without_closing_think_ends_the_reasoning():
    text = '<think>I should call it <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    for i in range(len(text) + 1):
        msg, _ = run(text, [i], tools=True)
        assert msg.reasoning == "I should call it "
        assert [(n, json.loads(a)) for n, a in msg.calls] == [("f", {"a": 1})]
