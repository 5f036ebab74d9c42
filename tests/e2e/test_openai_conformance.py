"""OpenAI conformance of a real `kestrel serve` (SmolLM2-135M-Instruct on CPU).

Mechanical invariants, not model quality: checked with the official `openai` SDK (it parses
every response and stream), raw httpx for SSE bytes, the model's own tokenizer, jsonschema
for structured output, and schemathesis against /openapi.json. One module-scoped server.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from services.frontend.tokenizer import Tokenizer
from tests.e2e.server import KestrelServer

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Write one sentence about the ocean."


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = KestrelServer(str(smollm2_dir), "--max-model-len", "1024",
                        "--max-request-body-bytes", "65536").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return Tokenizer(str(smollm2_dir))


def _msgs(text=PROMPT):
    return [{"role": "user", "content": text}]


def _sse_events(raw: bytes) -> list:
    """The `data:` payloads of an SSE body, parsed (the spec's framing: events end with a
    blank line)."""
    out = []
    for event in raw.decode().split("\n\n"):
        for line in event.splitlines():
            if line.startswith("data: "):
                out.append(line[6:])
    return out


def _stream_raw(server, path, body):
    with httpx.stream("POST", server.base_url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return r.read()


# ---------------------------------------------------------------- stop strings


def test_stop_string_spanning_tokens_never_streams_a_prefix(client, server, tok):
    full = client.chat.completions.create(model=MODEL, messages=_msgs(), temperature=0,
                                          max_tokens=40).choices[0].message.content
    ids = tok.encode(full)
    assert len(ids) >= 8
    # S spans tokens 4..6 of T (2+ tokens); the answer is T before S's first occurrence.
    stop = tok.decode(ids[4:7])
    assert stop.strip() and full.find(stop) >= 0
    expected = full[:full.find(stop)]
    resp = client.chat.completions.create(model=MODEL, messages=_msgs(), temperature=0,
                                          max_tokens=40, stop=[stop])
    assert resp.choices[0].message.content == expected
    assert resp.choices[0].finish_reason == "stop"
    raw = _stream_raw(server, "/v1/chat/completions", {
        "model": MODEL, "messages": _msgs(), "temperature": 0, "max_tokens": 40,
        "stop": ["zzzz-never", stop], "stream": True})
    deltas = [json.loads(e)["choices"][0]["delta"].get("content") or ""
              for e in _sse_events(raw) if e != "[DONE]"]
    assert "".join(deltas) == expected
    for d in deltas:  # no part of S ever went out: every delta lies inside the expected text
        assert stop not in d
    assert stop not in "".join(deltas)


def test_earliest_stop_string_wins(client, tok):
    full = client.chat.completions.create(model=MODEL, messages=_msgs(), temperature=0,
                                          max_tokens=40).choices[0].message.content
    ids = tok.encode(full)
    early, late = tok.decode(ids[2:4]), tok.decode(ids[6:8])
    expected = full[:min(full.find(early), full.find(late))]
    resp = client.chat.completions.create(model=MODEL, messages=_msgs(), temperature=0,
                                          max_tokens=40, stop=[late, early])
    assert resp.choices[0].message.content == expected


# ---------------------------------------------------------------- streaming shape


@pytest.mark.parametrize("prompt", ["请用中文写一句关于大海的话。", "Reply with three emoji 🌊🐬🐳 and words."])
def test_utf8_stream_equals_non_stream(client, prompt):
    kw = dict(model=MODEL, messages=_msgs(prompt), temperature=0, max_tokens=24)
    text = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text and "\ufffd" not in streamed


def test_n_choices_have_own_index_finish_reason_and_usage_chunk(client, server):
    raw = _stream_raw(server, "/v1/chat/completions", {
        "model": MODEL, "messages": _msgs(), "n": 3, "max_tokens": 8, "seed": 5,
        "stream": True, "stream_options": {"include_usage": True}})
    events = _sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = [c for c in chunks if c.get("usage")]
    assert len(usage) == 1 and chunks[-1] is usage[0] and usage[0]["choices"] == []
    finishes: dict[int, list] = {0: [], 1: [], 2: []}
    completion_per_choice = {}
    for c in chunks[:-1]:
        assert c["usage"] is None and len(c["choices"]) == 1
        ch = c["choices"][0]
        finishes[ch["index"]].append(ch["finish_reason"])
    for i, fs in finishes.items():
        assert fs[-1] in ("stop", "length") and all(f is None for f in fs[:-1]), (i, fs)
        completion_per_choice[i] = True
    # Non-streaming, via the SDK: 3 choices, usage sums them (each <= max_tokens).
    resp = client.chat.completions.create(model=MODEL, messages=_msgs(), n=3, max_tokens=8,
                                          seed=5)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert 3 <= resp.usage.completion_tokens <= 24


def test_seed_reproducible(client):
    kw = dict(model=MODEL, messages=_msgs(), temperature=1.0, max_tokens=16, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


# ---------------------------------------------------------------- logprobs


def test_chat_logprobs_one_entry_per_token_and_greedy_is_argmax(client):
    resp = client.chat.completions.create(model=MODEL, messages=_msgs(), temperature=0,
                                          max_tokens=10, logprobs=True, top_logprobs=5)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 5
        assert e.logprob == pytest.approx(max(t.logprob for t in e.top_logprobs), abs=1e-4)
        assert e.token == e.top_logprobs[0].token and bytes(e.bytes) == bytes(
            e.top_logprobs[0].bytes)


def test_top_logprobs_null_is_accepted(client):
    resp = client.chat.completions.create(model=MODEL, messages=_msgs(), max_tokens=2,
                                          top_logprobs=None)
    assert resp.choices[0].logprobs is None


# ---------------------------------------------------------------- completions


def test_completions_prompt_forms_and_indexes(client, tok):
    ids = tok.encode("The sky is")
    for prompt, groups in (("The sky is", 1), (["The sky is", "Water is"], 2), (ids, 1),
                           ([ids, tok.encode("Fire is")], 2)):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=2,
                                      temperature=0)
        assert sorted(c.index for c in r.choices) == list(range(2 * groups))
        by = {c.index: c.text for c in r.choices}
        for g in range(groups):
            assert by[2 * g] == by[2 * g + 1]  # greedy: both choices of a prompt agree
    a = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4,
                                  temperature=0).choices[0].text
    b = client.completions.create(model=MODEL, prompt=ids, max_tokens=4,
                                  temperature=0).choices[0].text
    assert a == b


def test_completions_echo_scoring_with_max_tokens_zero(client, tok):
    r = client.completions.create(model=MODEL, prompt="The capital of France is Paris",
                                  max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == "The capital of France is Paris"
    assert r.usage.completion_tokens == 0
    n = len(tok.encode("The capital of France is Paris", add_special_tokens=True))
    assert len(c.logprobs.tokens) == n and c.logprobs.token_logprobs[0] is None
    assert "".join(c.logprobs.tokens) == c.text
    assert all(isinstance(x, float) and x <= 0 for x in c.logprobs.token_logprobs[1:])


def test_completions_scoring_may_fill_the_whole_context_and_not_one_token_more(client, server, tok):
    ids = tok.encode("The capital of France is Paris. " * 200, add_special_tokens=True)[:1024]  # = max_model_len
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert r.usage.prompt_tokens == 1024 and r.usage.completion_tokens == 0 and c.finish_reason == "length"
    assert len(c.logprobs.token_logprobs) == 1024 and c.logprobs.token_logprobs[0] is None
    # the scores of a prefix do not depend on what follows it (causal attention)
    short = client.completions.create(model=MODEL, prompt=ids[:300], max_tokens=0, echo=True, logprobs=1)
    assert short.choices[0].logprobs.token_logprobs[1:] == pytest.approx(c.logprobs.token_logprobs[1:300],
                                                                         abs=1e-3)
    chunks = list(client.completions.create(model=MODEL, prompt=ids[:300], max_tokens=0, echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == short.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    for body in ({"prompt": ids + [ids[1]], "max_tokens": 0, "echo": True},  # one token more
                 {"prompt": ids, "max_tokens": 1}):  # no room to generate
        resp = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"


def test_completions_logprobs_0_lists_the_chosen_token_alone(client):
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4
    assert lp.top_logprobs == [{t: x} for t, x in zip(lp.tokens, lp.token_logprobs)]


def test_completions_stream_matches_non_stream(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    text = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "x", "max_tokens": 5000}, "prompt"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "stop": ["a" * 300]}, "stop"),
])
def test_completions_bad_fields_name_the_param(server, body, param):
    for stream in (False, True):
        r = httpx.post(server.base_url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "stream": stream, **body})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json"
        assert r.json()["error"]["param"] == param


# ---------------------------------------------------------------- structured output


def test_json_schema_responses_validate(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    choices = []
    for seed in (3, 300):  # 2 x n=10: 20 sampled responses
        resp = client.chat.completions.create(
            model=MODEL, messages=_msgs("Give a person as JSON."), temperature=1.0, n=10,
            max_tokens=60, seed=seed,
            response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": schema, "strict": True}})
        choices += resp.choices
    bad = []
    for c in choices:
        try:
            assert c.finish_reason == "stop", f"cut short: {c.finish_reason}"
            jsonschema.validate(json.loads(c.message.content), schema)
        except Exception as e:  # collected: the assertion shows every failure
            bad.append((c.message.content, str(e)[:80]))
    assert not bad


# ---------------------------------------------------------------- tokenize, limits, stats


def test_tokenize_detokenize_round_trip(server, tok):
    text = "Hello 世界 🌍!"
    r = httpx.post(server.base_url + "/tokenize", json={"model": MODEL, "prompt": text,
                                                        "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(text, add_special_tokens=True)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    back = httpx.post(server.base_url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == text
    m = httpx.post(server.base_url + "/tokenize", json={"messages": _msgs("hi")}).json()
    assert tok.decode(m["tokens"], skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n")
    bad = httpx.post(server.base_url + "/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_body_over_limit_gets_413(server):
    big = {"model": MODEL, "messages": _msgs("x" * 70000)}
    assert httpx.post(server.base_url + "/v1/chat/completions", json=big,
                      timeout=30).status_code == 413

    def chunks():  # no Content-Length: the streamed size is checked
        yield b'{"model": "m", "prompt": "'
        for _ in range(20):
            yield b"y" * 4096
        yield b'"}'

    r = httpx.post(server.base_url + "/v1/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_models_show_max_model_len(client):
    assert client.models.list().data[0].model_extra["max_model_len"] == 1024


def _free_blocks(server) -> int:
    return httpx.get(server.base_url + "/internal/stats", timeout=10).json()["num_free_blocks"]


def _wait_free(server, baseline, deadline_s=5.0) -> int:
    deadline = time.monotonic() + deadline_s
    while (n := _free_blocks(server)) != baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def test_client_disconnects_abort_requests_and_free_blocks(server):
    baseline = _free_blocks(server)
    long_prompt = "Tell me a very long story about a dragon. " * 20
    body = {"model": MODEL, "messages": _msgs(long_prompt), "max_tokens": 500,
            "ignore_eos": True}
    for i in range(20):
        kind = i % 3
        if kind == 0:  # streaming, gone after the first chunk
            with httpx.stream("POST", server.base_url + "/v1/chat/completions",
                              json={**body, "stream": True}, timeout=30) as r:
                next(r.iter_bytes())
        elif kind == 1:  # non-streaming: the answer needs seconds; the client waits 0.3 s
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=0.3)
        else:  # streaming, gone before any response byte: the socket closes after sending
            payload = json.dumps({**body, "stream": True}).encode()
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
                time.sleep(0.2)
    assert _wait_free(server, baseline) == baseline


# ---------------------------------------------------------------- openapi + fuzzing


def test_openapi_document_describes_every_route(server):
    doc = httpx.get(server.base_url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    for path in ("/v1/models", "/v1/chat/completions", "/v1/completions", "/tokenize",
                 "/detokenize", "/health", "/v1/messages", "/v1/messages/count_tokens",
                 "/metrics", "/reset_prefix_cache", "/v1/responses"):
        assert path in doc["paths"]


def test_schemathesis_finds_no_server_errors(server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    ops = [op.ok() for op in schema.get_all_operations()
           if op.ok().path not in ("/internal/stats",)]
    failures = []
    for op in ops:
        max_tokens_cap = op.path in ("/v1/chat/completions", "/v1/completions", "/v1/messages")
        responses = op.path == "/v1/responses"

        @settings(max_examples=25, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def check(case):
            if max_tokens_cap and isinstance(case.body, dict):
                case.body["max_tokens"] = 2  # bounded time: the fuzzing is about validation
                case.body.pop("max_completion_tokens", None)
                case.body.pop("n", None)
                case.body["stream"] = False
                case.body.pop("stream_options", None)
            if responses and isinstance(case.body, dict):
                case.body["max_output_tokens"] = 2
                case.body["stream"] = False
            r = case.call(base_url=server.base_url, timeout=60)
            if r.status_code >= 500:
                failures.append((op.path, case.body, r.status_code, r.text[:200]))

        check()
    assert not failures, failures[:5]
    assert httpx.get(server.base_url + "/health").status_code == 200
