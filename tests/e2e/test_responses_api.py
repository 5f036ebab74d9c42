"""End to end as a user of the OpenAI Responses API (POST /v1/responses): the official
`openai` SDK (`client.responses.create`, streamed and not), its pydantic types validating
the raw JSON of every response and event, and `openai-agents`' default model (the Responses
API) running an agent with a tool. `kestrel serve` runs SmolLM2 with Kestrel's qwen3
template, the hermes tool-call parser and the qwen3 reasoning parser; its answers mean
nothing here: the tests check the API's invariants (forced calls are valid whatever the
weights, through the structured-output constraint). A second server, whose template opens
the `<think>` block for the model (as reasoning models' templates do), shows the reasoning
items."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.e2e.server import KestrelServer

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city.",
          "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                                "description": "Weather of a city.",
                                                "parameters": WEATHER}}]
ASK = "What is the weather in Paris?"
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = KestrelServer(str(smollm2_dir), "--chat-template", "qwen3", "--tool-call-parser",
                        "hermes", "--reasoning-parser", "qwen3", "--max-model-len", "2048")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _raw(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/responses", json={"model": MODEL, **body},
                      timeout=120)


def _raw_events(server, body: dict) -> list[dict]:
    """The events of a streamed answer as sent, each validated by the SDK's types (strict
    on the `event:` name matching `type`), with sequence numbers 0, 1, 2, ..."""
    events, name = [], None
    with httpx.stream("POST", f"{server.base_url}/v1/responses", timeout=120,
                      json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                EVENTS.validate_python(data)
                events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_text_input_answers_a_response_the_sdk_types_validate(client, server):
    r = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8,
                                temperature=0, instructions="You are terse.")
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output_text and r.usage.output_tokens == 8
    assert r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.instructions == "You are terse." and r.max_output_tokens == 8
    # the prompt is the template's: instructions as the system message, then the input
    counted = httpx.post(f"{server.base_url}/tokenize", timeout=30, json={
        "model": MODEL, "messages": [{"role": "system", "content": "You are terse."},
                                     {"role": "user", "content": "Say hello."}]}).json()
    assert r.usage.input_tokens == counted["count"]
    raw = _raw(server, {"input": "Say hello.", "max_output_tokens": 8, "temperature": 0,
                        "instructions": "You are terse."}).json()
    Response.model_validate(raw)
    assert raw["output"][0]["content"][0]["text"] == r.output_text  # greedy: the same


def test_stream_events_build_the_same_response_as_non_streamed(client, server):
    body = {"input": [{"role": "developer", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]}],
            "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(model=MODEL, **body)
    types, text, final = [], "", None
    for ev in client.responses.create(model=MODEL, stream=True, **body):
        types.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        elif ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert final is not None and final.output_text == text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    events = _raw_events(server, body)
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["text"] == text


def test_structured_output_follows_the_json_schema(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Give a number.", temperature=0,
                                max_output_tokens=40, text={"format": {
                                    "type": "json_schema", "name": "num", "schema": schema}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}],
                         ids=["required", "named"])
def test_function_tool_round_trip(client, server, choice):
    first = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice=choice,
                                    temperature=0, max_output_tokens=80)
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and calls and first.output_text == ""
    for c in calls:
        assert c.name == "get_weather" and c.call_id and c.status == "completed"
        jsonschema.validate(json.loads(c.arguments), WEATHER)
    # streamed: the same calls, argument deltas concatenating to the done arguments
    events = _raw_events(server, {"input": ASK, "tools": TOOLS, "tool_choice": choice,
                                  "temperature": 0, "max_output_tokens": 80})
    deltas = "".join(e["delta"] for e in events
                     if e["type"] == "response.function_call_arguments.delta")
    dones = [e["arguments"] for e in events
             if e["type"] == "response.function_call_arguments.done"]
    assert deltas == "".join(dones) and dones == [c.arguments for c in calls]
    # fed back: the call and its output are rendered into the prompt, and answered in text
    call = calls[0]
    second = client.responses.create(
        model=MODEL, tools=TOOLS, temperature=0, max_output_tokens=16,
        input=[{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "Sunny, 21 C."}])
    assert second.status in ("completed", "incomplete")
    assert [o.type for o in second.output] == ["message"] and second.output_text
    counted = httpx.post(f"{server.base_url}/tokenize", timeout=30, json={
        "model": MODEL, "tools": CHAT_TOOLS, "messages": [
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call.call_id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C."}]}).json()
    assert second.usage.input_tokens == counted["count"]


def test_tool_choice_none_leaves_tools_out_and_never_calls(client):
    r = client.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice="none",
                                max_output_tokens=8)
    bare = client.responses.create(model=MODEL, input=ASK, max_output_tokens=8)
    assert all(o.type == "message" for o in r.output)
    assert r.usage.input_tokens == bare.usage.input_tokens


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{"}]},
     "input[0].call_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s",
                                        "schema": {"type": "nonsense"}}}},
     "text.format.schema"),
    ({"input": "x", "stream_options": "x"}, "stream_options"),
    ({"input": "x", "stream_options": {"include_obfuscation": "yes"}}, "stream_options.include_obfuscation"),
    ({"input": "x", "tools": [{**TOOLS[0], "strict": "yes"}]}, "tools[0].strict"),
    ({"input": [{"role": "user", "content": []}]}, "input[0].content"),
], ids=["empty input", "no input", "bad role", "image", "call without call_id",
        "item reference", "previous_response_id", "hosted tool", "bad tool name",
        "unknown named tool", "required without tools", "zero max_output_tokens",
        "past the context", "temperature", "bad schema", "stream_options a string",
        "include_obfuscation not a boolean", "strict not a boolean", "user content empty"])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_gets_400_in_openai_envelope(client, body, param, stream):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, stream=stream, **body)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["message"]
    assert e.value.response.json()["error"]["type"] == "invalid_request_error"


def test_unknown_model_gets_404_and_bad_json_400(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="gpt-nope", input="x")
    assert e.value.body["code"] == "model_not_found"
    r = httpx.post(f"{server.base_url}/v1/responses", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_openai_agents_default_model_runs_agents_streamed_and_with_a_tool(server):
    agents = pytest.importorskip("agents")
    from agents import (Agent, ModelSettings, OpenAIProvider, RunConfig, Runner,
                        function_tool)

    class Answer(pydantic.BaseModel):  # a short JSON answer: the tiny model's text ends
        sunny: bool

    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        seen.append(city)
        return "Sunny, 21 C."

    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                max_retries=0, timeout=120)
    provider = OpenAIProvider(openai_client=client, use_responses=True)
    assert isinstance(provider.get_model(MODEL), agents.OpenAIResponsesModel)
    config = RunConfig(model_provider=provider, tracing_disabled=True)
    settings = {"temperature": 0, "max_tokens": 64}
    plain = Agent(name="plain", instructions="Is it sunny?", model=MODEL, output_type=Answer,
                  model_settings=ModelSettings(**settings))
    tooled = Agent(name="weather", instructions="Answer with the weather.", model=MODEL,
                   tools=[get_weather], output_type=Answer,
                   model_settings=ModelSettings(tool_choice="required", **settings))

    async def run() -> tuple[object, list[str], object]:
        streamed = Runner.run_streamed(plain, "Paris today.", run_config=config)
        kinds = [e.type async for e in streamed.stream_events()]
        return streamed, kinds, await Runner.run(tooled, ASK, run_config=config, max_turns=4)

    streamed, kinds, result = asyncio.run(run())
    assert isinstance(streamed.final_output, Answer) and "raw_response_event" in kinds
    # turn 1 forced the call (the agent ran the tool); turn 2 (tool_choice reset to auto)
    # got the call and its output back as input items and answered
    assert seen and isinstance(result.final_output, Answer)
    items = [item.type for item in result.new_items]
    assert items[:2] == ["tool_call_item", "tool_call_output_item"]
    assert items[-1] == "message_output_item"


@pytest.fixture(scope="module")
def thinking_server(smollm2_dir, repo_root, tmp_path_factory):
    """A server whose template opens `<think>` for the model when thinking is on."""
    source = (repo_root / "shared/chat_templates/qwen3.jinja").read_text()
    closed = "{% if not thinking %}<think>\n\n</think>\n\n{% endif -%}"
    assert closed in source
    path = tmp_path_factory.mktemp("tpl") / "think.jinja"
    path.write_text(source.replace(closed, closed.replace(
        "{% endif -%}", "{% else %}<think>\n{% endif -%}")))
    srv = KestrelServer(str(smollm2_dir), "--chat-template", str(path), "--reasoning-parser",
                        "qwen3", "--max-model-len", "1024")
    srv.start()
    yield srv
    srv.stop()


def test_reasoning_comes_back_as_a_reasoning_item_and_is_accepted_as_input(thinking_server):
    c = openai.OpenAI(base_url=f"{thinking_server.base_url}/v1", api_key="unused",
                      max_retries=0, timeout=120)
    body = {"input": "Think about the sea.", "max_output_tokens": 12, "temperature": 0}
    r = c.responses.create(model=MODEL, **body)
    reasoning = [o for o in r.output if o.type == "reasoning"]
    assert reasoning and r.output[0].type == "reasoning"
    text = "".join(p.text for p in reasoning[0].content)
    assert text and "<think>" not in text and text not in r.output_text
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    events = _raw_events(thinking_server, body)
    streamed = "".join(e["delta"] for e in events
                       if e["type"] == "response.reasoning_text.delta")
    assert streamed == text
    assert any(e["type"] == "response.reasoning_text.done" and e["text"] == text
               for e in events)
    # reasoning.effort "none" turns thinking off: no reasoning item
    off = c.responses.create(model=MODEL, reasoning={"effort": "none"}, **body)
    assert all(o.type == "message" for o in off.output)
    # the earlier output fed back, reasoning item included
    again = c.responses.create(model=MODEL, max_output_tokens=4, input=[
        {"role": "user", "content": "Think about the sea."},
        *[o.model_dump(exclude_none=True) for o in r.output],
        {"role": "user", "content": "And now?"}])
    assert again.status in ("completed", "incomplete")
