"""The frontend's HTTP layer, as a subprocess, against a fake engine (a ZMQ test double).

Checked with the official `openai` SDK (it parses our responses and streams), and with raw
httpx for the SSE byte format, client disconnects, startup and health.
"""

from __future__ import annotations

import re

import httpx
import pytest

from services.frontend.tokenizer import Tokenizer
from tests.unit.test_frontend_support import (HI, MAX_MODEL_LEN, MODEL, REPLY_TEXT,  # noqa: F401
                                              Stack, client, health, stack, tok, wait_for)


def _expected_reply(tok: Tokenizer) -> str:
    return tok.decode(tok.encode(REPLY_TEXT))


def _last_added(stack, request_id: str):
    return wait_for(lambda: next((r for r in stack.engine.added
                                   if r.request_id == request_id), None), 5, "AddRequest")


# ---------------------------------------------------------------- happy paths


def test_models_lists_the_served_model_with_max_model_len(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_chat_completion_with_openai_sdk(stack, client, tok):
    resp = client.chat.completions.create(model=MODEL, messages=HI, temperature=0)
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == _expected_reply(tok)
    assert resp.choices[0].finish_reason == "stop"
    added = _last_added(stack, resp.id)
    prompt = tok.decode(added.prompt_token_ids, skip_special_tokens=False)
    assert prompt == "<|im_start|>user\nSay hello 你好<|im_end|>\n<|im_start|>assistant\n"
    assert resp.usage.prompt_tokens == len(added.prompt_token_ids)
    assert resp.usage.completion_tokens == len(tok.encode(REPLY_TEXT)) + 1  # + the EOS
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    # No max_tokens: the rest of the context; sampling fields pass through.
    assert added.sampling.max_tokens == MAX_MODEL_LEN - len(added.prompt_token_ids)
    assert added.sampling.temperature == 0.0


def test_max_tokens_truncates_with_finish_reason_length(stack, client, tok):
    resp = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, seed=7,
                                          extra_body={"top_k": 20, "min_p": 0.1})
    ids = tok.encode(REPLY_TEXT)[:5]
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].message.content == tok.decode(ids)
    assert resp.usage.completion_tokens == 5
    s = _last_added(stack, resp.id).sampling
    assert (s.max_tokens, s.seed, s.top_k, s.min_p) == (5, 7, 20, pytest.approx(0.1))


def test_streaming_with_openai_sdk_and_usage_chunk(client, tok):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=HI, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == _expected_reply(tok)
    assert not any("\ufffd" in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        len(tok.encode(REPLY_TEXT)) + 1
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_bytes_with_keepalive_end_with_done(stack, tok):
    body = {"model": MODEL, "stream": True,
            "messages": [{"role": "user", "content": "slow please"}]}
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes())
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and raw.endswith(b"data: [DONE]\n\n")
    assert b": keep-alive" in events
    assert all(e == b": keep-alive" or re.fullmatch(rb"data: \S.*", e, re.S)
               for e in events[:-1])


def test_stop_string_ends_the_answer_and_aborts_in_the_engine(stack, client, tok):
    messages = [{"role": "user", "content": "keep going"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, stop=["hover"])
    assert resp.choices[0].message.content == _expected_reply(tok).split("hover")[0]
    assert resp.choices[0].finish_reason == "stop"
    wait_for(lambda: resp.id in stack.engine.aborted, 5, "Abort after the stop string")


def test_streamed_stop_string_never_streams_a_prefix_of_it(stack, client, tok):
    messages = [{"role": "user", "content": "keep going"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 stop=["Kestrels hover"]))
    deltas = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(deltas) == _expected_reply(tok).split("Kestrels hover")[0]
    assert not any("Kes" in d for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_list_content_parts_are_joined(stack, client):
    parts = [{"type": "text", "text": "Say hello"}, {"type": "text", "text": "你好"}]
    resp = client.chat.completions.create(model=MODEL,
                                          messages=[{"role": "user", "content": parts}])
    added = _last_added(stack, resp.id)
    assert "Say hello\n你好" in Tokenizer(stack.model_dir).decode(added.prompt_token_ids)


def test_client_disconnect_aborts_the_request_in_the_engine(stack):
    body = {"model": MODEL, "stream": True,
            "messages": [{"role": "user", "content": "please hang"}]}
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=10) as r:
        first = next(r.iter_bytes())
        assert first.startswith(b"data: ")
        request_id = re.search(rb'"id":"(chatcmpl-[0-9a-f]+)"', first).group(1).decode()
    wait_for(lambda: request_id in stack.engine.aborted, 10, "Abort of the hung request")


def test_client_disconnect_aborts_a_non_streaming_request(stack):
    n_before = len(stack.engine.added)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "please hang"}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=1.0)
    added = wait_for(lambda: stack.engine.added[n_before:], 5, "AddRequest")
    wait_for(lambda: added[0].request_id in stack.engine.aborted, 10, "Abort")


# ---------------------------------------------------------------- startup and health


def test_frontend_waits_for_engine_then_health_follows_engine_liveness():
    s = Stack()
    try:
        s.start_frontend()
        wait_for(lambda: "waiting for the engine" in s.log(), 15, "the waiting log line")
        assert health(s.url) is None and s.proc.poll() is None  # not serving yet
        s.start_engine()
        s.wait_healthy()
        s.engine.stop()
        wait_for(lambda: health(s.url) == 503, 15, "health 503 after the engine stopped")
        assert s.proc.poll() is None  # the frontend stays up
    finally:
        s.close()


def test_frontend_exits_non_zero_when_the_engine_never_answers():
    s = Stack()
    try:
        s.start_frontend(startup_timeout_s=1.0)
        rc = wait_for(lambda: s.proc.poll(), 20, "the frontend to give up")
        assert rc != 0 and "no answer from the engine" in s.log()
    finally:
        s.close()
