"""The drain's timeout (issue 14, item 8): requests still in flight when --shutdown-timeout
is up end with their API's error, never a bare cut. A real `kestrel serve`, real SIGTERM;
the streams are read as the spec frames them (OpenAI: `data: <JSON>` events, the error
chunk in OpenAI's envelope, then `data: [DONE]`; Anthropic: `event: error` with its
envelope) and through the official `openai` and `anthropic` SDKs."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable

import anthropic
import httpx
import openai
import pytest

from tests.e2e.server import KestrelServer
from tests.faults.helpers import MODEL, engine_stats, wait_for

LONG = 4000  # max_tokens: far more than the drain leaves time for
PROMPT = "Count from 1 to 1000, separated by commas."
# A forced tool call whose input cannot be complete before 3000 characters: an Anthropic
# request (no ignore_eos there) that cannot end by itself before the drain is up.
WRITE_TOOL = {"name": "write", "description": "Write the text.",
              "input_schema": {"type": "object", "required": ["text"], "properties": {
                  "text": {"type": "string", "minLength": 3000}}}}
ANTHROPIC_BODY = {"model": MODEL, "max_tokens": LONG, "tools": [WRITE_TOOL],
                  "tool_choice": {"type": "tool", "name": "write"},
                  "messages": [{"role": "user", "content": PROMPT}]}


@pytest.fixture
def server(smollm2_dir):
    srv = KestrelServer(str(smollm2_dir), "--shutdown-timeout", "1")
    try:
        yield srv.start(timeout=300)
    finally:
        srv.stop(signal.SIGKILL)


def _sse_events(raw: bytes) -> list[bytes]:
    """The events of an SSE body (a blank line ends each), comments left out."""
    return [e for e in raw.replace(b"\r\n", b"\n").split(b"\n\n") if e and not e.startswith(b":")]


class Call(threading.Thread):
    """Run `fn(started)` in a thread; `fn` sets `started` once its response is under way
    (streams: at the first event), and returns what the test checks (or raises it)."""

    def __init__(self, fn: Callable[[threading.Event], object]):
        super().__init__(daemon=True)
        self.fn, self.started = fn, threading.Event()
        self.result: object = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(self.started)
        except BaseException as e:  # noqa: BLE001 (the test inspects it)
            self.error = e
        finally:
            self.started.set()


def test_requests_outlasting_the_drain_end_with_their_apis_error(server):
    base = server.base_url
    oa = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    an = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)

    def chat_stream_bytes(started):
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": LONG, "ignore_eos": True, "stream": True}
        raw = b""
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for chunk in r.iter_bytes():
                raw += chunk
                if b"\"content\"" in raw:
                    started.set()
        return raw

    def completions_stream_sdk(started):
        stream = oa.completions.create(model=MODEL, prompt=PROMPT, max_tokens=LONG, stream=True,
                                       extra_body={"ignore_eos": True})
        for _ in stream:
            started.set()
        return "ended without an error"

    def anthropic_stream_sdk(started):
        with an.messages.stream(**ANTHROPIC_BODY) as s:
            for _ in s:
                started.set()
        return "ended without an error"

    def chat_plain(started):
        return httpx.post(base + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": LONG, "ignore_eos": True})

    def anthropic_plain(started):
        return httpx.post(base + "/v1/messages", timeout=120, json=ANTHROPIC_BODY)

    calls = {f.__name__: Call(f) for f in (chat_stream_bytes, completions_stream_sdk,
                                           anthropic_stream_sdk, chat_plain, anthropic_plain)}
    for c in calls.values():
        c.start()
    # every request is in the engine (running or queued) and every stream has begun
    assert wait_for(lambda: engine_stats(base)["num_running"] + engine_stats(base)["num_waiting"]
                    >= len(calls), 120), server.log_tail()
    for name in ("chat_stream_bytes", "completions_stream_sdk", "anthropic_stream_sdk"):
        assert calls[name].started.wait(120), name
    assert all(c.is_alive() for c in calls.values()), {n: (c.result, c.error) for n, c in calls.items()}

    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for c in calls.values():
        c.join(60)
    print(f"requests ended {time.monotonic() - t0:.2f} s after SIGTERM (--shutdown-timeout 1)")
    assert not any(c.is_alive() for c in calls.values()), server.log_tail()

    # OpenAI chat stream, its bytes: chunks, then the error chunk, then [DONE]
    c = calls["chat_stream_bytes"]
    assert c.error is None, repr(c.error)
    assert isinstance(c.result, bytes)
    events = _sse_events(c.result)
    assert events[-1] == b"data: [DONE]", events[-3:]
    assert events[-2].startswith(b"data: "), events[-3:]
    err = json.loads(events[-2][len(b"data: "):])
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["type"] == "service_unavailable"
    assert "shutting down" in err["error"]["message"]
    for e in events[:-2]:  # everything before is an ordinary chunk
        assert json.loads(e[len(b"data: "):])["object"] == "chat.completion.chunk"

    # OpenAI completions stream through the SDK: it raises on the error event
    c = calls["completions_stream_sdk"]
    assert isinstance(c.error, openai.APIError), (c.result, repr(c.error))
    assert "shutting down" in c.error.message

    # Anthropic stream through the SDK: the `error` event, overloaded_error (our 503)
    c = calls["anthropic_stream_sdk"]
    assert isinstance(c.error, anthropic.APIStatusError), (c.result, repr(c.error))
    assert isinstance(c.error.body, dict), c.error.body
    assert c.error.body["type"] == "error", c.error.body
    assert c.error.body["error"]["type"] == "overloaded_error", c.error.body
    assert "shutting down" in c.error.body["error"]["message"]

    # non-streamed: 503 + Retry-After in OpenAI's envelope, 529 overloaded_error in Anthropic's
    r = calls["chat_plain"].result
    assert isinstance(r, httpx.Response), repr(calls["chat_plain"].error)
    assert r.status_code == 503 and "retry-after" in r.headers, (r.status_code, r.text)
    assert r.json()["error"]["type"] == "service_unavailable"
    assert "shutting down" in r.json()["error"]["message"]
    r = calls["anthropic_plain"].result
    assert isinstance(r, httpx.Response), repr(calls["anthropic_plain"].error)
    assert r.status_code == 529 and "retry-after" in r.headers, (r.status_code, r.text)
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error"

    assert server.proc.wait(60) == 0, server.log_tail()
