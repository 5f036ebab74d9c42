"""The soak benchmark's request mix (benchmarks/soak.py): what each kind of request sends,
how one request is run, and when its answer counts as correct.

Kinds (`KINDS`, picked with their weights): OpenAI chat completions streamed and not, with
stop strings, with `n: 2` and logprobs, with `response_format` json_schema (streamed and
not), with tools (`tool_choice` auto and required); `/v1/completions` streamed and not (the
non-streamed one with `n: 2`, logprobs and a stop string); Anthropic `/v1/messages`
streamed and not, with `stop_sequences`, with tools (`tool_choice` any). Prompts are short
(a few sentences, some behind a shared system prompt of a few KV blocks so that the prefix
cache is hit and evicted), `max_tokens` small (the CPU keeps up).

A request's outcome (`Outcome.outcome`):
- "ok": HTTP 200 and a well-formed answer: the body (or every stream event) validates as
  the official SDK's own type (`openai.types...`, `anthropic.types...`, pydantic models;
  streamed /v1/completions chunks are checked by hand, as the SDK's `Completion` type
  requires a finish_reason that the wire format leaves null until the last chunk; Anthropic
  `ping` events are skipped, the SDK's event union lacks them), the choice count is n, every choice has a finish reason, a
  stream ends with `[DONE]` (OpenAI) or `message_stop` (Anthropic) and carries no error
  event, a json_schema answer that finished with `stop` is JSON of the schema.
- "disconnected": a stream the client closed on purpose after `cut_after` events (a
  stream that ended before that is "ok").
- "aborted": a stream cancelled on purpose by an abort burst (benchmarks/soak.py).
- "failed": anything else (other status, error event, missing end, bad shape, exception);
  `error` says what, with the first 300 characters of the evidence.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

try:  # the official SDKs' types: an independent check of every answer's shape
    from anthropic.types import Message, RawMessageStreamEvent
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from pydantic import TypeAdapter

    _ANTHROPIC_EVENT: Any = TypeAdapter(RawMessageStreamEvent)
    SDK_TYPES = True
except ImportError:  # without the SDKs only the checks below run
    SDK_TYPES = False

SYSTEM = ("You are a helpful assistant for a travel agency. You answer briefly, in plain "
          "words, and you never invent prices. " * 6)  # ~130 tokens: several KV blocks
PROMPTS = ["What is the capital of France?", "Name three colors.", "Write a haiku about falcons.",
           "How many legs does a spider have?", "Give me a number between 1 and 10.",
           "Say hello in Spanish.", "What is 12 times 7?", "Describe the sea in one sentence.",
           "List two fruits.", "Why is the sky blue?"]
WEATHER_TOOL = {"name": "get_weather", "description": "The weather of a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}
JSON_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}},
               "required": ["answer"], "additionalProperties": False}


@dataclass
class Outcome:
    """One request's result: kind (a `KINDS` name), outcome ("ok", "disconnected",
    "aborted", "failed"), error (why it failed, else None), seconds (wall time)."""

    kind: str
    outcome: str
    error: str | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class Kind:
    """A kind of request: name, weight (relative frequency), api ("chat", "completions",
    "messages"), body (function of (model, rng) -> the JSON body, `stream` set in it)."""

    name: str
    weight: float
    api: str
    body: Callable[[str, random.Random], dict]

    def path(self) -> str:
        """The route this kind posts to."""
        return {"chat": "/v1/chat/completions", "completions": "/v1/completions",
                "messages": "/v1/messages"}[self.api]


def _messages(rng: random.Random) -> list[dict]:
    msgs = [{"role": "user", "content": f"{rng.choice(PROMPTS)} (request {rng.randrange(10**6)})"}]
    return ([{"role": "system", "content": SYSTEM}] + msgs) if rng.random() < 0.5 else msgs


def _sampling(rng: random.Random, max_tokens: int) -> dict:
    t = rng.choice([0.0, 0.7, 1.0])
    return {"max_tokens": max_tokens, "temperature": t, **({"seed": rng.randrange(1000)} if t else {})}


def _chat(stream: bool, **extra: Any) -> Callable[[str, random.Random], dict]:
    def body(model: str, rng: random.Random) -> dict:
        b = {"model": model, "messages": _messages(rng), "stream": stream,
             **_sampling(rng, 16), **extra}
        if stream:
            b["stream_options"] = {"include_usage": True}
        return b
    return body


def _completions(stream: bool, **extra: Any) -> Callable[[str, random.Random], dict]:
    def body(model: str, rng: random.Random) -> dict:
        b = {"model": model, "prompt": f"{rng.choice(PROMPTS)} Answer:", "stream": stream,
             **_sampling(rng, 16), **extra}
        if stream:
            b["stream_options"] = {"include_usage": True}
        return b
    return body


def _anthropic(stream: bool, **extra: Any) -> Callable[[str, random.Random], dict]:
    def body(model: str, rng: random.Random) -> dict:
        msgs = _messages(rng)
        system = [m["content"] for m in msgs if m["role"] == "system"]
        b = {"model": model, "messages": [m for m in msgs if m["role"] != "system"],
             "stream": stream, **_sampling(rng, 16), **extra}
        b["temperature"] = min(b["temperature"], 1.0)  # Anthropic's range is [0, 1]
        b.pop("seed", None)
        return {**b, "system": system[0]} if system else b
    return body


_TOOLS = [{"type": "function", "function": WEATHER_TOOL}]
_ATOOLS = [{"name": WEATHER_TOOL["name"], "description": WEATHER_TOOL["description"],
            "input_schema": WEATHER_TOOL["parameters"]}]
_RF = {"type": "json_schema", "json_schema": {"name": "answer", "schema": JSON_SCHEMA}}

KINDS: list[Kind] = [
    Kind("chat_stream", 3, "chat", _chat(True)),
    Kind("chat", 2, "chat", _chat(False)),
    Kind("chat_stream_stop", 1, "chat", _chat(True, stop=[".", "\n"])),
    Kind("chat_n2_logprobs", 1, "chat", _chat(False, n=2, logprobs=True, top_logprobs=2)),
    Kind("chat_json_schema", 1, "chat", _chat(False, response_format=_RF)),
    Kind("chat_json_schema_stream", 1, "chat", _chat(True, response_format=_RF)),
    Kind("chat_tools_auto", 1, "chat", _chat(False, tools=_TOOLS, tool_choice="auto")),
    Kind("chat_tools_required_stream", 1, "chat", _chat(True, tools=_TOOLS, tool_choice="required")),
    Kind("completions_stream", 2, "completions", _completions(True)),
    Kind("completions_n2_logprobs_stop", 1, "completions",
         _completions(False, n=2, logprobs=2, stop=["\n"])),
    Kind("messages_stream", 2, "messages", _anthropic(True)),
    Kind("messages", 1, "messages", _anthropic(False, stop_sequences=["."])),
    Kind("messages_tools", 1, "messages", _anthropic(False, tools=_ATOOLS, tool_choice={"type": "any"})),
    Kind("messages_tools_stream", 1, "messages", _anthropic(True, tools=_ATOOLS)),
]
STREAM_KINDS = [k for k in KINDS if k.body("m", random.Random(0))["stream"]]


class BadAnswer(Exception):
    """An answer that breaks the checks of the module docstring."""


def _clip(x: Any) -> str:
    return (x if isinstance(x, str) else repr(x))[:300]


def _check_json_schema(text: str | None) -> None:
    try:
        obj = json.loads(text or "")
    except ValueError:
        raise BadAnswer(f"json_schema answer is not JSON: {_clip(text)}") from None
    if not (isinstance(obj, dict) and set(obj) == {"answer"} and isinstance(obj["answer"], int)):
        raise BadAnswer(f"json_schema answer breaks the schema: {_clip(text)}")


def check_body(kind: Kind, body: dict, data: dict) -> None:
    """Check a non-streamed answer `data` to request `body`. Raises BadAnswer."""
    n = body.get("n", 1)
    if kind.api == "messages":
        if SDK_TYPES:
            Message.model_validate(data)
        if data.get("type") != "message" or not data.get("stop_reason"):
            raise BadAnswer(f"not a finished message: {_clip(data)}")
        return
    if SDK_TYPES:
        (ChatCompletion if kind.api == "chat" else Completion).model_validate(data)
    choices = data.get("choices") or []
    if sorted(c.get("index") for c in choices) != list(range(n)):
        raise BadAnswer(f"asked n={n}, got choices {[c.get('index') for c in choices]}")
    for c in choices:
        if not c.get("finish_reason"):
            raise BadAnswer(f"choice without finish_reason: {_clip(c)}")
        if body.get("logprobs") and c.get("logprobs") is None:
            raise BadAnswer("logprobs asked, none in the choice")
        if "response_format" in body and c["finish_reason"] == "stop":
            _check_json_schema(c["message"].get("content"))
    if not data.get("usage"):
        raise BadAnswer("no usage")


def _check_completion_chunk(ev: dict) -> None:
    """A streamed /v1/completions chunk: object text_completion, choices of int index and
    str text, finish_reason null or one of OpenAI's. Raises BadAnswer."""
    ok = ev.get("object") == "text_completion" and isinstance(ev.get("choices"), list) and all(
        isinstance(c.get("index"), int) and isinstance(c.get("text"), str)
        and c.get("finish_reason") in (None, "stop", "length", "content_filter")
        for c in ev["choices"])
    if not ok:
        raise BadAnswer(f"bad completion chunk: {_clip(ev)}")


class StreamCheck:
    """The checks of one stream, fed event by event (`feed`), closed by `finish`."""

    def __init__(self, kind: Kind, body: dict):
        self.kind, self.body = kind, body
        self.events = 0
        self.ended = False           # [DONE] / message_stop seen
        self.finished: set[int] = set()
        self.text: dict[int, str] = {}
        self.usage = False

    def feed(self, data: str) -> None:
        """One SSE `data:` payload. Raises BadAnswer."""
        if self.ended:
            raise BadAnswer(f"event after the end of the stream: {_clip(data)}")
        self.events += 1
        if self.kind.api != "messages" and data == "[DONE]":
            self.ended = True
            return
        ev = json.loads(data)
        if "error" in ev or ev.get("type") == "error":
            raise BadAnswer(f"error event: {_clip(ev)}")
        if self.kind.api == "messages":
            if ev.get("type") == "ping":  # documented keep-alive, not in the SDK's event union
                return
            if SDK_TYPES:
                _ANTHROPIC_EVENT.validate_python(ev)
            if self.events == 1 and ev.get("type") != "message_start":
                raise BadAnswer(f"first event is not message_start: {_clip(ev)}")
            if ev.get("type") == "message_delta" and ev.get("delta", {}).get("stop_reason"):
                self.finished.add(0)
            self.ended = ev.get("type") == "message_stop"
            return
        if self.kind.api == "chat" and SDK_TYPES:
            ChatCompletionChunk.model_validate(ev)
        elif self.kind.api == "completions":  # the SDK's Completion type wants a finish_reason
            _check_completion_chunk(ev)         # in every chunk; the wire (OpenAI's too) has null
        self.usage = self.usage or bool(ev.get("usage"))
        for c in ev.get("choices") or ():
            i = c.get("index", 0)
            piece = (c.get("delta") or {}).get("content") if self.kind.api == "chat" else c.get("text")
            self.text[i] = self.text.get(i, "") + (piece or "")
            if c.get("finish_reason"):
                self.finished.add(i)
                if "response_format" in self.body and c["finish_reason"] == "stop":
                    _check_json_schema(self.text[i])

    def finish(self) -> None:
        """The stream closed (the server ended it). Raises BadAnswer."""
        if not self.ended:
            raise BadAnswer(f"stream ended without its end event after {self.events} events")
        n = self.body.get("n", 1)
        if self.finished != set(range(n)):
            raise BadAnswer(f"finish reasons for choices {sorted(self.finished)}, asked n={n}")
        if self.kind.api != "messages" and not self.usage:
            raise BadAnswer("no usage chunk (stream_options.include_usage)")


async def run_request(client: httpx.AsyncClient, kind: Kind, body: dict, cut_after: int = 0,
                      first_event: asyncio.Event | None = None) -> Outcome:
    """Send `body` to kind's route and check the answer. cut_after > 0 (streams only):
    close the connection after that many events ("disconnected"). first_event: set when
    the first stream event (or the whole answer) arrived. Cancellation (an abort burst)
    propagates: the caller counts it."""
    t0 = time.monotonic()
    try:
        if not body["stream"]:
            r = await client.post(kind.path(), json=body)
            if first_event is not None:
                first_event.set()
            if r.status_code != 200:
                raise BadAnswer(f"HTTP {r.status_code}: {_clip(r.text)}")
            check_body(kind, body, r.json())
            return Outcome(kind.name, "ok", seconds=time.monotonic() - t0)
        check = StreamCheck(kind, body)
        async with client.stream("POST", kind.path(), json=body) as r:
            if r.status_code != 200:
                raise BadAnswer(f"HTTP {r.status_code}: {_clip((await r.aread()).decode(errors='replace'))}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue  # event: lines, blank separators, keep-alive comments
                check.feed(line[5:].strip())
                if first_event is not None:
                    first_event.set()
                if cut_after and check.events >= cut_after and not check.ended:
                    return Outcome(kind.name, "disconnected", seconds=time.monotonic() - t0)
        check.finish()
        return Outcome(kind.name, "ok", seconds=time.monotonic() - t0)
    except BadAnswer as e:
        return Outcome(kind.name, "failed", str(e), time.monotonic() - t0)
    except Exception as e:  # connection reset, timeout, bad JSON, a shape the SDK refuses
        return Outcome(kind.name, "failed", f"{type(e).__name__}: {_clip(str(e))}", time.monotonic() - t0)
