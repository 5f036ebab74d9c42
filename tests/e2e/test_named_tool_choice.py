"""End to end with the official `openai` and `anthropic` SDKs on the default model
(SmolLM2-135M-Instruct) under its own chat template, which renders no tools, with
`--tool-call-parser hermes`:

- a named tool choice (OpenAI `{"type": "function", ...}`, Anthropic `{"type": "tool", ...}`)
  gives exactly one call and finishes with `tool_calls` / `tool_use`, streamed or not, well
  within max_tokens (the grammar ends the request after the call); the openai SDK's
  `chat.completions.parse` with a pydantic tool parses it (it raises LengthFinishReasonError
  on a `length` finish);
- the tools reach the prompt through Kestrel's fallback (usage.prompt_tokens / input_tokens
  grow with them), and a call fed back as history is rendered (the prompt grows again).
The SDKs' own response parsing is the judge of the shapes."""

from __future__ import annotations

import json

import anthropic
import openai
import pydantic
import pytest

from tests.e2e.server import KestrelServer

MODEL = "SmolLM2-135M-Instruct"
# maxLength: a sampled string may otherwise run on past max_tokens (one call, but cut)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time.",
                                           "parameters": {"type": "object", "properties": {}}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MANY = [{"role": "user", "content": "Get the weather in each of these cities, one call per "
                                    "city: Paris, London, Rome, Berlin, Madrid, Vienna."}]
N = 4  # sampled answers per request
MAX_TOKENS = 200  # far more than one call takes


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = KestrelServer(str(smollm2_dir), "--tool-call-parser", "hermes",
                        "--max-model-len", "2048").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=600)


@pytest.fixture(scope="module")
def anth(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0,
                               timeout=600)


def _streamed_choices(client, **kw) -> dict[int, tuple[dict[int, list[str]], str | None]]:
    """{choice index: ({call index: [name, arguments]}, finish_reason)} of a stream."""
    out: dict[int, tuple[dict[int, list[str]], str | None]] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            calls, finish = out.get(c.index, ({}, None))
            for tc in c.delta.tool_calls or []:
                calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
            out[c.index] = (calls, c.finish_reason or finish)
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_openai_named_choice_gives_one_call_and_finish_tool_calls(client, stream):
    # Sampled answers to a request for many calls: before the fix most of them repeated
    # the call until max_tokens.
    kw = dict(model=MODEL, messages=MANY, tools=TOOLS, tool_choice=NAMED, n=N,
              max_tokens=MAX_TOKENS, temperature=1, seed=1)
    if stream:
        got = _streamed_choices(client, **kw)
        assert sorted(got) == list(range(N))
        answers = [([tuple(calls[k]) for k in sorted(calls)], finish)
                   for calls, finish in got.values()]
    else:
        r = client.chat.completions.create(**kw)
        answers = [([(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []],
                    ch.finish_reason) for ch in r.choices]
    for calls, finish in answers:
        assert finish == "tool_calls"
        [(name, args)] = calls
        assert name == "get_weather" and isinstance(json.loads(args)["city"], str)


def test_openai_parse_with_a_pydantic_tool_returns_the_parsed_call(client):
    class GetWeather(pydantic.BaseModel):
        city: str

    r = client.chat.completions.parse(
        model=MODEL, messages=MANY, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}}, n=N,
        max_tokens=MAX_TOKENS, temperature=1, seed=1)  # before the fix: several calls per choice
    for ch in r.choices:
        [call] = ch.message.tool_calls
        assert ch.finish_reason == "tool_calls"
        assert isinstance(call.function.parsed_arguments, GetWeather)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_named_tool_gives_one_tool_use_and_stop_reason_tool_use(anth, stream):
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    kw = dict(model=MODEL, max_tokens=MAX_TOKENS, tools=tools, messages=MANY,
              tool_choice={"type": "tool", "name": "get_weather"})
    for _ in range(2 * N):  # sampled (temperature 1, the default): before the fix about a
        if stream:          # third of these had two tool_use blocks
            with anth.messages.stream(**kw) as s:
                m = s.get_final_message()
        else:
            m = anth.messages.create(**kw)
        assert m.stop_reason == "tool_use"
        [use] = [b for b in m.content if b.type == "tool_use"]
        assert use.name == "get_weather" and isinstance(use.input["city"], str)


def test_tools_reach_the_prompt_of_the_default_template_and_a_call_round_trips(client, anth):
    bare = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    with_tools = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                max_tokens=1)
    assert with_tools.usage.prompt_tokens > bare.usage.prompt_tokens
    a_tools = [{"name": "get_weather", "input_schema": WEATHER}]
    assert (anth.messages.count_tokens(model=MODEL, messages=ASK, tools=a_tools).input_tokens
            > anth.messages.count_tokens(model=MODEL, messages=ASK).input_tokens)
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens > with_tools.usage.prompt_tokens
