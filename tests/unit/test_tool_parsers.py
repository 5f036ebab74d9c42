"""Tool-call parsers on hand-written model outputs: one-shot results against the expected
calls (parsed with Python's json, exact integers), and streaming split at every position
equal to one-shot."""

from __future__ import annotations

import json

import pytest

from services.frontend.parsers.output import ChatOutputParser, ParsedMessage
from services.frontend.parsers.tool_parsers import make_tool_parser

BIG = 2**53 + 12345678901234567890
SCHEMAS = {"f": {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"},
                                                  "b": {"type": "boolean"}, "o": {"type": "object"},
                                                  "a": {"type": "array"}, "s": {"type": "string"}}},
           "g": {"type": "object", "properties": {"s": {"type": "string"}}}}

HERMES = ('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"n": ' + str(BIG) +
          ', "s": "quote \\" and </tool_call> tag", "o": {"deep": [1, {"k": null}]}}}\n</tool_call>\n'
          '<tool_call>\n{"name": "g", "arguments": {"s": "two"}}\n</tool_call>')
QWEN3_CODER = ('Let me check.\n<tool_call>\n<function=f>\n<parameter=n>\n' + str(BIG) + '\n</parameter>\n'
               '<parameter=s>\nsays </parameter> inside\n</parameter>\n<parameter=b>\nTrue\n</parameter>\n'
               '<parameter=o>\n{"deep": [1, {"k": null}]}\n</parameter>\n<parameter=x>\n1.5\n</parameter>\n'
               '</function>\n</tool_call>\n<tool_call>\n<function=g>\n<parameter=s>\ntwo\n</parameter>\n'
               '</function>\n</tool_call>')


def run(name: str, text: str, cuts: list[int] = ()) -> ParsedMessage:
    parser = ChatOutputParser(None, make_tool_parser(name, SCHEMAS), [])
    msg = ParsedMessage()
    prev = 0
    for c in [*cuts, len(text)]:
        msg.add(parser.feed(text[prev:c]))
        prev = c
    msg.add(parser.finish())
    return msg


def calls(msg: ParsedMessage) -> list[tuple[str, object]]:
    return [(n, json.loads(a)) for n, a in msg.calls]


def test_hermes_parses_nested_json_quotes_tags_and_big_integers_exactly():
    msg = run("hermes", HERMES)
    assert msg.content == "Let me check."
    assert calls(msg) == [("f", {"n": BIG, "s": 'quote " and </tool_call> tag',
                                 "o": {"deep": [1, {"k": None}]}}), ("g", {"s": "two"})]
    assert str(BIG) in msg.calls[0][1]  # written as digits, never through a float


def test_qwen3_coder_converts_values_by_schema_and_keeps_big_integers():
    msg = run("qwen3_coder", QWEN3_CODER)
    assert msg.content == "Let me check."
    assert calls(msg) == [("f", {"n": BIG, "s": "says </parameter> inside", "b": True,
                                 "o": {"deep": [1, {"k": None}]}, "x": 1.5}), ("g", {"s": "two"})]
    assert str(BIG) in msg.calls[0][1]


@pytest.mark.parametrize("name,text", [("hermes", HERMES), ("qwen3_coder", QWEN3_CODER)])
def test_streaming_split_at_every_position_equals_one_shot(name, text):
    whole = run(name, text)
    for i in range(len(text) + 1):
        assert run(name, text, [i]) == whole, i
    assert run(name, text, list(range(len(text)))) == whole  # one character at a time


@pytest.mark.parametrize("name,text", [("hermes", HERMES), ("qwen3_coder", QWEN3_CODER)])
def test_a_call_cut_mid_argument_is_closed_into_valid_json_at_every_cut(name, text):
    start = text.index("<tool_call>")
    for end in range(start, len(text)):
        for cuts in ([], [end // 2]):
            msg = run(name, text[:end], [c for c in cuts if c < end])
            for _, args in msg.calls:
                assert isinstance(json.loads(args), dict), (end, args)


def test_cut_hermes_call_keeps_the_partial_string():
    msg = run("hermes", '<tool_call>\n{"name": "g", "arguments": {"s": "par')
    assert calls(msg) == [("g", {"s": "par"})]


def test_text_without_calls_is_content_and_no_empty_call_list():
    msg = run("hermes", "Just text <tool and more.\n")
    assert msg.content == "Just text <tool and more.\n" and msg.calls == []


def test_forced_parser_reads_the_constrained_json_array():
    text = '[{"name": "f", "arguments": {"n": ' + str(BIG) + '}}, {"name": "g", "arguments": {}}]'
    whole = run("forced", text)
    assert calls(whole) == [("f", {"n": BIG}), ("g", {})]
    for i in range(len(text)):
        assert run("forced", text, [i]) == whole


def _ends_in(text: str, marker: str, offset: int = 0) -> str:
    """text up to the first `marker` (plus offset characters)."""
    return text[:text.index(marker) + offset]


# (parser, output that ends inside a started call, output that ends after a finished one)
ENDS = [
    ("hermes", _ends_in(HERMES, "tag"), _ends_in(HERMES, "\n</tool_call>\n<tool_call>")),
    ("hermes", _ends_in(HERMES, '"two"}'), _ends_in(HERMES, '"two"}}', 7)),  # JSON whole, no close tag
    ("qwen3_coder", _ends_in(QWEN3_CODER, "says"), _ends_in(QWEN3_CODER, "</tool_call>", 12)),
    ("qwen3_coder", _ends_in(QWEN3_CODER, "<parameter=b>"), QWEN3_CODER),
    ("forced", '[{"name": "f", "arguments": {"n": 12', '[{"name": "f", "arguments": {"n": 12}}, '),
]


@pytest.mark.parametrize("name,inside,after", ENDS)
def test_an_output_that_ends_inside_a_call_is_marked_cut_at_every_split(name, inside, after):
    """`ToolCallCut` (ParsedMessage.cut) marks an output that ended inside a started call, whose
    arguments the parser closed itself (the APIs then report no finished call); an output
    that ended after a whole call, or inside a call whose name was not complete, is not cut."""
    for text, cut in ((inside, True), (after, False)):
        for i in range(len(text) + 1):
            msg = run(name, text, [i])
            assert msg.calls and msg.cut is cut, (text, i)
    assert run("hermes", '<tool_call>{"name": "f"}</tool_call><tool_call>{"na').cut is False
    assert run("hermes", '<tool_call>{"name": "f"}</tool_call><tool_call>{"name": "g", ').cut is True


def test_responses_function_call_item_the_output_ended_in_is_incomplete():
    from services.frontend.parsers.tool_parsers import ToolCallArgs, ToolCallCut, ToolCallStart
    from services.frontend.responses_output import OutputItems
    for cut, status in ((False, "completed"), (True, "incomplete")):
        items = OutputItems()
        items.add([ToolCallStart(0, "f"), ToolCallArgs(0, '{"n": 1}')])
        items.add([ToolCallStart(1, "g"), ToolCallArgs(1, '{"s": "pa"}')] + ([ToolCallCut(1)] if cut else []))
        events = items.finish("completed")
        assert [i["status"] for i in items.items] == ["completed", status]
        assert events[-1]["type"] == "response.output_item.done" and events[-1]["item"]["status"] == status


# Outputs cut by max_tokens after the call's name is complete but before its arguments value
# begins: the call is still returned, with {} as its arguments.
CUT_BEFORE_ARGS = ['{"name": "get_weather", "argu', '{"name": "get_weather", "arguments"',
                   '{"name": "get_weather", "arguments": ', '{"name": "get_weather"',
                   '{"name": "get_weather", ']


@pytest.mark.parametrize("body", CUT_BEFORE_ARGS)
@pytest.mark.parametrize("name,wrap", [("hermes", "Sure.\n<tool_call>\n{}"), ("forced", "[{}")])
def test_call_cut_before_its_arguments_is_kept_with_empty_arguments(name, wrap, body):
    text = wrap.replace("{}", body)
    whole = run(name, text)
    assert calls(whole) == [("get_weather", {})]
    assert whole.content == ("Sure." if name == "hermes" else "")
    for i in range(len(text) + 1):  # streamed, split anywhere: the same events
        assert run(name, text, [i]) == whole, i
    assert run(name, text, list(range(len(text)))) == whole


@pytest.mark.parametrize("name,wrap", [("hermes", "<tool_call>{}"), ("forced", "[{}")])
def test_call_cut_inside_its_name_is_dropped(name, wrap):
    for body in ['{"name": "get_wea', '{"na', '{']:
        assert run(name, wrap.replace("{}", body)).calls == []


def test_cut_call_with_arguments_before_the_name_keeps_what_was_parsed():
    text = '<tool_call>{"arguments": {"city": "Par", "n": ' + str(BIG) + '}, "name": "get_weather"'
    assert calls(run("hermes", text)) == [("get_weather", {"city": "Par", "n": BIG})]
    assert calls(run("hermes", text + ', "x')) == [("get_weather", {"city": "Par", "n": BIG})]
    assert run("hermes", '<tool_call>{"arguments": {"city": "Paris"}, "name": "get_w').calls == []


# Hermes tags around text that is no call: the model's text comes back as content, the tag
# included, whatever the split (it used to vanish, with all the text fed in the same piece).
NOT_CALLS = [("a <tool_call> b, and more text.", "a <tool_call> b, and more text."),
             ("x <tool_call>\n[1, 2]\n</tool_call> after", "x <tool_call>\n[1, 2]\n</tool_call> after"),
             ('<tool_call>{"name": 5}</tool_call> z', '<tool_call>{"name": 5}</tool_call> z')]


@pytest.mark.parametrize("text,content", NOT_CALLS)
def test_hermes_text_that_is_no_call_is_content_at_every_split(text, content):
    whole = run("hermes", text)
    assert whole.content == content and whole.calls == []
    for i in range(len(text) + 1):
        assert run("hermes", text, [i]) == whole, i
    assert run("hermes", text, list(range(len(text)))) == whole


def test_hermes_text_after_a_malformed_call_body_is_kept_and_parsed_again():
    text = ('<tool_call>{"name": "g", "arguments": {"s": "one"}} junk\n'
            '<tool_call> nope <tool_call>{"name": "g", "arguments": {"s": "two"}}</tool_call>')
    whole = run("hermes", text)
    assert calls(whole) == [("g", {"s": "one"}), ("g", {"s": "two"})]
    assert whole.content == " junk\n<tool_call> nope"
    for i in range(len(text) + 1):
        assert run("hermes", text, [i]) == whole, i
