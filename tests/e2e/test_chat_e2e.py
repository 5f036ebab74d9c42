"""End to end as a user: `kestrel serve` in a subprocess, the official openai SDK, and
transformers' GGUF-loaded SmolLM2 as the independent reference."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time

import httpx
import openai
import pytest

from tests.e2e.server import KestrelServer, segments
from tests.faults.helpers import gone

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "What is 12 + 30?",
    "Translate 'good morning' into Spanish.",
    "Name a famous physicist.",
    "Give one tip for writing clean code.",
    "你好！请用一句话介绍你自己。",
]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = KestrelServer(str(smollm2_dir)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, prompt, max_tokens=32, stream=False):
    kw = dict(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": prompt}],
              temperature=0, max_tokens=max_tokens)
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_greedy_chat_equals_transformers(client, hf_greedy):
    prompt = PROMPTS[0]
    text, resp = _chat(client, prompt)
    assert text == hf_greedy(prompt, 32)
    assert text.strip() == "The capital of France is Paris."
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_streaming_chat_equals_transformers(client, hf_greedy):
    prompt = PROMPTS[1]
    text, chunks = _chat(client, prompt, stream=True)
    assert text == hf_greedy(prompt, 32)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_sse_bytes_end_with_done(server):
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes())
    events = [e for e in raw.split(b"\n\n") if e.strip() and not e.startswith(b":")]
    assert events[-1] == b"data: [DONE]"
    for e in events[:-1]:
        assert e.startswith(b"data: ")
        json.loads(e[len(b"data: "):])


def test_eight_concurrent_streams_match_sequential(client):
    sequential = [_chat(client, p, max_tokens=24)[0] for p in PROMPTS]
    with cf.ThreadPoolExecutor(8) as ex:
        concurrent = list(ex.map(lambda p: _chat(client, p, max_tokens=24, stream=True)[0], PROMPTS))
    assert concurrent == sequential


BAD = [
    ("invalid json", b"{not json", 400),
    ("missing messages", {"model": "SmolLM2-135M-Instruct"}, 400),
    ("empty messages", {"model": "SmolLM2-135M-Instruct", "messages": []}, 400),
    ("bad temperature", {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}],
                         "temperature": -1}, 400),
    ("bad max_tokens", {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}],
                        "max_tokens": -3}, 400),
    ("bad top_p", {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}],
                   "top_p": 7}, 400),
    ("bad role", {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("unknown model", {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}, 404),
]


@pytest.mark.parametrize("name,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_error_envelope_then_service_continues(server, client, name, body, status):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert "type" in err
    # the same through the SDK raises the matching typed error
    if isinstance(body, dict) and "messages" in body:
        exc = openai.NotFoundError if status == 404 else openai.BadRequestError
        with pytest.raises(exc):
            client.chat.completions.create(**body)
    text, _ = _chat(client, "Say hi.", max_tokens=4)
    assert text


def test_models_and_health(server):
    r = httpx.get(server.base_url + "/v1/models", timeout=10)
    assert r.status_code == 200
    data = r.json()["data"]
    assert data[0]["id"] == "SmolLM2-135M-Instruct"
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def _wait_gone(pids, timeout):
    return gone(pids, timeout)  # tests.faults.helpers: a pid that exits while looked at is gone


def test_sigterm_stops_everything_and_leaves_no_segments(smollm2_dir):
    srv = KestrelServer(str(smollm2_dir)).start()
    try:
        kids = [p.pid for p in srv.children()]
        assert len(kids) >= 3
        assert segments(srv.instance_id), "the plan ring should exist while serving"
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
        assert _wait_gone(kids, 10) == []
        assert segments(srv.instance_id) == []
        assert not os.path.exists(f"/tmp/kestrel-{srv.instance_id}")
    finally:
        srv.stop(signal.SIGKILL)


def test_kill9_supervisor_takes_children_down(smollm2_dir):
    srv = KestrelServer(str(smollm2_dir)).start()
    try:
        kids = [p.pid for p in srv.children()]
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(10)
        assert _wait_gone(kids, 15) == [], "orphans survived the supervisor"
        deadline = time.monotonic() + 10
        while segments(srv.instance_id) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert segments(srv.instance_id) == []
    finally:
        srv.stop(signal.SIGKILL)
