"""How a request's end is counted and logged when a stop string ends it in an output parser
(the Anthropic route; chat with `--reasoning-parser`) rather than in `generate`, against a
real frontend subprocess on the fake engine: a stop, never a client gone, in
`kestrel:request_success_total{finished_reason}` (read with prometheus_client's own text
parser) and in the frontend's log; a client that really goes away is still an abort. Every
case also checks that the engine was told to stop (its recorded Abort)."""

from __future__ import annotations

import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.test_frontend_support import MODEL, running_stack, wait_for

STOP = "Kestrels"  # inside REPLY_TEXT, well before its end
# The fake engine sends REPLY_TEXT and then runs on until aborted: only the frontend's
# Abort ends the request in the engine.
RUNS_ON = "keep going"
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def stack():
    yield from running_stack("--reasoning-parser", "qwen3")


def finishes(stack) -> dict[str, float]:
    """kestrel:request_success_total of this model, by finished_reason."""
    text = httpx.get(stack.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kestrel:request_success_total" and s.labels["model_name"] == MODEL:
                out[s.labels["finished_reason"]] = s.value
    return out


def _chat(stack, content: str, stream: bool, **extra) -> str:
    """A chat completion (read to the end); returns its id."""
    body = {"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": content}],
            **extra}
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=30) as r:
        raw = r.read()
    assert r.status_code == 200, raw
    finish = re.findall(rb'"finish_reason":"(\w+)"', raw)
    assert finish == [b"stop"], raw
    return re.search(rb'"id":"(chatcmpl-[0-9a-f]+)"', raw).group(1).decode()


def _messages(stack, stream: bool) -> str:
    """An Anthropic message ending on STOP (read to the end); returns its request id."""
    body = {"model": MODEL, "max_tokens": 64, "stream": stream, "stop_sequences": [STOP],
            "messages": [{"role": "user", "content": RUNS_ON}]}
    with httpx.stream("POST", f"{stack.url}/v1/messages", json=body, timeout=30,
                      headers=ANTHROPIC_HEADERS) as r:
        raw = r.read()
    assert r.status_code == 200, raw
    assert b'"stop_reason":"stop_sequence"' in raw and b'"stop_sequence":"Kestrels"' in raw, raw
    return r.headers["request-id"]


PARSER_STOPS = {
    "anthropic": lambda stack: _messages(stack, stream=False),
    "anthropic-stream": lambda stack: _messages(stack, stream=True),
    "chat-reasoning": lambda stack: _chat(stack, RUNS_ON, False, stop=[STOP]),
    "chat-reasoning-stream": lambda stack: _chat(stack, RUNS_ON, True, stop=[STOP]),
}


@pytest.mark.parametrize("route", list(PARSER_STOPS))
def test_stop_string_matched_by_the_output_parser_counts_as_stop_not_abort(stack, route):
    before = finishes(stack)
    rid = PARSER_STOPS[route](stack)
    wait_for(lambda: rid in stack.engine.aborted, 10, "the Abort that stops the engine")
    wait_for(lambda: finishes(stack).get("stop", 0) == before.get("stop", 0) + 1, 10,
             "one more finished_reason=stop")
    assert finishes(stack).get("abort", 0) == before.get("abort", 0)
    wait_for(lambda: f"{rid} finished: stop (stop string '{STOP}'" in stack.log(), 10,
             "the stop's log line")
    assert f"{rid} aborted" not in stack.log()


def test_stop_string_matched_in_generate_still_counts_as_stop(stack):
    before = finishes(stack)  # thinking off: no reasoning parser, `generate` applies stops
    rid = _chat(stack, RUNS_ON, False, stop=[STOP],
                chat_template_kwargs={"enable_thinking": False})
    wait_for(lambda: rid in stack.engine.aborted, 10, "the Abort that stops the engine")
    wait_for(lambda: finishes(stack).get("stop", 0) == before.get("stop", 0) + 1, 10,
             "one more finished_reason=stop")
    assert finishes(stack).get("abort", 0) == before.get("abort", 0)
    assert f"{rid} finished: stop, " in stack.log()


def _disconnect(stack, path: str) -> str:
    """Start a stream whose request never ends in the engine (RUNS_ON), read until the
    reply's first word, hang up; returns the request id."""
    body = {"model": MODEL, "max_tokens": 64, "stream": True,
            "messages": [{"role": "user", "content": RUNS_ON}]}
    with httpx.Client(timeout=10, headers=ANTHROPIC_HEADERS) as client:
        with client.stream("POST", stack.url + path, json=body) as r:
            assert r.status_code == 200
            seen = b""
            for chunk in r.iter_bytes():
                seen += chunk
                if b"Hello" in seen:
                    break
            return r.headers.get("request-id") or re.search(
                rb'"id":"(chatcmpl-[0-9a-f]+)"', seen).group(1).decode()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_client_that_goes_away_is_still_counted_as_abort(stack, path):
    before = finishes(stack)
    rid = _disconnect(stack, path)
    wait_for(lambda: rid in stack.engine.aborted, 10, "the Abort of the abandoned request")
    wait_for(lambda: finishes(stack).get("abort", 0) == before.get("abort", 0) + 1, 10,
             "one more finished_reason=abort")
    assert finishes(stack).get("stop", 0) == before.get("stop", 0)
    wait_for(lambda: f"{rid} aborted after" in stack.log(), 10, "the client-gone log line")
    assert f"{rid} finished" not in stack.log()
