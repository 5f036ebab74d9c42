"""The frontend's HTTP layer, as a subprocess, against a fake engine (a ZMQ test double).

Checked with the official `openai` SDK (it parses our responses and streams), and with raw
httpx for the SSE byte format, client disconnects, startup and health. Also completions
`echo` of token-id prompts, and usage on every chunk (stream_options.continuous_usage_stats).
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from services.frontend.tokenizer import Tokenizer
from tests.unit import test_frontend_support as support
from tests.unit.test_frontend_support import (FAKE_PROMPT_LOGPROB, HI, MAX_MODEL_LEN, MODEL,
                                              REPLY_TEXT, Stack, health, wait_for)

stack, client, tok = support.stack, support.client, support.tok  # module-scoped fixtures


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


# ---------------------------------------------------------------- completions echo

# Written by hand: the text the token ids below stand for, special tokens included.
ECHO_PROMPT = "<|im_start|>user\nHello there<|im_end|>\n"


def test_echo_of_a_token_id_prompt_keeps_its_special_tokens(client, tok):
    ids = tok.encode(ECHO_PROMPT)
    assert {tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")} <= set(ids)
    reply = tok.decode(tok.encode(REPLY_TEXT)[:3])
    # skip_special_tokens (default true) is about generated text, not the echoed prompt
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, echo=True)
    assert r.choices[0].text == ECHO_PROMPT + reply
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=3, echo=True,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ECHO_PROMPT + reply
    # a string prompt echoes as sent
    r = client.completions.create(model=MODEL, prompt=ECHO_PROMPT, max_tokens=3, echo=True)
    assert r.choices[0].text == ECHO_PROMPT + reply


def test_scoring_a_token_id_prompt_gives_offsets_into_the_echoed_text(client, tok):
    ids = tok.encode(ECHO_PROMPT)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == ECHO_PROMPT and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and "<|im_start|>" in lp.tokens and "<|im_end|>" in lp.tokens
    assert lp.token_logprobs == [None] + [FAKE_PROMPT_LOGPROB] * (len(ids) - 1)
    assert "".join(lp.tokens) == c.text
    assert all(c.text[o:o + len(t)] == t for o, t in zip(lp.text_offset, lp.tokens))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(c.text)


# ---------------------------------------------------------------- usage on every chunk

CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
CHAT_PROMPT = "<|im_start|>user\nSay hello 你好<|im_end|>\n<|im_start|>assistant\n"


def _data_events(raw: bytes) -> list[dict]:
    return [json.loads(e[len(b"data: "):]) for e in raw.split(b"\n\n")
            if e.startswith(b"data: ") and e != b"data: [DONE]"]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats_puts_each_choices_running_usage_on_every_chunk(
        stack, tok, route, n):
    if route == "chat":  # the whole reply and its EOS
        path, body = "/v1/chat/completions", {"messages": HI}
        n_prompt, per_choice = len(tok.encode(CHAT_PROMPT)), len(tok.encode(REPLY_TEXT)) + 1
    else:  # cut at max_tokens
        path, body = "/v1/completions", {"prompt": "Say hello", "max_tokens": 7}
        n_prompt, per_choice = len(tok.encode("Say hello")), 7
    # A stop string the reply lacks: queued outputs then never merge, so each engine output
    # is a chunk and the running count has several values.
    with httpx.stream("POST", stack.url + path, timeout=30, json={
            "model": MODEL, "stream": True, "n": n, "stream_options": CONTINUOUS,
            "stop": ["never in the reply"], **body}) as r:
        assert r.status_code == 200
        *chunks, final = _data_events(b"".join(r.iter_bytes()))
    assert final["choices"] == [] and final["usage"] == {
        "prompt_tokens": n_prompt, "completion_tokens": n * per_choice,
        "total_tokens": n_prompt + n * per_choice}
    counts: dict[int, list[int]] = {i: [] for i in range(n)}
    for c in chunks:
        u = c["usage"]
        assert u["prompt_tokens"] == n_prompt
        assert u["total_tokens"] == n_prompt + u["completion_tokens"]
        [choice] = c["choices"]
        counts[choice["index"]].append(u["completion_tokens"])
        if route == "chat" and choice["delta"].get("role") == "assistant":
            assert u["completion_tokens"] == 0
    for seen in counts.values():
        assert seen == sorted(seen) and seen[-1] == per_choice
        assert len(set(seen)) > 2  # a running count, not the total repeated


def test_openai_sdk_parses_usage_on_every_chunk(client, tok):
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, stream=True,
                                                 stream_options=CONTINUOUS))
    assert all(c.usage is not None for c in chunks)
    seen = [c.usage.completion_tokens for c in chunks if c.choices]
    assert seen[0] == 0 and seen == sorted(seen)
    assert seen[-1] == chunks[-1].usage.completion_tokens == len(tok.encode(REPLY_TEXT)) + 1
    chunks = list(client.completions.create(model=MODEL, prompt="Say hello", max_tokens=7,
                                            stream=True, stream_options=CONTINUOUS))
    assert all(c.usage is not None for c in chunks)
    seen = [c.usage.completion_tokens for c in chunks if c.choices]
    assert seen == sorted(seen) and seen[-1] == chunks[-1].usage.completion_tokens == 7


def test_without_continuous_usage_stats_chunks_keep_usage_null(stack):
    for opts in ({"include_usage": True}, {"include_usage": True,
                                            "continuous_usage_stats": False},
                 {"continuous_usage_stats": True}):  # vLLM: only together with include_usage
        with httpx.stream("POST", stack.url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": "Say hello", "max_tokens": 7, "stream": True,
                "stream_options": opts}) as r:
            events = _data_events(b"".join(r.iter_bytes()))
        with_choices = [e for e in events if e["choices"]]
        if opts.get("include_usage"):
            assert all(e["usage"] is None for e in with_choices)
            assert events[-1]["usage"]["completion_tokens"] == 7
        else:
            assert all("usage" not in e for e in events)


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
