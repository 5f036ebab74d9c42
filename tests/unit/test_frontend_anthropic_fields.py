"""The Messages API as the current Anthropic reference and Claude Code use it, against a
real frontend subprocess (Kestrel's qwen3 template, the qwen3 reasoning parser) and the
fake engine: mid-conversation system messages, every thinking type, output_config,
the known top-level fields (the installed `anthropic` SDK's own request types are the
list), unknown fields refused as Anthropic refuses them, and a complete
message_delta.usage. Responses are read with the `anthropic` SDK or as raw SSE."""

from __future__ import annotations

import json
import typing

import anthropic
import httpx
import orjson
import pytest
from anthropic.types import message_create_params as stable_params
from anthropic.types.beta import message_create_params as beta_params

from tests.unit.test_frontend_support import MODEL, Stack

OK = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}},
          "required": ["color"], "additionalProperties": False}
# Body keys that the SDK sends as headers (anthropic-beta, anthropic-user-profile-id,
# anthropic-workspace-id), not in the body.
SDK_HEADER_PARAMS = {"betas", "user_profile_id", "workspace_id"}


@pytest.fixture(scope="module")
def stack():
    s = Stack("--chat-template", "qwen3", "--reasoning-parser", "qwen3")
    try:
        s.start_engine()
        s.engine.info.max_model_len = 4096  # room for max_tokens above a 1024 thinking budget
        s.start_frontend()
        s.wait_healthy()
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def client(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=30)


def _post(stack, body: dict, path: str = "/v1/messages", **headers: str) -> httpx.Response:
    return httpx.post(stack.url + path, content=json.dumps(body), timeout=30,
                      headers={"content-type": "application/json",
                               "anthropic-version": "2023-06-01", **headers})


def _prompt(stack) -> str:
    """The text of the last prompt the engine was sent (special tokens kept)."""
    ids = stack.engine.added[-1].prompt_token_ids
    return stack.engine.tokenizer.decode(ids, skip_special_tokens=False)


def _sse(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


def _error(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    doc = r.json()
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error", doc
    return doc["error"]["message"]


# ---------------------------------------------------------------- mid-conversation system

CONVERSATION = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
                {"role": "system", "content": [
                    {"type": "text", "text": "Answer in French.",
                     "cache_control": {"type": "ephemeral"}}]},
                {"role": "user", "content": "Bye"}]


def test_a_system_message_inside_messages_is_a_system_turn_where_it_stands(stack, client):
    """The same conversation through the OpenAI chat route (which has always taken system
    messages anywhere) gives the same prompt tokens; count_tokens counts them."""
    m = client.messages.create(model=MODEL, max_tokens=4, messages=CONVERSATION,
                               system="Be brief.")
    anthropic_ids = stack.engine.added[-1].prompt_token_ids
    assert "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>system\nAnswer in French." \
        "<|im_end|>\n<|im_start|>user\nBye" in _prompt(stack)
    openai_messages = [{"role": "system", "content": "Be brief."}] + [
        {"role": x["role"], "content": x["content"] if isinstance(x["content"], str)
         else x["content"][0]["text"]} for x in CONVERSATION]
    r = httpx.post(stack.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 4, "messages": openai_messages,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    assert stack.engine.added[-1].prompt_token_ids == anthropic_ids
    n = client.messages.count_tokens(model=MODEL, messages=CONVERSATION, system="Be brief.")
    assert n.input_tokens == m.usage.input_tokens == len(anthropic_ids)


def test_a_system_message_last_in_messages_as_claude_code_sends_it(stack):
    r = _post(stack, OK | {"messages": [{"role": "user", "content": "hi"},
                                        {"role": "system", "content": "Agents: none."}]})
    assert r.status_code == 200, r.text
    assert _prompt(stack).endswith("<|im_start|>system\nAgents: none.<|im_end|>\n"
                                   "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_system_message_holds_only_text(stack):
    bad = {"role": "system", "content": [{"type": "image", "source": {}}]}
    msg = _error(_post(stack, OK | {"messages": OK["messages"] + [bad]}))
    assert msg.startswith("messages.1.content.0:"), msg
    msg = _error(_post(stack, OK | {"messages": [{"role": "robot", "content": "x"}]}))
    assert msg == "messages.0.role: Input should be 'user', 'assistant' or 'system'."


# ---------------------------------------------------------------- thinking

THINKING = {  # thinking value -> the reasoning is on
    "enabled": ({"type": "enabled", "budget_tokens": 1024}, True),
    "adaptive": ({"type": "adaptive"}, True),
    "adaptive_summarized": ({"type": "adaptive", "display": "summarized"}, True),
    "disabled": ({"type": "disabled"}, False),
    "between_tools": ({"type": "between_tools"}, False),
    "absent": (None, False),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(THINKING))
def test_every_thinking_type_sets_the_templates_switch_and_the_reasoning_split(
        client, stack, case, stream):
    """The fake model answers "<think>abc</think>hello": with thinking on, a thinking
    block "abc" and a text block "hello"; off, the template closes an empty reasoning
    part in the prompt and the answer is all text."""
    value, on = THINKING[case]
    kw: dict = dict(model=MODEL, max_tokens=2000,
                    messages=[{"role": "user", "content": "please think"}])
    if value is not None:
        kw["thinking"] = value
    if stream:
        with client.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**kw)
    empty_reasoning = _prompt(stack).endswith("<think>\n\n</think>\n\n")
    if on:
        assert not empty_reasoning
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
                for b in m.content] == [("thinking", "abc"), ("text", "hello")]
    else:
        assert empty_reasoning
        assert [(b.type, b.text) for b in m.content] == [("text", "<think>abc</think>hello")]


@pytest.mark.parametrize("kind", ["enabled", "adaptive"])
def test_thinking_display_omitted_keeps_the_block_without_its_text(client, stack, kind):
    value = {"type": kind, "display": "omitted"} | (
        {"budget_tokens": 1024} if kind == "enabled" else {})
    kw = dict(model=MODEL, max_tokens=2000, thinking=value,
              messages=[{"role": "user", "content": "please think"}])
    m = client.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "" and m.content[1].text == "hello"
    with httpx.stream("POST", stack.url + "/v1/messages", json=kw | {"stream": True},
                      timeout=30) as r:
        events = _sse(b"".join(r.iter_bytes()))
    deltas = [e["delta"]["type"] for name, e in events if name == "content_block_delta"]
    assert "thinking_delta" not in deltas and "text_delta" in deltas


@pytest.mark.parametrize("value,param", [
    ({"type": "sometimes"}, "thinking.type"),
    ({"type": "enabled"}, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": 9000}, "thinking.budget_tokens"),  # >= max_tokens
    ({"type": "adaptive", "display": "loud"}, "thinking.display"),
    ({"type": "disabled", "display": "omitted"}, "thinking.display"),
])
def test_a_bad_thinking_value_is_a_400_naming_its_field(stack, value, param):
    msg = _error(_post(stack, OK | {"max_tokens": 2000, "thinking": value}))
    assert msg.startswith(param + ":"), msg


# ---------------------------------------------------------------- output_config

def test_output_config_format_is_the_engines_json_schema_constraint(client, stack):
    """The schema reaches the engine as its grammar spec, as OpenAI's response_format
    does (the same machinery); effort is accepted; the reasoning switch is off."""
    client.messages.create(model=MODEL, max_tokens=8, messages=OK["messages"],
                           thinking={"type": "adaptive"},
                           output_config={"effort": "low",
                                          "format": {"type": "json_schema", "schema": SCHEMA}})
    spec = stack.engine.added[-1].sampling.structured
    assert spec is not None and spec.kind == "json_schema"
    assert orjson.loads(spec.spec) == SCHEMA
    assert _prompt(stack).endswith("<think>\n\n</think>\n\n")
    r = httpx.post(stack.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 8, "messages": OK["messages"],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "x", "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    assert stack.engine.added[-1].sampling.structured == spec


def test_the_sdks_parse_sends_output_config_format(client, stack):
    """`messages.parse(output_format=Model)`: the SDK turns a pydantic model into
    output_config.format; the constraint the engine gets is that schema."""
    import pydantic

    class Answer(pydantic.BaseModel):
        color: typing.Literal["red", "blue"]

    try:
        client.messages.parse(model=MODEL, max_tokens=8, messages=OK["messages"],
                              output_format=Answer)
    except Exception:  # the fake model's reply is not JSON: the SDK's parse fails on it
        pass
    spec = stack.engine.added[-1].sampling.structured
    assert spec is not None and orjson.loads(spec.spec)["properties"]["color"]["enum"] == [
        "red", "blue"]


@pytest.mark.parametrize("config,param", [
    ({"format": {"type": "json_object"}}, "output_config.format.type"),
    ({"format": {"type": "json_schema"}}, "output_config.format.schema"),
    ({"format": {"type": "json_schema", "schema": {"type": "nonsense"}}},
     "output_config.format.schema"),
    ({"effort": "maximal"}, "output_config.effort"),
    ("high", "output_config"),
])
def test_a_bad_output_config_is_a_400_naming_its_field(stack, config, param):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        msg = _error(_post(stack, OK | {"output_config": config}, path))
        assert msg.startswith(param + ":"), msg


def test_a_forced_tool_call_replaces_the_format_constraint(stack):
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    r = _post(stack, OK | {"tools": tools, "tool_choice": {"type": "any"},
                           "output_config": {"format": {"type": "json_schema",
                                                        "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    spec = stack.engine.added[-1].sampling.structured
    assert spec is not None and orjson.loads(spec.spec) != SCHEMA


# ---------------------------------------------------------------- known and unknown fields

def test_an_unknown_top_level_field_is_a_400_naming_it_as_anthropic_does(client, stack):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**OK, extra_body={"response_format": {"type": "json_object"}})
    assert e.value.body["error"]["message"] == "response_format: Extra inputs are not permitted"
    msg = _error(_post(stack, OK | {"foo": 1, "n": 2}, "/v1/messages/count_tokens"))
    assert msg == "foo: Extra inputs are not permitted; n: Extra inputs are not permitted"


def _sdk_fields() -> set[str]:
    """Every body field of the installed SDK's Messages request types, stable and beta."""
    names: set[str] = set()
    for mod in (stable_params, beta_params):
        for cls in (mod.MessageCreateParamsStreaming, mod.MessageCreateParamsNonStreaming):
            for k in cls.__mro__:
                names |= set(getattr(k, "__annotations__", {}))
    return names - SDK_HEADER_PARAMS


def test_every_field_of_the_sdks_request_types_is_accepted(stack):
    fields = _sdk_fields()
    assert {"output_config", "context_management", "cache_control", "service_tier"} <= fields
    body = dict(OK)
    for name in sorted(fields - set(body)):
        body[name] = None  # optional: null is the same as absent
    r = _post(stack, body)
    assert r.status_code == 200, r.text
    r = _post(stack, {k: v for k, v in body.items() if k != "max_tokens"},
              "/v1/messages/count_tokens")
    assert r.status_code == 200, r.text


def test_a_request_shaped_as_claude_codes_is_served(stack):
    """The fields, headers and query of Claude Code 2.1's first request (tools cut to
    one): cache_control on system, message and tool blocks, thinking adaptive,
    context_management, output_config.effort, metadata.user_id, a system message last,
    anthropic-beta headers, ?beta=true; streamed. Its usage is complete."""
    body = {
        "model": MODEL, "max_tokens": 32, "stream": True,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
                   {"type": "text", "text": "You are a Claude agent.",
                    "cache_control": {"type": "ephemeral", "ttl": "1h", "scope": "global"}}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
            {"type": "text", "text": "Say hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Available agent types: none."}],
        "tools": [{"name": "Agent", "description": "Launch an agent.",
                   "input_schema": {"type": "object", "properties": {
                       "prompt": {"type": "string"}}, "required": ["prompt"]},
                   "cache_control": {"type": "ephemeral"}}],
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "cache_control": {"type": "ephemeral"},
    }
    beta = ("claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
            "mid-conversation-system-2026-04-07,effort-2025-11-24")
    with httpx.stream("POST", stack.url + "/v1/messages?beta=true", json=body, timeout=30,
                      headers={"anthropic-beta": beta, "anthropic-version": "2023-06-01",
                               "x-api-key": "sk-unused", "x-app": "cli"}) as r:
        assert r.status_code == 200, r.read()
        events = _sse(b"".join(r.iter_bytes()))
    assert events[-1][0] == "message_stop", events
    start = events[0][1]["message"]["usage"]
    final = next(e for name, e in events if name == "message_delta")["usage"]
    assert final["input_tokens"] == start["input_tokens"] == len(
        stack.engine.added[-1].prompt_token_ids)


# ---------------------------------------------------------------- Anthropic's own 400s

USER = [{"role": "user", "content": "hi"}]
TOOL = {"name": "get_weather", "input_schema": {"type": "object"}}


@pytest.mark.parametrize("change,param,says", [
    ({"messages": [{"role": "user", "content": []}]}, "messages.0",
     "all messages must have non-empty content except for the optional final assistant message"),
    ({"messages": [*USER, {"role": "assistant", "content": []}, *USER]}, "messages.1",
     "all messages must have non-empty content"),
    # an empty string is empty content too (it used to be sent to the model)
    ({"messages": [{"role": "user", "content": ""}]}, "messages.0",
     "all messages must have non-empty content except for the optional final assistant message"),
    ({"messages": [*USER, {"role": "assistant", "content": ""}, *USER]}, "messages.1",
     "all messages must have non-empty content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
     "messages.0.content.0.text", "text content blocks must be non-empty"),
    ({"system": [{"type": "text", "text": ""}]}, "system.0.text", "text content blocks must be non-empty"),
    ({"tools": [{**TOOL, "name": "bad name!"}]}, "tools.0.name",
     "String should match pattern '^[a-zA-Z0-9_-]{1,128}$'"),
    ({"tools": [{**TOOL, "name": "f" * 129}]}, "tools.0.name", "String should match pattern"),
    ({"tools": [{**TOOL, "strict": "yes"}]}, "tools.0.strict", "Input should be a boolean"),
    ({"cache_control": "yes"}, "cache_control", "Input should be an object"),
    ({"cache_control": {"type": "forever"}}, "cache_control.type", "Input should be 'ephemeral'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": "yes"}]}]},
     "messages.0.content.0.cache_control", "Input should be an object"),
    ({"tools": [{**TOOL, "cache_control": "yes"}]}, "tools.0.cache_control", "Input should be an object"),
    # capped as OpenAI's `stop` (16 of at most 256 characters): they were unlimited
    ({"stop_sequences": [f"s{i}" for i in range(17)]}, "stop_sequences", "At most 16 stop sequences"),
    ({"stop_sequences": ["x" * 257]}, "stop_sequences", "of at most 256 characters"),
], ids=["user content empty", "middle assistant content empty", "user content ''",
        "middle assistant content ''", "empty text block",
        "empty system text block", "tool name with a space", "tool name of 129", "strict not a boolean",
        "cache_control a string", "cache_control of another type", "block cache_control a string",
        "tool cache_control a string", "17 stop sequences", "a stop sequence of 257 characters"])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_what_anthropic_refuses_is_a_400_in_its_envelope(client, stack, change, param, says, path):
    body = OK | change
    if path.endswith("count_tokens"):
        body = {k: v for k, v in body.items() if k != "max_tokens"}
    msg = _error(_post(stack, body, path))
    assert msg.startswith(f"{param}: ") and says in msg, msg
    if path == "/v1/messages":  # as the SDK reads it
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(**body)
        assert e.value.body["error"]["message"] == msg


def test_a_final_assistant_message_may_be_empty_and_a_real_tool_name_serves(client, stack):
    tools = [{**TOOL, "name": "mcp__files-server__read_file", "strict": True,
              "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    r = client.messages.create(model=MODEL, max_tokens=8, tools=tools, messages=[
        *USER, {"role": "assistant", "content": []}])
    assert r.stop_reason in ("end_turn", "max_tokens"), r


# ---------------------------------------------------------------- usage

def test_message_delta_usage_is_the_messages_usage(client, stack):
    """The final message_delta carries input_tokens (an int, not null), output_tokens and
    the cache counts, equal to the non-streaming usage of the same request, as the SDK
    reads them."""
    kw = dict(model=MODEL, max_tokens=6, messages=OK["messages"])
    whole = client.messages.create(**kw).usage
    events = list(client.messages.create(**kw, stream=True))
    delta = next(e for e in events if e.type == "message_delta").usage
    assert isinstance(delta.input_tokens, int)
    for name in ("input_tokens", "output_tokens", "cache_creation_input_tokens",
                 "cache_read_input_tokens"):
        assert getattr(delta, name) == getattr(whole, name), name
    assert whole.cache_creation_input_tokens == whole.cache_read_input_tokens == 0
    assert whole.input_tokens == client.messages.count_tokens(**{
        k: v for k, v in kw.items() if k != "max_tokens"}).input_tokens


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "bad"}])
def test_a_forced_tools_schema_that_does_not_compile_is_a_400_naming_it_before_the_engine(stack, choice):
    """It was the engine's refusal ("The engine rejected the request: json_schema failed to
    compile"), with no field named. count_tokens compiles nothing: it still answers."""
    tools = [TOOL, {"name": "bad", "input_schema": {"type": "nonsense"}}]
    n_added = len(stack.engine.added)
    msg = _error(_post(stack, OK | {"tools": tools, "tool_choice": choice}))
    assert msg.startswith("tools.1.input_schema: The JSON schema cannot be compiled"), msg
    assert len(stack.engine.added) == n_added
    body = {k: v for k, v in OK.items() if k != "max_tokens"} | {"tools": tools, "tool_choice": choice}
    assert _post(stack, body, "/v1/messages/count_tokens").status_code == 200


def test_a_final_assistant_message_may_be_empty_as_string_or_array(stack):
    """Only the final assistant message may be empty: "" is accepted there, as []."""
    for empty in ("", []):
        body = OK | {"messages": [*USER, {"role": "assistant", "content": empty}]}
        r = _post(stack, body)
        assert r.status_code == 200, r.text
