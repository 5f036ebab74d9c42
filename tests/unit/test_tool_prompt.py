"""The tool fallback of templates that cannot render tools (`tool_prompt.py`), on the default
model's own chat template (SmolLM2-135M-Instruct's, which renders only role and content), and
the chat_template_kwargs keys the renderer sets itself.

Independent truths: the request's own tool objects (json.loads of what the prompt lists), the
tool-call parsers the server would select (hermes, qwen3_coder) reading back the calls the
prompt shows, and jinja2 rendering a tool-aware template directly."""

from __future__ import annotations

import json
import re

import jinja2
import pytest

from services.frontend.chat_template import ChatTemplate, check_template_kwargs
from services.frontend.errors import InvalidRequest
from services.frontend.parsers.tool_parsers import (ToolCallArgs, ToolCallStart,
                                                    make_tool_parser)
from services.frontend.tokenizer import Tokenizer

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "days": {"type": "integer"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
CALL_ARGS = {"city": "Paris", "days": 123456789012345678901}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": CALL_ARGS}}]},
    {"role": "tool", "content": "Sunny, 21 C.", "tool_call_id": "call_1"},
]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir) -> ChatTemplate:
    tok = Tokenizer(str(smollm2_dir))
    assert "tools" not in tok.chat_template  # the premise: its template ignores tools
    return ChatTemplate(tok.chat_template, tok.special_tokens)


def _calls(parser_name: str, text: str) -> list[tuple[str, object]]:
    parser = make_tool_parser(parser_name, {"get_weather": WEATHER, "get_time": {}})
    events = parser.feed(text) + parser.finish()
    names = {e.index: e.name for e in events if isinstance(e, ToolCallStart)}
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallArgs):
            args[e.index] = args.get(e.index, "") + e.text
    return [(names[i], json.loads(args.get(i) or "{}")) for i in sorted(names)]


def test_probe_finds_that_the_default_template_renders_no_tools(smollm2):
    s = smollm2.support
    assert (s.renders_tools, s.renders_tool_calls, s.renders_system) == (False, False, True)
    assert s.needs_fallback


def test_tools_the_template_ignores_are_listed_in_a_system_block(smollm2):
    bare = smollm2.render(HISTORY[:1])
    prompt = smollm2.render(HISTORY[:1], tools=TOOLS, tool_call_format="json")
    assert len(prompt) > len(bare) and prompt.startswith("<|im_start|>system\n# Tools")
    listed = re.search(r"<tools>\n(.*?)\n</tools>", prompt, re.S).group(1).splitlines()
    assert [json.loads(line) for line in listed] == [t["function"] for t in TOOLS]
    assert prompt.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                           "<|im_start|>assistant\n")


def test_a_system_message_keeps_its_text_before_the_tools(smollm2):
    prompt = smollm2.render([{"role": "system", "content": "Be brief."}, *HISTORY[:1]],
                            tools=TOOLS)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert prompt.count("<|im_start|>system") == 1


@pytest.mark.parametrize("fmt,parser", [("json", "hermes"), ("xml", "qwen3_coder")])
def test_history_calls_render_in_the_parsers_format_and_parse_back(smollm2, fmt, parser):
    prompt = smollm2.render(HISTORY, tools=TOOLS, tool_call_format=fmt)
    turn = re.search(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", prompt, re.S).group(1)
    assert _calls(parser, turn) == [("get_weather", CALL_ARGS)]
    # the tool result is a user turn of <tool_response> blocks, as Hermes/Qwen templates do
    assert "<|im_start|>user\n<tool_response>\nSunny, 21 C.\n</tool_response><|im_end|>" in prompt
    # the instructions name the same format the parser reads
    assert ("<function=FUNCTION_NAME>" in prompt) == (fmt == "xml")
    assert ('{"name": <function-name>, "arguments": <args-json-object>}' in prompt) == (
        fmt == "json")


def test_a_template_that_renders_tools_is_left_alone():
    source = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
              "{% for m in messages %}{{ m.role }}:{{ m.content }}"
              "{% for c in m.tool_calls or [] %}<{{ c.function.name }}>{% endfor %}"
              "{% endfor %}")
    t = ChatTemplate(source)
    assert not t.support.needs_fallback
    expected = jinja2.Environment().from_string(source).render(messages=HISTORY, tools=TOOLS)
    assert t.render(HISTORY, tools=TOOLS) == expected


def test_a_template_without_tools_or_system_messages_gets_400_naming_chat_template():
    t = ChatTemplate("{% for m in messages %}{% if m.role == 'system' %}"
                     "{{ raise_exception('System role not supported') }}{% endif %}"
                     "{{ m.content }}{% endfor %}")
    assert not t.support.renders_system
    assert t.render(HISTORY[:1]) == "Weather in Paris?"  # no tools: rendered as before
    with pytest.raises(InvalidRequest) as e:
        t.render(HISTORY[:1], tools=TOOLS)
    assert e.value.param == "tools" and "--chat-template" in e.value.message


@pytest.mark.parametrize("key", ["add_generation_prompt", "tools", "messages", "documents",
                                 "tool_call_format"])
def test_chat_template_kwargs_may_not_set_the_renderers_own_variables(key):
    with pytest.raises(InvalidRequest) as e:
        check_template_kwargs({"enable_thinking": False, key: None})
    assert e.value.param == f"chat_template_kwargs.{key}" and repr(key) in e.value.message
    assert check_template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    assert check_template_kwargs(None) == {}
