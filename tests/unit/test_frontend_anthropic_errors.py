"""Errors of the Anthropic routes against a real frontend subprocess and the fake engine:
bodies that are not valid JSON (lone surrogates, NaN / Infinity) are 400
invalid_request_error in Anthropic's envelope, errors raised outside the handlers keep that
envelope, a context overflow names max_tokens or the prompt (whichever is at fault), and
the server goes on serving. Checked with the `anthropic` SDK's error classes
and raw HTTP; log lines are read from the frontend's log file."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import pytest

from tests.unit.test_frontend_support import MAX_MODEL_LEN, MODEL, running_stack, wait_for

OK = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def stack():
    yield from running_stack()


def _post(stack, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(stack.url + path, content=raw, timeout=30,
                      headers={"content-type": "application/json",
                               "anthropic-version": "2023-06-01"})


def _assert_anthropic_400(r: httpx.Response, says: str = "not valid JSON") -> dict:
    assert r.status_code == 400, r.text
    doc = r.json()  # the body itself must be valid JSON (no surrogate echoed back raw)
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error", doc
    assert says in doc["error"]["message"]
    assert "Traceback" not in doc["error"]["message"]
    return doc


# Raw bodies: json.dumps would escape a lone surrogate the same way (ensure_ascii).
SURROGATE_BODIES = {
    "message_content": (f'{{"model": "{MODEL}", "max_tokens": 4, "messages": '
                        '[{"role": "user", "content": "\\ud800"}]}'),
    "system": (f'{{"model": "{MODEL}", "max_tokens": 4, "system": "\\udc00", "messages": '
               '[{"role": "user", "content": "hi"}]}'),
    "text_block": (f'{{"model": "{MODEL}", "max_tokens": 4, "messages": [{{"role": "user", '
                   '"content": [{"type": "text", "text": "a\\ud800b"}]}]}'),
    "stream": (f'{{"model": "{MODEL}", "max_tokens": 4, "stream": true, "messages": '
               '[{"role": "user", "content": "\\ud800"}]}'),
    "model": ('{"model": "\\ud800", "max_tokens": 4, "messages": '
              '[{"role": "user", "content": "hi"}]}'),
    "object_key": (f'{{"model": "{MODEL}", "max_tokens": 4, "metadata": {{"\\udfff": 1}}, "messages": '
                   '[{"role": "user", "content": "hi"}]}'),
    "utf8_encoded_surrogate": None,  # raw bytes ED A0 80, built below
}
NON_JSON_BODIES = {
    "nan": f'{{"model": "{MODEL}", "max_tokens": 4, "temperature": NaN, "messages": []}}',
    "infinity": f'{{"model": "{MODEL}", "max_tokens": Infinity, "messages": []}}',
    "neg_infinity": f'{{"model": "{MODEL}", "max_tokens": 4, "top_p": -Infinity, "messages": []}}',
    # a number past a double's range: orjson (OpenAI routes) refuses it; Python's json read it
    # as infinity, and this body was a 200 with "Infinity" in the rendered prompt
    "overflow": (f'{{"model": "{MODEL}", "max_tokens": 4, "messages": [{{"role": "user", "content": "hi"}}, '
                 '{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", '
                 '"input": {"a": -1e400}}]}, {"role": "user", "content": [{"type": "tool_result", '
                 '"tool_use_id": "t", "content": "x"}]}]}'),
    "deep_nesting": '{{"model": "{}", "metadata": {}}}'.format(MODEL, "[" * 100000 + "]" * 100000),
}


def _raw(name: str, table: dict) -> bytes:
    if name == "utf8_encoded_surrogate":
        return json.dumps(OK).replace('"hi"', '"h\x00"').encode().replace(b"\x00", b"\xed\xa0\x80")
    return table[name].encode()


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("case", list(SURROGATE_BODIES))
def test_lone_surrogate_anywhere_is_a_400_in_anthropics_envelope(stack, path, case):
    r = _post(stack, path, _raw(case, SURROGATE_BODIES))
    _assert_anthropic_400(r)
    assert r.headers.get("request-id", "").startswith(("msg_", "req_"))
    # the server keeps serving, on both routes
    assert _post(stack, path, json.dumps(OK).encode()).status_code == 200


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("case", list(NON_JSON_BODIES))
def test_nan_infinity_and_deep_nesting_are_rejected_as_invalid_json(stack, path, case):
    # a body nested past the parser's limit is valid JSON text: the message says what is wrong
    says = "The request body is nested too deeply." if case == "deep_nesting" else "not valid JSON"
    _assert_anthropic_400(_post(stack, path, _raw(case, NON_JSON_BODIES)), says)


def test_sdk_keeps_working_after_lone_surrogate_bodies(stack):
    # The SDK itself refuses to encode a lone surrogate, so those bodies go out raw.
    for case in ("message_content", "stream", "model"):
        _assert_anthropic_400(_post(stack, "/v1/messages", _raw(case, SURROGATE_BODIES)))
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=30)
    m = client.messages.create(model=MODEL, max_tokens=4,
                               messages=[{"role": "user", "content": "hi 🦅"}])
    assert m.type == "message" and m.usage.output_tokens > 0
    with client.messages.stream(model=MODEL, max_tokens=4,
                                messages=[{"role": "user", "content": "hi"}]) as s:
        assert s.get_final_message().usage.output_tokens > 0
    assert client.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
    assert "Exception in ASGI application" not in stack.log()


def test_errors_outside_the_handlers_use_anthropics_envelope(stack):
    r = httpx.post(stack.url + "/v1/messages/nope", json=OK, timeout=30)  # starlette's 404
    assert r.status_code == 404
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(stack.url + "/v1/chat/nope", timeout=30)  # OpenAI routes keep theirs
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_count_tokens_errors_are_logged_with_a_request_id(stack):
    r = _post(stack, "/v1/messages/count_tokens", b'{"model": "other", "messages": []}')
    assert r.status_code == 400
    rid = r.headers["request-id"]
    assert re.fullmatch(r"req_[0-9a-f]{24}", rid)
    wait_for(lambda: f"{rid} rejected (400)" in stack.log(), 10, "the rejection's log line")
    assert "None rejected" not in stack.log()


def test_stop_sequence_finish_is_logged_as_a_stop_not_a_disconnect(stack):
    # REPLY_TEXT contains "Kestrels": the fake engine's reply ends there on the stop sequence
    r = httpx.post(stack.url + "/v1/messages", timeout=30, json=OK | {
        "max_tokens": 64, "stop_sequences": ["Kestrels"]})
    doc = r.json()
    assert doc["stop_reason"] == "stop_sequence" and doc["stop_sequence"] == "Kestrels", doc
    rid = r.headers["request-id"]
    wait_for(lambda: f"{rid} finished: stop (stop string 'Kestrels'" in stack.log(), 10,
             "the stop log line")
    assert f"{rid} aborted" not in stack.log()


def _anthropic_400_message(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    doc = r.json()
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error", doc
    return doc["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_max_tokens_past_the_room_the_prompt_leaves_is_blamed_on_max_tokens(stack, stream):
    n = _post(stack, "/v1/messages/count_tokens", json.dumps(OK).encode()).json()["input_tokens"]
    assert 0 < n < MAX_MODEL_LEN  # the prompt alone fits
    room = MAX_MODEL_LEN - n
    for max_tokens in (100000, room + 1):
        body = OK | {"max_tokens": max_tokens, "stream": stream}
        msg = _anthropic_400_message(_post(stack, "/v1/messages", json.dumps(body).encode()))
        assert msg == (f"max_tokens: {max_tokens} > {room}, the room left after the {n}-token "
                       f"prompt (context {MAX_MODEL_LEN})")
    # the SDK raises its typed error; exactly the room left is served
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens: 100000 > "):
        client.messages.create(model=MODEL, max_tokens=100000, messages=OK["messages"])
    r = _post(stack, "/v1/messages", json.dumps(OK | {"max_tokens": room}).encode())
    assert r.status_code == 200 and r.json()["stop_reason"] == "end_turn", r.text


def test_a_prompt_that_fills_the_context_alone_is_still_too_long(stack):
    body = OK | {"max_tokens": 1, "messages": [{"role": "user", "content": "hello " * MAX_MODEL_LEN}]}
    n = _post(stack, "/v1/messages/count_tokens", json.dumps(body).encode()).json()["input_tokens"]
    assert n >= MAX_MODEL_LEN
    msg = _anthropic_400_message(_post(stack, "/v1/messages", json.dumps(body).encode()))
    assert msg.startswith(f"prompt is too long: {n} tokens") and "max_tokens:" not in msg


# ---------------------------------------------------------------- sampling edge values


@pytest.mark.parametrize("top_k", [2**31, 2**63, 2**200])
@pytest.mark.parametrize("stream", [False, True])
def test_a_top_k_past_int32_is_a_400_naming_top_k_then_server_still_serves(stack, top_k, stream):
    """A huge top_k used to reach the worker, whose sampler tensor overflowed and failed the
    whole step (every in-flight request)."""
    msg = _anthropic_400_message(_post(stack, "/v1/messages", json.dumps(
        OK | {"top_k": top_k, "stream": stream}).encode()))
    assert msg == "top_k: Input should be an integer between 0 and 2147483647."
    r = _post(stack, "/v1/messages", json.dumps(OK | {"top_k": 2**31 - 1}).encode())
    assert r.status_code == 200, r.text
    assert stack.engine.added[-1].sampling.top_k == 2**31 - 1


def test_a_tiny_temperature_is_greedy_and_a_tiny_top_p_is_clamped_in_the_engine_request(stack):
    """1e-40 would be 0 in the worker's float32 (garbage): as vLLM, below 1e-5 is greedy;
    a top_p below 1e-6 is sent as 1e-6 (the most likely token only, no underflow)."""
    tiny = {"temperature": 1e-40, "top_p": 1e-40}
    r = _post(stack, "/v1/messages", json.dumps(OK | tiny).encode())
    assert r.status_code == 200, r.text
    sp = stack.engine.added[-1].sampling
    assert (sp.temperature, sp.top_p) == (0.0, 1e-6)
    r = _post(stack, "/v1/messages", json.dumps(OK | {"temperature": 0.5, "top_p": 0.9}).encode())
    sp = stack.engine.added[-1].sampling
    assert (sp.temperature, sp.top_p) == (0.5, 0.9)


# ---------------------------------------------------------------- engine refusals

REFUSALS = {  # the fake engine's key -> (HTTP status, Anthropic error type, message part)
    "please overload": (529, "overloaded_error", "waiting queue full"),
    "please reject": (400, "invalid_request_error", "schema cannot be compiled"),
}


def _ask(text: str, stream: bool) -> dict:
    return OK | {"stream": stream, "max_tokens": 16,
                 "messages": [{"role": "user", "content": text}]}


def _sse_events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


def _assert_serving(stack) -> None:
    r = _post(stack, "/v1/messages", json.dumps(OK).encode())
    assert r.status_code == 200 and r.json()["type"] == "message", r.text
    with httpx.stream("POST", stack.url + "/v1/messages", json=OK | {"stream": True},
                      timeout=30) as s:
        events = _sse_events(b"".join(s.iter_bytes()))
    assert events[-1][0] == "message_stop", events


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("key", list(REFUSALS))
def test_an_engine_refusal_maps_to_its_anthropic_error_not_a_500(stack, key, stream):
    """The engine refuses an AddRequest with error_kind "overloaded" (waiting queue full) or
    "invalid" (e.g. a forced tool_use schema it cannot compile): 529 overloaded_error with
    Retry-After, or 400 invalid_request_error (a stream too: it waits for the first output
    before it starts), as the OpenAI routes answer 503 / 400."""
    status, kind, part = REFUSALS[key]
    r = _post(stack, "/v1/messages", json.dumps(_ask(key, stream)).encode())
    assert r.status_code == status, r.text
    doc = r.json()
    assert doc["type"] == "error" and doc["error"]["type"] == kind, doc
    assert part in doc["error"]["message"]
    assert r.headers["request-id"].startswith("msg_")
    if status == 529:
        assert int(r.headers["retry-after"]) >= 1
    else:
        assert "retry-after" not in r.headers
    _assert_serving(stack)


@pytest.mark.parametrize("key", list(REFUSALS))
def test_an_engine_refusal_in_a_started_stream_is_an_error_event_of_its_type(stack, key):
    _, kind, part = REFUSALS[key]
    with httpx.stream("POST", stack.url + "/v1/messages", json=_ask(f"{key} late", True),
                      timeout=30) as s:
        assert s.status_code == 200
        events = _sse_events(b"".join(s.iter_bytes()))
    names = [e[0] for e in events]
    assert names[0] == "message_start" and "content_block_delta" in names, names
    assert names[-1] == "error", names
    err = events[-1][1]
    assert err["type"] == "error" and err["error"]["type"] == kind, err
    assert part in err["error"]["message"]
    _assert_serving(stack)


def test_an_engine_refusal_through_the_anthropic_sdk(stack):
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(anthropic.BadRequestError, match="schema cannot be compiled"):
        client.messages.create(**_ask("please reject", False))
    with pytest.raises(anthropic.APIStatusError) as e:
        client.messages.create(**_ask("please overload", False))
    assert e.value.status_code == 529
    assert e.value.body["error"]["type"] == "overloaded_error"
    assert "Exception in ASGI application" not in stack.log()


@pytest.mark.parametrize("forced", [False, True])
def test_a_deeply_nested_input_schema_is_a_400_and_a_60_level_one_serves(stack, forced):
    """Past 64 levels of objects and arrays an input_schema is a 400 naming it
    (services/frontend/schema_limits.py: xgrammar took 18 s on 300 levels in the engine);
    60 levels are rendered (and, forced, sent to the engine as the constraint)."""
    def body(depth: int) -> bytes:
        schema: dict = {"type": "string"}
        for _ in range(depth):
            schema = {"type": "array", "items": schema}
        b = OK | {"tools": [{"name": "f", "input_schema": schema}]}
        if forced:
            b["tool_choice"] = {"type": "tool", "name": "f"}
        return json.dumps(b).encode()
    r = _post(stack, "/v1/messages", body(400))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "tools.0.input_schema" in err["message"]
    assert "nested too deeply" in err["message"]
    r = _post(stack, "/v1/messages", body(59))
    assert r.status_code == 200, r.text


def test_a_final_assistant_message_is_a_prefill_the_answer_continues(stack):
    """Anthropic's prefill: the prompt ends right after the final assistant text (no end of
    turn, no new assistant header), and a prefill ending in whitespace is a 400 as
    Anthropic's API answers it."""
    msgs = [{"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    r = _post(stack, "/v1/messages", json.dumps(OK | {"messages": msgs}).encode())
    assert r.status_code == 200, r.text
    prompt = stack.engine.tokenizer.decode(stack.engine.added[-1].prompt_token_ids,
                                           skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\nThe capital of France is"), prompt
    msgs[-1]["content"] = "The capital of France is "
    r = _post(stack, "/v1/messages", json.dumps(OK | {"messages": msgs}).encode())
    assert r.status_code == 400, r.text
    assert "trailing whitespace" in r.json()["error"]["message"]
