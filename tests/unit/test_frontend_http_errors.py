"""Bad requests and engine failures over HTTP: OpenAI's error envelope and status, SSE error
events, and a server that keeps serving afterwards."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.unit import test_frontend_support as support
from tests.unit.test_frontend_support import HI, MAX_MODEL_LEN, MODEL, Stack

stack, client = support.stack, support.client  # module-scoped fixtures

# ---------------------------------------------------------------- errors

BAD_REQUESTS = [
    ("invalid json", b"{not json", 400, None, None),
    ("missing messages", {"model": MODEL}, 400, "messages", None),
    ("empty messages", {"model": MODEL, "messages": []}, 400, "messages", None),
    ("bad role", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role", None),
    ("image part", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0].type",
     None),
    ("temperature", {"model": MODEL, "messages": HI, "temperature": 3}, 400, "temperature", None),
    ("top_p zero", {"model": MODEL, "messages": HI, "top_p": 0}, 400, "top_p", None),
    ("max_tokens string", {"model": MODEL, "messages": HI, "max_tokens": "9"}, 400, "max_tokens",
     None),
    ("n too big", {"model": MODEL, "messages": HI, "n": 17}, 400, "n", None),
    ("top_logprobs without logprobs", {"model": MODEL, "messages": HI, "top_logprobs": 3}, 400,
     "top_logprobs", None),
    ("presence_penalty", {"model": MODEL, "messages": HI, "presence_penalty": 2.5}, 400,
     "presence_penalty", None),
    ("logit_bias bad id", {"model": MODEL, "messages": HI, "logit_bias": {"999999999": 1}}, 400,
     "logit_bias", None),
    ("bad json schema", {"model": MODEL, "messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     400, "response_format.json_schema.schema", None),
    ("stream_options without stream", {"model": MODEL, "messages": HI,
                                       "stream_options": {"include_usage": True}}, 400,
     "stream_options", None),
    ("continuous_usage_stats not a boolean", {
        "model": MODEL, "messages": HI, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": "yes"}}, 400,
     "stream_options.continuous_usage_stats", None),
    ("too long", {"model": MODEL, "messages": HI, "max_tokens": MAX_MODEL_LEN}, 400,
     "messages", "context_length_exceeded"),
    ("too long streamed", {"model": MODEL, "messages": HI, "stream": True,
                           "max_tokens": MAX_MODEL_LEN}, 400, "messages",
     "context_length_exceeded"),
    ("template refuses", {"model": MODEL, "messages": HI + HI}, 400, "messages", None),
    ("unknown model", {"model": "gpt-9", "messages": HI}, 404, "model", "model_not_found"),
    ("tool without function", {"model": MODEL, "messages": HI, "tools": [{"type": "function"}]},
     400, "tools[0].function", None),
    ("tool_choice names an unknown tool", {"model": MODEL, "messages": HI, "tools": [
        {"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice.function.name", None),
    # OpenAI's schema: a user message's content parts have minItems 1 (its 400: "empty_array")
    ("user content an empty array", {"model": MODEL, "messages": [{"role": "user", "content": []}]},
     400, "messages[0].content", "empty_array"),
    # OpenAI's function names: ^[a-zA-Z0-9_-]{1,64}$; strict: a boolean
    ("tool name with a space", {"model": MODEL, "messages": HI, "tools": [
        {"type": "function", "function": {"name": "bad name!"}}]}, 400, "tools[0].function.name", None),
    ("tool name of 65 characters", {"model": MODEL, "messages": HI, "tools": [
        {"type": "function", "function": {"name": "f" * 65}}]}, 400, "tools[0].function.name", None),
    ("tool strict not a boolean", {"model": MODEL, "messages": HI, "tools": [
        {"type": "function", "function": {"name": "f", "strict": "yes"}}]}, 400,
     "tools[0].function.strict", None),
]


@pytest.mark.parametrize("name,body,status,param,code", BAD_REQUESTS,
                         ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_openai_error_envelope_then_server_still_serves(
        stack, name, body, status, param, code):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=10,
                   headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert (err["param"], err["code"]) == (param, code)
    assert err["message"] and "Traceback" not in err["message"] and "<" not in err["message"]
    ok = httpx.post(f"{stack.url}/v1/chat/completions", json={"model": MODEL, "messages": HI},
                    timeout=10)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "stop"


# Not one of OpenAI's four forms (a string, strings, token ids, lists of token ids).
BAD_PROMPTS = [["a", 1], [[1], "a"], ["a", [1]], [[1], 2], [1, [2]], [[1], [2, "x"]],
               [[]], [[1], []], [], [True], ""]


@pytest.mark.parametrize("prompt", BAD_PROMPTS, ids=[repr(p) for p in BAD_PROMPTS])
def test_mixed_or_empty_prompt_list_is_a_400_naming_prompt_then_server_still_serves(
        stack, prompt):
    r = httpx.post(f"{stack.url}/v1/completions", timeout=10,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "prompt", None)
    assert err["message"] and "Traceback" not in err["message"]
    # each of the four forms is still served: (prompt, number of prompts)
    for good, n in (("Say hello", 1), (["Say", "hello"], 2), ([5, 6], 1), ([[5, 6], [7]], 2)):
        ok = httpx.post(f"{stack.url}/v1/completions", timeout=10,
                        json={"model": MODEL, "prompt": good, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        assert [c["finish_reason"] for c in ok.json()["choices"]] == ["length"] * n


def test_an_empty_user_content_array_is_a_bad_request_in_the_openai_sdk_and_an_assistants_is_not(
        client, stack):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": []}])
    assert (e.value.code, e.value.param) == ("empty_array", "messages[0].content")
    # an assistant turn's empty parts (a call-only turn, as some clients send it) still serve
    r = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": []},
        {"role": "user", "content": "again"}])
    assert r.choices[0].finish_reason == "stop"


def test_unknown_model_raises_not_found_in_openai_sdk(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=HI)
    assert e.value.code == "model_not_found"


def test_unknown_route_is_404_with_envelope(stack):
    r = httpx.get(f"{stack.url}/v1/nothing", timeout=5)
    assert r.status_code == 404 and "error" in r.json()


def test_engine_error_is_500_when_not_streaming(stack):
    r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=10, json={
        "model": MODEL, "messages": [{"role": "user", "content": "please fail"}]})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert "simulated worker fault" in r.json()["error"]["message"]


def test_engine_error_is_an_sse_error_event_then_done_when_streaming(stack):
    body = {"model": MODEL, "stream": True,
            "messages": [{"role": "user", "content": "please fail"}]}
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_bytes())
    events = [e for e in raw.split(b"\n\n") if e and e != b": keep-alive"]
    assert events[-1] == b"data: [DONE]"
    assert events[-2].startswith(b'data: {"error":')
    assert b"simulated worker fault" in events[-2]




def test_a_request_larger_than_the_engine_waiting_queue_gets_400_not_a_hopeless_503():
    """The engine queues at most max_num_waiting requests (beyond: 503 + Retry-After). One
    HTTP request opening more engine requests than that (prompts x n) could never be
    admitted whole, so it is the client's 400, naming the field; one that fits is served."""
    st = Stack()
    try:
        st.start_engine().info.max_num_waiting = 3  # sent to the frontend at its Hello
        st.start_frontend()
        st.wait_healthy()
        post = lambda path, body: httpx.post(st.url + path, json={"model": MODEL, **body}, timeout=30)  # noqa: E731
        r = post("/v1/chat/completions", {"messages": HI, "n": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        r = post("/v1/completions", {"prompt": ["a", "b"], "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "--max-num-waiting" in r.json()["error"]["message"]
        assert post("/v1/chat/completions", {"messages": HI, "n": 3}).status_code == 200
        assert post("/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 2}).status_code == 200
        assert len(st.engine.added) == 6  # 3 + 3: the refused requests reached no engine
    finally:
        st.close()


# ---------------------------------------------------------------- sampling edge values


def _deep_array_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("top_k", [2**31, 2**63])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_top_k_past_int32_is_a_400_saying_the_range_then_server_still_serves(
        stack, route, top_k):
    """A huge top_k used to reach the worker, whose sampler tensor overflowed and failed the
    whole step (every in-flight request)."""
    body = {"model": MODEL, "max_tokens": 2, "top_k": top_k}
    body |= {"messages": HI} if route == "/v1/chat/completions" else {"prompt": "Say hello"}
    n_added = len(stack.engine.added)
    r = httpx.post(stack.url + route, json=body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", "top_k")
    assert err["message"] == "'top_k' must be an integer between -1 and 2147483647."
    assert len(stack.engine.added) == n_added  # never reached the engine
    ok = httpx.post(stack.url + route, json=body | {"top_k": 2**31 - 1}, timeout=10)
    assert ok.status_code == 200, ok.text
    assert stack.engine.added[-1].sampling.top_k == 2**31 - 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_deeply_nested_response_format_schema_is_a_400_not_a_500(stack, stream):
    """orjson cannot serialize past ~255 levels ("Recursion limit reached"): a 400 naming
    the schema, not an internal error."""
    body = {"model": MODEL, "messages": HI, "stream": stream, "response_format": {
        "type": "json_schema", "json_schema": {"name": "deep", "schema": _deep_array_schema(400)}}}
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error",
                                           "response_format.json_schema.schema")
    assert "nested too deeply" in err["message"]
    ok = httpx.post(f"{stack.url}/v1/chat/completions", json={"model": MODEL, "messages": HI},
                    timeout=10)
    assert ok.status_code == 200


@pytest.mark.parametrize("forced", [False, True])
def test_a_deeply_nested_tool_parameters_schema_is_a_400_before_the_engine(stack, forced):
    """xgrammar took 18 s on a 300-level forced tool schema in the engine, with other
    requests waiting: past 64 levels of objects and arrays a tool schema is a 400 naming it
    (services/frontend/schema_limits.py), never sent; 60 levels still pass."""
    def body(depth: int) -> dict:
        b = {"model": MODEL, "messages": HI, "max_tokens": 4, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": _deep_array_schema(depth)}}]}
        if forced:
            b["tool_choice"] = {"type": "function", "function": {"name": "f"}}
        return b
    n_added = len(stack.engine.added)
    for depth in (64, 400):  # 65 / 401 nested objects
        r = httpx.post(f"{stack.url}/v1/chat/completions", json=body(depth), timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["type"], err["param"]) == ("invalid_request_error", "tools[0].function.parameters")
        assert "nested too deeply" in err["message"]
    assert len(stack.engine.added) == n_added  # never reached the engine
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body(59), timeout=30)  # 60 levels
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_tiny_temperature_is_greedy_and_a_tiny_top_p_is_clamped_in_the_engine_request(
        stack, route):
    """1e-40 would be 0 in the worker's float32 (garbage): as vLLM, below 1e-5 is greedy;
    a top_p below 1e-6 is sent as 1e-6 (the most likely token only, no underflow)."""
    body = {"model": MODEL, "max_tokens": 2, "temperature": 1e-40, "top_p": 1e-40}
    body |= {"messages": HI} if route == "/v1/chat/completions" else {"prompt": "Say hello"}
    r = httpx.post(stack.url + route, json=body, timeout=10)
    assert r.status_code == 200, r.text
    sp = stack.engine.added[-1].sampling
    assert (sp.temperature, sp.top_p) == (0.0, 1e-6)
    r = httpx.post(stack.url + route, json=body | {"temperature": 1e-5, "top_p": 1e-6},
                   timeout=10)
    assert r.status_code == 200, r.text
    sp = stack.engine.added[-1].sampling
    assert (sp.temperature, sp.top_p) == (1e-5, 1e-6)  # at the bounds: unchanged


def test_to_params_makes_tiny_temperature_greedy_and_clamps_tiny_top_p():
    from services.frontend.openai_sampling import parse_sampling

    def params(**kw):
        return parse_sampling(kw, vocab_size=100).to_params(8, 0)

    assert params(temperature=1e-40).temperature == 0.0
    assert params(temperature=9.99e-6).temperature == 0.0
    assert params(temperature=1e-5).temperature == 1e-5
    assert params(temperature=0.7).temperature == 0.7
    assert params(top_p=1e-300).top_p == 1e-6
    assert params(top_p=0.5).top_p == 0.5
    assert params().temperature == 1.0 and params().top_p == 1.0


def test_continue_final_message_continues_the_assistant_text_and_refuses_both_flags(stack):
    """vLLM's continue_final_message (with add_generation_prompt false): the prompt ends
    right after the final assistant text; both flags true is a 400 naming the field."""
    msgs = [{"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 2, "continue_final_message": True,
            "add_generation_prompt": False}
    r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    prompt = stack.engine.tokenizer.decode(stack.engine.added[-1].prompt_token_ids,
                                           skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\nThe capital of France is"), prompt
    r = httpx.post(f"{stack.url}/v1/chat/completions",
                   json=body | {"add_generation_prompt": True}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "continue_final_message"
    r = httpx.post(f"{stack.url}/v1/chat/completions", json={"model": MODEL, "messages": msgs,
                   "max_tokens": 2}, timeout=10)  # default: a new assistant turn after it
    assert r.status_code == 200, r.text
    prompt = stack.engine.tokenizer.decode(stack.engine.added[-1].prompt_token_ids,
                                           skip_special_tokens=False)
    assert prompt.endswith("The capital of France is<|im_end|>\n<|im_start|>assistant\n"), prompt


DEEP_ARGS = '{"a":' + "[" * 1000 + "]" * 1000 + "}"  # past Python json's recursion limit


@pytest.mark.parametrize("args", [DEEP_ARGS, '{"a":' + "[" * 200 + "]" * 200 + "}"],
                         ids=["1000 levels", "200 levels"])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_deeply_nested_tool_call_arguments_in_messages_are_a_400_naming_them(stack, route, args):
    """json.loads of the arguments raised RecursionError: a 500. Now a 400 naming the
    arguments (services/frontend/strict_json.loads), as the Responses API answers."""
    messages = HI + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = httpx.post(stack.url + route, json={"model": MODEL, "messages": messages}, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error",
                                           "messages[1].tool_calls[0].function.arguments")
    assert "nested" in err["message"]


def test_deeply_nested_function_call_arguments_in_responses_input_are_a_400(stack):
    item = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP_ARGS}
    r = httpx.post(stack.url + "/v1/responses", json={"model": MODEL, "input": [
        {"role": "user", "content": "hi"}, item,
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input[1].arguments" and "nested" in err["message"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize", "/v1/messages"])
def test_a_body_nested_past_the_parser_limit_says_it_is_too_deep_not_invalid(stack, route):
    deep = "[" * 1100 + "]" * 1100
    raw = ('{"model": "%s", "messages": %s}' % (MODEL, deep)).encode()
    r = httpx.post(stack.url + route, content=raw, timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    doc = r.json()
    err = doc["error"]
    if route == "/v1/messages":
        assert doc["type"] == "error" and err["type"] == "invalid_request_error"
    assert err["message"] == "The request body is nested too deeply."
