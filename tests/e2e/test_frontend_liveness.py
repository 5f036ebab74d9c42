"""A real `kestrel serve` keeps every client served while one request carries a huge body,
and answers the first structured-output request after a start.

Two bugs this guards: tokenizing a 7 MB body on the frontend's event loop stopped its
engine heartbeats for seconds, so the engine dropped the frontend and every other stream
hung on keep-alives forever; and the first json_schema request got a 503 because
xgrammar's first import (torch) blocked the loop. One module-scoped server, fresh: the
json_schema test must be the first request it serves (it runs first in this file).
"""

from __future__ import annotations

import os
import threading

import httpx
import orjson
import pytest
from tokenizers import Tokenizer

from tests.e2e.server import KestrelServer
from tests.faults.helpers import MODEL, Stream, chat_ok

BIG_PROMPT = "hello " * 1_200_000  # ~7.2 MB of JSON: under the default 8 MiB body limit


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = KestrelServer(str(smollm2_dir), "--max-model-len", "1024").start()
    yield srv
    srv.stop()


def test_first_json_schema_request_after_start_succeeds(server):
    schema = {"type": "object", "properties": {"name": {"type": "string"}},
              "required": ["name"], "additionalProperties": False}
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 20, "temperature": 0,
        "messages": [{"role": "user", "content": "Give a name as JSON."}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "n", "schema": schema}}})
    assert r.status_code == 200, (r.text, server.log_tail())
    assert r.json()["choices"][0]["message"]["content"].startswith("{")


def test_bad_json_schema_error_names_the_reason_without_xgrammar_internals(server):
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "n", "schema": {"type": "bogus"}}}})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert 'Unsupported type "bogus"' in msg and ".cc:" not in msg and "/project" not in msg


def test_streams_finish_while_a_7mb_body_is_tokenized(server, smollm2_dir):
    # Bounded: every join has a deadline (a hung stream would send keep-alives forever).
    streams = [Stream(server.base_url, max_tokens=100) for _ in range(3)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(60), f"no first token: {s.outcome} {s.detail}"
    results: dict[str, httpx.Response] = {}

    def post(path: str, body: dict) -> None:
        results[path] = httpx.post(server.base_url + path, content=orjson.dumps(body),
                                   headers={"content-type": "application/json"}, timeout=300)

    big = [threading.Thread(target=post, args=("/tokenize", {"model": MODEL,
                                                             "prompt": BIG_PROMPT})),
           threading.Thread(target=post, args=("/v1/chat/completions", {
               "model": MODEL, "messages": [{"role": "user", "content": BIG_PROMPT}]})),
           threading.Thread(target=post, args=("/v1/messages", {
               "model": MODEL, "max_tokens": 10,
               "messages": [{"role": "user", "content": BIG_PROMPT}]}))]
    for t in big:
        t.start()
    for t in big:
        t.join(300)
        assert not t.is_alive(), "a big request got no answer"
    for s in streams:
        s.join(300)
        assert not s.is_alive(), "a stream hung (keep-alives with no end)"
    assert [s.outcome for s in streams] == ["done"] * 3, (
        [(s.outcome, s.detail) for s in streams], server.log_tail())
    assert [s.finish_reason for s in streams] == ["length"] * 3  # ignore_eos

    tok = results["/tokenize"]
    assert tok.status_code == 200, tok.text[:500]
    expected = Tokenizer.from_file(os.path.join(smollm2_dir, "tokenizer.json")).encode(
        BIG_PROMPT, add_special_tokens=True).ids
    assert tok.json()["count"] == len(expected)
    chat = results["/v1/chat/completions"]
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"
    msg = results["/v1/messages"]
    assert msg.status_code == 400 and msg.json()["error"]["type"] == "invalid_request_error", msg.text[:500]

    # The frontend stayed attached: the engine never dropped it, and it still serves.
    log = server.log_tail(100_000)
    assert "no hello" not in log and "aborting its requests" not in log, log[-5000:]
    assert chat_ok(server.base_url, timeout=60)
