"""End to end as a user of the official `anthropic` SDK: `kestrel serve` with Kestrel's
qwen3 template, the hermes tool parser and the qwen3 reasoning parser, on SmolLM2 (its
answers mean nothing here: the tests check the API's invariants)."""

from __future__ import annotations

import base64
import io
import json

import anthropic
import httpx
import pytest

from tests.e2e.server import KestrelServer

MODEL = "SmolLM2-135M-Instruct"
TOOLS = [{"name": "get_weather", "description": "Weather of a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                            "days": {"type": "integer"}},
                           "required": ["city"]}}]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = KestrelServer(str(smollm2_dir), "--chat-template", "qwen3", "--tool-call-parser",
                        "hermes", "--reasoning-parser", "qwen3", "--max-model-len", "2048").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0,
                               timeout=120)


def _msgs(text="Name three colors."):
    return [{"role": "user", "content": text}]


def test_text_message_has_end_turn_or_max_tokens_and_usage(client):
    m = client.messages.create(model=MODEL, max_tokens=24, messages=_msgs(), extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in m.content)
    assert 0 < m.usage.output_tokens <= 24 and m.usage.input_tokens > 0


def test_max_tokens_cuts_with_stop_reason_max_tokens(client):
    m = client.messages.create(model=MODEL, max_tokens=3, messages=_msgs("Write a long story."))
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_stream_follows_the_documented_event_order_and_matches_non_streaming(client):
    kw = dict(model=MODEL, max_tokens=20, messages=_msgs(), extra_body={"temperature": 0})
    events = list(client.messages.create(**kw, stream=True))
    types = [e.type for e in events if e.type != "ping"]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    body = types[1:-2]
    i = 0
    while i < len(body):  # start, deltas, stop per block, indices in order
        assert body[i] == "content_block_start"
        j = body.index("content_block_stop", i)
        assert set(body[i + 1:j]) <= {"content_block_delta"}
        i = j + 1
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    final = client.messages.create(**kw)
    assert text == "".join(b.text for b in final.content)
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason == final.stop_reason
    assert delta.usage.output_tokens == final.usage.output_tokens


def test_stop_sequence_is_reported_and_not_in_the_text(client):
    free = client.messages.create(model=MODEL, max_tokens=24, messages=_msgs(), extra_body={"temperature": 0})
    text = "".join(b.text for b in free.content)
    words = [w for w in text.split() if len(w) > 2]
    if not words:
        pytest.skip("the model's answer has no word to stop at")
    stop = words[len(words) // 2]
    m = client.messages.create(model=MODEL, max_tokens=24, messages=_msgs(), extra_body={"temperature": 0},
                               stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    got = "".join(b.text for b in m.content)
    assert stop not in got and text.startswith(got.rstrip()[:len(got.rstrip())])
    stream = list(client.messages.create(model=MODEL, max_tokens=24, messages=_msgs(),
                                         extra_body={"temperature": 0}, stop_sequences=[stop], stream=True))
    d = next(e for e in stream if e.type == "message_delta")
    assert d.delta.stop_reason == "stop_sequence" and d.delta.stop_sequence == stop


def test_count_tokens_equals_usage_input_tokens(client):
    kw = dict(model=MODEL, system=[{"type": "text", "text": "You are terse."}], tools=TOOLS,
              messages=[{"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                                           "name": "get_weather",
                                                           "input": {"city": "Paris"}}]},
                        {"role": "user", "content": [{"type": "tool_result",
                                                      "tool_use_id": "toolu_1",
                                                      "content": "sunny"}]}])
    n = client.messages.count_tokens(**kw).input_tokens
    m = client.messages.create(max_tokens=4, **kw)
    assert n == m.usage.input_tokens > 0


def test_thinking_enabled_and_disabled_render_different_prompts(client):
    on = client.messages.count_tokens(model=MODEL, messages=_msgs(),
                                      thinking={"type": "enabled", "budget_tokens": 1024})
    off = client.messages.count_tokens(model=MODEL, messages=_msgs())
    assert off.input_tokens > on.input_tokens  # disabled: an empty <think></think> block
    kw = dict(model=MODEL, max_tokens=1100, messages=_msgs(),
              thinking={"type": "enabled", "budget_tokens": 1024})
    with client.messages.stream(**kw) as s:  # accepted; read a few events, then hang up
        seen = [e.type for _, e in zip(range(6), s)]
    assert seen[0] == "message_start"
    with pytest.raises(anthropic.BadRequestError):  # budget must be below max_tokens
        client.messages.create(**(kw | {"max_tokens": 1000}))


def _png() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), "red").save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("case,status,etype", [
    ("max_tokens_0", 400, "invalid_request_error"),
    ("unknown_model", 404, "not_found_error"),
    ("prompt_too_long", 400, "invalid_request_error"),
    ("malformed", 400, "invalid_request_error"),
    ("bad_image", 400, "invalid_request_error"),
    ("good_image", 400, "invalid_request_error"),
    ("wrong_method", 405, "invalid_request_error"),
])
def test_errors_use_anthropics_envelope(server, case, status, etype):
    body = {"model": MODEL, "max_tokens": 8, "messages": _msgs()}
    method, raw = "POST", None
    if case == "max_tokens_0":
        body["max_tokens"] = 0
    elif case == "unknown_model":
        body["model"] = "claude-nonexistent"
    elif case == "prompt_too_long":
        body["messages"] = _msgs("hello " * 5000)
    elif case == "malformed":
        raw = b'{"model": "x", "messages": [}'
    elif case in ("bad_image", "good_image"):
        data = _png() if case == "good_image" else base64.b64encode(b"not an image").decode()
        body["messages"] = [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
            {"type": "text", "text": "What is this?"}]}]
    elif case == "wrong_method":
        method = "GET"
    r = httpx.request(method, server.base_url + "/v1/messages",
                      content=raw if raw is not None else json.dumps(body),
                      headers={"x-api-key": "k", "anthropic-version": "2023-06-01",
                               "content-type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == etype
    assert "Traceback" not in err["error"]["message"] and "{'" not in err["error"]["message"]
    if case == "bad_image":
        assert "Invalid image" in err["error"]["message"]
    if case == "good_image":
        assert "does not support images" in err["error"]["message"]


def test_sdk_raises_typed_errors(client):
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=0, messages=_msgs())
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=4, messages=_msgs())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_tool_choice_forces_a_valid_tool_use(client, choice, stream):
    kw = dict(model=MODEL, max_tokens=200, tools=TOOLS, tool_choice=choice, extra_body={"temperature": 0},
              messages=_msgs("What is the weather in Paris?"))
    if stream:
        with client.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**kw)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and all(u.name == "get_weather" for u in uses)
    if m.stop_reason == "tool_use":
        assert all(isinstance(u.input.get("city"), str) for u in uses)


COLOR_SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                 "sure": {"type": "boolean"}},
                "required": ["color", "sure"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_output_config_format_gives_json_valid_against_the_schema(client, stream):
    """The real model under output_config.format: the text is JSON that jsonschema
    accepts, streamed or not (thinking adaptive is on: the format turns the reasoning
    part off)."""
    import jsonschema

    kw = dict(model=MODEL, max_tokens=60, messages=_msgs("Pick a color."),
              thinking={"type": "adaptive"},
              output_config={"effort": "low",
                             "format": {"type": "json_schema", "schema": COLOR_SCHEMA}})
    if stream:
        with client.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**kw)
    assert m.stop_reason == "end_turn", m
    text = "".join(b.text for b in m.content if b.type == "text")
    jsonschema.validate(json.loads(text), COLOR_SCHEMA)


def test_the_sdks_parse_returns_the_pydantic_object(client):
    """`messages.parse(output_format=Model)`: the SDK sends output_config.format and
    validates the answer into the model."""
    import typing

    import pydantic

    class Pick(pydantic.BaseModel):
        color: typing.Literal["red", "green", "blue"]
        sure: bool

    m = client.messages.parse(model=MODEL, max_tokens=60, messages=_msgs("Pick a color."),
                              output_format=Pick)
    assert isinstance(m.parsed_output, Pick)


def test_stream_message_delta_usage_has_the_input_tokens(client):
    kw = dict(model=MODEL, max_tokens=8, messages=_msgs(), extra_body={"temperature": 0})
    events = list(client.messages.create(**kw, stream=True))
    start = next(e for e in events if e.type == "message_start").message.usage
    delta = next(e for e in events if e.type == "message_delta").usage
    assert isinstance(delta.input_tokens, int) and delta.input_tokens == start.input_tokens > 0
    assert delta.cache_read_input_tokens == delta.cache_creation_input_tokens == 0
    whole = client.messages.create(**kw).usage
    assert (delta.input_tokens, delta.output_tokens) == (whole.input_tokens, whole.output_tokens)


def test_thinking_adaptive_and_a_mid_conversation_system_message_are_served(client):
    """Claude Code's first request shape, on the real model: accepted and answered."""
    m = client.messages.create(
        model=MODEL, max_tokens=8, thinking={"type": "adaptive"},
        system=[{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Say hi."},
                  {"role": "system", "content": "Answer in one word."}],
        extra_body={"context_management": {"edits": []}})
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.input_tokens > 0


def test_an_unknown_field_is_a_400_naming_it(client):
    with pytest.raises(anthropic.BadRequestError, match="response_format: Extra inputs are "
                                                         "not permitted"):
        client.messages.create(model=MODEL, max_tokens=4, messages=_msgs(),
                               extra_body={"response_format": {"type": "json_object"}})
