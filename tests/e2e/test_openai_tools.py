"""End to end as a user of the official `openai` SDK: tool calling and reasoning on
/v1/chat/completions, with `kestrel serve` running Kestrel's qwen3 template, the qwen3
reasoning parser and each tool-call parser (hermes, qwen3_coder), on SmolLM2 (its answers
mean nothing here: the tests check the API's invariants; forced calls are valid whatever
the weights, through the structured-output constraint)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.server import KestrelServer

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "days": {"type": "integer"}},
           "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "Weather of a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time.",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module", params=["hermes", "qwen3_coder"])
def server(request, smollm2_dir):
    srv = KestrelServer(str(smollm2_dir), "--chat-template", "qwen3", "--tool-call-parser",
                        request.param, "--reasoning-parser", "qwen3",
                        "--max-model-len", "2048").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _streamed(client, **kw) -> tuple[dict[int, list[str]], str, str | None]:
    """({index: [name, concatenated arguments]}, content, finish_reason) of a stream."""
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return calls, content, finish


def _check_calls(calls: list[tuple[str, str]], finish: str, allowed: set[str]) -> None:
    """Every call names an allowed tool and its arguments are JSON; when the answer ended by
    itself (not cut by max_tokens) they validate against the tool's schema."""
    assert calls and finish in ("tool_calls", "length")
    for name, args in calls:
        assert name in allowed
        value = json.loads(args)
        if finish == "tool_calls":
            jsonschema.validate(value, SCHEMAS[name])


@pytest.mark.parametrize("choice,allowed", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
], ids=["required", "named"])
def test_forced_tool_choice_gives_schema_valid_calls_streamed_equal_to_non_streamed(
        client, choice, allowed):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=200,
              extra_body=GREEDY)
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]
    _check_calls(calls, ch.finish_reason, allowed)
    assert all(c.type == "function" and c.id for c in ch.message.tool_calls)
    streamed, _, finish = _streamed(client, **kw)
    assert finish == ch.finish_reason
    assert [tuple(streamed[i]) for i in sorted(streamed)] == calls


def test_tool_choice_none_never_calls(client):
    for stream in (False, True):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=12)
        if stream:
            calls, _, finish = _streamed(client, **kw)
            assert not calls and finish in ("stop", "length")
        else:
            r = client.chat.completions.create(**kw)
            assert not r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_auto_gives_content_or_valid_calls(client, stream):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=48)
    if stream:
        got, content, finish = _streamed(client, **kw)
        calls = [tuple(got[i]) for i in sorted(got)]
    else:
        ch = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []]
        content, finish = ch.message.content or "", ch.finish_reason
    if calls:
        assert finish in ("tool_calls", "length")
        for name, args in calls:
            assert name in SCHEMAS and isinstance(json.loads(args), dict)
    else:  # plain content (a complete call would have been parsed into tool_calls)
        assert finish in ("stop", "length") and isinstance(content, str)


def test_conversation_with_tool_calls_and_tool_results_is_rendered_and_answered(client,
                                                                                 server):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "days": 123456789012345678901}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                       max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    bare = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens
    counted = httpx.post(f"{server.base_url}/tokenize", timeout=30,
                         json={"model": MODEL, "messages": history, "tools": TOOLS}).json()
    assert counted["count"] == r.usage.prompt_tokens


def test_enable_thinking_toggles_the_prompt_and_reasoning_stays_out_of_content(client):
    on, off = (client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=8, extra_body={
            "chat_template_kwargs": {"enable_thinking": flag}, **GREEDY}) for flag in (True, False))
    # thinking off: the template closes an empty <think> block for the model
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert (off.choices[0].message.model_extra or {}).get("reasoning_content") is None
    content = on.choices[0].message.content or ""
    assert not content.lstrip().startswith("<think>")


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": "get_weather"}, "tools"),
], ids=["unknown named tool", "tool without name", "tool without function", "tools not list"])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_tools_get_400_naming_the_field(client, body, param, stream):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, stream=stream, **body)
    assert e.value.status_code == 400 and e.value.body["param"] == param
