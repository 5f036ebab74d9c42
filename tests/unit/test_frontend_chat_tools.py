"""Chat completions with `--tool-call-parser hermes --reasoning-parser qwen3` over HTTP, the
official `openai` SDK against a frontend on the fake engine, whose replies are hand-written
model outputs (test_frontend_support.SCRIPTED): reasoning_content / content / tool_calls,
streaming equal to non-streaming, stop strings inside the reasoning, forced calls' engine
constraint, and the 400s of bad tool fields. A call cut by max_tokens is also checked on
/v1/messages with the `anthropic` SDK."""

from __future__ import annotations

import json
import os
import re

import anthropic
import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.unit.test_frontend_support import MODEL, SCRIPTED, running_stack

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "n": {"type": "integer"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
# The arguments the scripted "please call" reply makes, parsed by Python's json (exact ints).
CALLED = [("get_weather", {"city": 'P"<b>', "n": 123456789012345678901234567890,
                           "x": [1.5, None]}),
          ("get_time", {})]


@pytest.fixture(scope="module")
def stack():
    yield from running_stack("--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0)


def _msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _stream(client, **kw) -> dict:
    """Run a streamed request; gather reasoning, content, per-index calls, finish_reason."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "firsts": {}}
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            extra = d.model_extra or {}
            out["reasoning"] += extra.get("reasoning_content") or ""
            out["content"] += d.content or ""
            for tc in d.tool_calls or []:
                if tc.index not in out["calls"]:
                    out["firsts"][tc.index] = tc
                    out["calls"][tc.index] = [tc.function.name, ""]
                else:
                    assert tc.id is None and tc.function.name is None
                out["calls"][tc.index][1] += tc.function.arguments or ""
            if ch.finish_reason:
                out["finish"] = ch.finish_reason
    return out


def _reasoning(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def test_think_tags_go_to_reasoning_content_streaming_equals_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=_msgs("please think"))
    m = r.choices[0].message
    assert (_reasoning(m), m.content, r.choices[0].finish_reason) == ("abc", "hello", "stop")
    s = _stream(client, messages=_msgs("please think"))
    assert (s["reasoning"], s["content"], s["finish"]) == ("abc", "hello", "stop")


def test_enable_thinking_false_leaves_everything_in_content(client):
    r = client.chat.completions.create(
        model=MODEL, messages=_msgs("please think"),
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    m = r.choices[0].message
    assert _reasoning(m) is None and m.content == SCRIPTED["please think"]


def _reasoning_content_finish(client, stream: bool, **kw) -> tuple:
    """(reasoning, content, finish_reason) of one chat completion, streamed or not."""
    if stream:
        s = _stream(client, **kw)
        return s["reasoning"], s["content"], s["finish"]
    r = client.chat.completions.create(model=MODEL, **kw)
    return (_reasoning(r.choices[0].message), r.choices[0].message.content,
            r.choices[0].finish_reason)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_inside_the_reasoning_does_not_stop_it(client, stream):
    got = _reasoning_content_finish(client, stream, messages=_msgs("please think"), stop=["b"])
    assert got == ("abc", "hello", "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_in_the_content_cuts_the_content(client, stream, stack):
    got = _reasoning_content_finish(client, stream, messages=_msgs("please think"), stop=["ll"])
    assert got == ("abc", "he", "stop")


def test_hermes_calls_parse_exactly_and_stream_concatenates_to_the_same_json(client):
    r = client.chat.completions.create(model=MODEL, messages=_msgs("please call"), tools=TOOLS)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert _reasoning(ch.message) == "hm"
    calls = ch.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == CALLED
    assert all(c.type == "function" and c.id for c in calls) and calls[0].id != calls[1].id
    s = _stream(client, messages=_msgs("please call"), tools=TOOLS)
    assert s["finish"] == "tool_calls" and s["reasoning"] == "hm" and s["content"] == ""
    assert sorted(s["calls"]) == [0, 1]
    assert [s["calls"][i] for i in (0, 1)] == [[c.function.name, c.function.arguments]
                                                for c in calls]
    assert all(f.id and f.type == "function" for f in s["firsts"].values())


@pytest.mark.parametrize("stream", [False, True])
def test_call_cut_by_max_tokens_is_closed_to_valid_json_and_matches(client, stream):
    kw = dict(messages=_msgs("please call"), tools=TOOLS, max_tokens=100)  # mid-"n"
    r = client.chat.completions.create(model=MODEL, **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "length"
    [call] = ch.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(args, dict)
    if stream:
        s = _stream(client, **kw)
        assert s["finish"] == "length"
        assert s["calls"] == {0: ["get_weather", call.function.arguments]}


def _cuts_before_the_arguments(stack) -> list[int]:
    """The max_tokens values that cut the scripted "please call" reply after the first
    call's name and before its arguments value, by the fake engine's own tokenization."""
    tok = Tokenizer.from_file(os.path.join(stack.model_dir, "tokenizer.json"))
    text = SCRIPTED["please call"]
    ids = tok.encode(text).ids
    lo = text.index('"get_weather"') + len('"get_weather"')
    hi = text.index('{"city"')
    return [n for n in range(1, len(ids)) if lo <= len(tok.decode(ids[:n])) <= hi]


def test_call_cut_before_its_arguments_is_returned_streaming_or_not(client, stack):
    cuts = _cuts_before_the_arguments(stack)
    assert cuts
    anth = anthropic.Anthropic(base_url=stack.url, api_key="none", max_retries=0)
    anth_tools = [{"name": t["function"]["name"],
                   "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for n in cuts:
        kw = dict(messages=_msgs("please call"), tools=TOOLS, max_tokens=n)
        ch = client.chat.completions.create(model=MODEL, **kw).choices[0]
        assert ch.finish_reason == "length", n
        assert [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []] == [
            ("get_weather", "{}")], n
        s = _stream(client, **kw)
        assert s["finish"] == "length" and s["calls"] == {0: ["get_weather", "{}"]}, n
        akw = dict(model=MODEL, max_tokens=n, tools=anth_tools, messages=_msgs("please call"))
        m = anth.messages.create(**akw)
        with anth.messages.stream(**akw) as st:
            streamed = st.get_final_message()
        for msg in (m, streamed):
            assert msg.stop_reason == "max_tokens", n
            assert [(b.name, b.input) for b in msg.content if b.type == "tool_use"] == [
                ("get_weather", {})], n


def test_stop_string_inside_a_call_is_no_finished_call_on_any_api(client, stack):
    """A stop string that ends the output inside a call's arguments (the model never closed it)
    leaves the call closed at a prefix, and the answer is not reported as a finished call:
    finish_reason "stop" (it was "tool_calls"); Anthropic reports the matched stop_sequence
    either way. A stop string after the first call, before the second's name, leaves one
    finished call: "tool_calls"."""
    kw = dict(messages=_msgs("please call"), tools=TOOLS, stop=["1234567890"])  # inside "n"
    ch = client.chat.completions.create(model=MODEL, **kw).choices[0]
    [call] = ch.message.tool_calls
    assert ch.finish_reason == "stop"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": 'P"<b>'}
    s = _stream(client, **kw)
    assert s["finish"] == "stop" and s["calls"] == {0: ["get_weather", call.function.arguments]}

    kw = dict(messages=_msgs("please call"), tools=TOOLS, stop=['"get_time'])
    ch = client.chat.completions.create(model=MODEL, **kw).choices[0]
    assert ch.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] == CALLED[:1]
    assert _stream(client, **kw)["finish"] == "tool_calls"

    a = anthropic.Anthropic(base_url=stack.url, api_key="none", max_retries=0)
    anth_tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    akw = dict(model=MODEL, max_tokens=1000, tools=anth_tools, messages=_msgs("please call"),
               stop_sequences=["1234567890"])
    m = a.messages.create(**akw)
    with a.messages.stream(**akw) as st:
        streamed = st.get_final_message()
    for msg in (m, streamed):
        assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "1234567890")
        assert [(b.name, b.input) for b in msg.content if b.type == "tool_use"] == [("get_weather", {"city": 'P"<b>'})]
    m = a.messages.create(**{**akw, "stop_sequences": ['"get_time']})  # Anthropic names the matched sequence
    assert (m.stop_reason, [(b.name, b.input) for b in m.content if b.type == "tool_use"]) == (
        "stop_sequence", CALLED[:1])


@pytest.mark.parametrize("choice", ["none", None])
def test_no_tool_calls_without_tools_or_with_tool_choice_none(client, choice):
    kw = {"tools": TOOLS, "tool_choice": choice} if choice else {}
    r = client.chat.completions.create(model=MODEL, messages=_msgs("please call"), **kw)
    m = r.choices[0].message
    assert not m.tool_calls and r.choices[0].finish_reason == "stop"
    assert "<tool_call>" in m.content and _reasoning(m) == "hm"


@pytest.mark.parametrize("choice,names", [("required", ["get_weather", "get_time"]),
                                          ({"type": "function",
                                            "function": {"name": "get_weather"}},
                                           ["get_weather"])])
def test_forced_tool_choice_sends_the_call_schema_and_parses_the_array(client, stack, choice,
                                                                       names):
    r = client.chat.completions.create(model=MODEL, messages=_msgs("please force"),
                                       tools=TOOLS, tool_choice=choice)
    sent = stack.engine.added[-1].sampling.structured
    assert sent.kind == "json_schema"
    schema = json.loads(sent.spec)
    items = schema["items"].get("anyOf", [schema["items"]])
    assert [i["properties"]["name"]["enum"] for i in items] == [[n] for n in names]
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls
            ] == [("get_weather", {"city": "Oslo", "n": 3})]
    s = _stream(client, messages=_msgs("please force"), tools=TOOLS, tool_choice=choice)
    assert s["calls"] == {0: ["get_weather", ch.message.tool_calls[0].function.arguments]}


def test_parallel_tool_calls_false_allows_one_forced_call(client, stack):
    client.chat.completions.create(model=MODEL, messages=_msgs("please force"), tools=TOOLS,
                                   tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(stack.engine.added[-1].sampling.structured.spec)
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)


def test_parallel_calls_off_passes_on_only_the_first_unforced_call(client, stack):
    """The scripted reply makes two calls without any constraint (tool_choice auto): with
    parallel calls off only the first comes back, on every API, streamed or not (both came
    back before, though OpenAI and Anthropic promise at most one)."""
    kw = dict(messages=_msgs("please call"), tools=TOOLS, parallel_tool_calls=False)
    r = client.chat.completions.create(model=MODEL, **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] \
        == CALLED[:1]
    s = _stream(client, **kw)
    assert s["finish"] == "tool_calls" and list(s["calls"]) == [0]
    assert s["calls"][0] == [CALLED[0][0], ch.message.tool_calls[0].function.arguments]

    resp_tools = [{"type": "function", **t["function"]} for t in TOOLS]
    out = client.responses.create(model=MODEL, input="please call", tools=resp_tools,
                                  parallel_tool_calls=False).output
    assert [(o.name, json.loads(o.arguments)) for o in out if o.type == "function_call"] \
        == CALLED[:1]

    a = anthropic.Anthropic(base_url=stack.url, api_key="none", max_retries=0)
    anth_tools = [{"name": t["function"]["name"],
                   "input_schema": t["function"].get("parameters", {"type": "object"})}
                  for t in TOOLS]
    akw = dict(model=MODEL, max_tokens=1000, tools=anth_tools, messages=_msgs("please call"),
               tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    m = a.messages.create(**akw)
    assert [(b.name, b.input) for b in m.content if b.type == "tool_use"] == CALLED[:1]
    assert m.stop_reason == "tool_use"
    with a.messages.stream(**akw) as st:
        final = st.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == CALLED[:1]
    # parallel calls on (the default): both
    m = a.messages.create(**{**akw, "tool_choice": {"type": "auto"}})
    assert [(b.name, b.input) for b in m.content if b.type == "tool_use"] == CALLED


BAD = [
    ("tools not a list", {"tools": {"type": "function"}}, "tools"),
    ("tool not an object", {"tools": ["f"]}, "tools[0]"),
    ("tool type", {"tools": [{"type": "web_search", "function": {"name": "f"}}]},
     "tools[0].type"),
    ("bad function name", {"tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name"),
    ("duplicate name", {"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].function.name"),
    ("parameters not an object", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ("unknown tool_choice", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ("unknown named tool", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_stock"}}}, "tool_choice.function.name"),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("tool message without id", {"messages": [{"role": "tool", "content": "x"}]},
     "messages[0].tool_call_id"),
    ("arguments not JSON", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("name,fields,param", BAD, ids=[b[0] for b in BAD])
def test_bad_tool_fields_get_400_naming_the_field(client, name, fields, param):
    body = {"model": MODEL, "messages": _msgs("hi")} | fields
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


def test_the_stream_of_a_bad_tool_request_fails_before_any_sse_byte(stack):
    r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=10, json={
        "model": MODEL, "messages": _msgs("hi"), "stream": True, "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")


def _engine_prompt(stack) -> str:
    """The prompt text of the engine's last AddRequest, decoded by the model's tokenizer."""
    tok = Tokenizer.from_file(os.path.join(stack.model_dir, "tokenizer.json"))
    return tok.decode(stack.engine.added[-1].prompt_token_ids, skip_special_tokens=False)


def test_tools_the_template_ignores_reach_the_prompt_and_the_call_round_trips(client, stack):
    # The stack's ChatML template renders only role and content (as SmolLM2's does).
    bare = client.chat.completions.create(model=MODEL, messages=_msgs("please call"))
    r = client.chat.completions.create(model=MODEL, messages=_msgs("please call"), tools=TOOLS)
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens
    prompt = _engine_prompt(stack)
    for t in TOOLS:
        assert json.dumps(t["function"]) in prompt
    assert "<tool_call></tool_call> XML tags" in prompt  # the hermes format the parser reads
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == CALLED
    history = _msgs("please call") + [
        {"role": "assistant", "content": None,
         "tool_calls": [c.model_dump(exclude_none=True) for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny."},
        {"role": "tool", "tool_call_id": calls[1].id, "content": "Noon."}]
    again = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
    assert again.usage.prompt_tokens > r.usage.prompt_tokens
    prompt = _engine_prompt(stack)
    turn = prompt.split("<|im_start|>assistant\n")[1]  # the earlier assistant turn
    shown = [json.loads(m) for m in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", turn)]
    assert [(c["name"], c["arguments"]) for c in shown] == CALLED
    assert "<tool_response>\nSunny.\n</tool_response>\n<tool_response>\nNoon." in prompt


def test_anthropic_tools_the_template_ignores_are_counted_and_rendered(stack):
    anth = anthropic.Anthropic(base_url=stack.url, api_key="none", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in TOOLS]
    msgs = _msgs("please call")
    bare = anth.messages.count_tokens(model=MODEL, messages=msgs).input_tokens
    counted = anth.messages.count_tokens(model=MODEL, messages=msgs, tools=tools).input_tokens
    assert counted > bare
    m = anth.messages.create(model=MODEL, max_tokens=8, messages=msgs, tools=tools)
    assert m.usage.input_tokens == counted
    assert json.dumps({"name": "get_weather",
                       "parameters": tools[0]["input_schema"]}) in _engine_prompt(stack)


@pytest.mark.parametrize("key", ["add_generation_prompt", "tools", "messages", "documents"])
def test_chat_template_kwargs_with_the_renderers_own_keys_is_400_naming_the_key(client, stack,
                                                                                key):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=_msgs("hi"), stream=stream,
                                           extra_body={"chat_template_kwargs": {key: True}})
        assert e.value.body["param"] == f"chat_template_kwargs.{key}"
        assert repr(key) in e.value.body["message"]
    r = httpx.post(f"{stack.url}/tokenize", timeout=10, json={
        "model": MODEL, "messages": _msgs("hi"), "chat_template_kwargs": {key: True}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == f"chat_template_kwargs.{key}"
