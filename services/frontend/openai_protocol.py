"""Validation of OpenAI Chat Completions requests (POST /v1/chat/completions).

Follows the OpenAI API reference for the request body. Supported fields: model, messages
(roles system, developer (sent to the template as system), user, assistant;
content a string or a list of text parts), max_tokens /
max_completion_tokens, temperature [0, 2], top_p (0, 1], n (1 only), seed, stream,
stream_options.include_usage, stop (a string or a list of strings), and the vLLM extensions
top_k, min_p, min_tokens, stop_token_ids, ignore_eos, skip_special_tokens,
chat_template_kwargs. Unknown fields are ignored, as OpenAI-compatible servers do; known
fields that Kestrel cannot honour yet (tools, logprobs, penalties, response formats) are
rejected unless they hold their neutral value.

Every error is an `InvalidRequest` naming the field (`messages[2].content` style).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from services.frontend.errors import InvalidRequest

ROLES = ("system", "developer", "user", "assistant")
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 16

# field -> neutral values (accepted and ignored); any other value is "not supported yet".
UNSUPPORTED_UNLESS_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
}


@dataclass
class ChatCompletionRequest:
    """A validated chat request. messages: [{"role", "content": str, ("name")}], text
    parts joined with newlines. max_tokens: None when the client gave none (then the
    server uses what is left of max_model_len). top_k: 0 = off."""

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    include_usage: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(float(v)))


def _int(body: dict, name: str, lo: int, hi: int = INT64_MAX) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or not lo <= v <= hi:
        bound = ("in the 64-bit range" if lo == INT64_MIN else
                 f"at least {lo}" if hi == INT64_MAX else f"between {lo} and {hi}")
        raise InvalidRequest(name, f"'{name}' must be an integer {bound}.")
    return v


def _number(body: dict, name: str, default: float, lo: float, hi: float,
            lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v) or not (lo < v if lo_open else lo <= v) or not v <= hi:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise InvalidRequest(name, f"'{name}' must be a number in {interval}.")
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidRequest(name, f"'{name}' must be a boolean.")
    return v


def _content(i: int, role: str, content: Any) -> str:
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequest(f"{param}[{j}].type",
                                     "Only content parts of type 'text' are supported.")
            if not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{param}[{j}].text", "A text part needs a string 'text'.")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequest(param, "A message's content must be a string or a list of text parts.")


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """Validate `messages` and normalize each to {"role", "content": str, ("name")}.
    Raises InvalidRequest naming the first bad message field."""
    if value is None:
        raise InvalidRequest("messages", "Missing required parameter: 'messages'.")
    if not isinstance(value, list):
        raise InvalidRequest("messages", "'messages' must be an array of message objects.")
    if not value:
        raise InvalidRequest("messages", "'messages' must contain at least one message.")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise InvalidRequest(f"messages[{i}]", "Each message must be an object.")
        role = msg.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role",
                                 f"A message's role must be one of {', '.join(ROLES)}.")
        # OpenAI's "developer" role is the system role of newer models; templates know
        # only "system".
        norm = {"role": "system" if role == "developer" else role,
                "content": _content(i, role, msg.get("content"))}
        if msg.get("name") is not None:
            if not isinstance(msg["name"], str):
                raise InvalidRequest(f"messages[{i}].name", "'name' must be a string.")
            norm["name"] = msg["name"]
        out.append(norm)
    return out


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if (not isinstance(value, list) or len(value) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in value)):
        raise InvalidRequest("stop", "'stop' must be a non-empty string or a list of at most "
                                     f"{MAX_STOP_STRINGS} non-empty strings.")
    return list(dict.fromkeys(value))


def parse_chat_request(raw: bytes) -> ChatCompletionRequest:
    """Parse and validate a request body (JSON bytes).

    Raises InvalidRequest for invalid JSON, a body that is not an object, a missing model
    or messages, or any field of the wrong type or out of range (param names the field).
    """
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequest(None, "The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise InvalidRequest(None, "The request body must be a JSON object.")
    model = body.get("model")
    if model is None:
        raise InvalidRequest("model", "Missing required parameter: 'model'.")
    if not isinstance(model, str):
        raise InvalidRequest("model", "'model' must be a string.")
    messages = parse_messages(body.get("messages"))
    for name, neutral in UNSUPPORTED_UNLESS_NEUTRAL.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v)
                                    for v in neutral):
            raise InvalidRequest(name, f"'{name}' is not supported by this server yet.")
    n = _int(body, "n", 1)
    if n is not None and n != 1:
        raise InvalidRequest("n", "Only n=1 is supported for now.")
    max_tokens = _int(body, "max_tokens", 1)
    max_completion = _int(body, "max_completion_tokens", 1)
    top_k = _int(body, "top_k", -1)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and (not isinstance(stop_ids, list)
                                 or not all(_is_int(t) and t >= 0 for t in stop_ids)):
        raise InvalidRequest("stop_token_ids", "'stop_token_ids' must be a list of token ids.")
    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise InvalidRequest("stream_options",
                                 "'stream_options' is only allowed when 'stream' is true.")
        if not isinstance(stream_options, dict):
            raise InvalidRequest("stream_options", "'stream_options' must be an object.")
        include_usage = _bool(stream_options, "include_usage", False)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidRequest("chat_template_kwargs", "'chat_template_kwargs' must be an object.")
    return ChatCompletionRequest(
        model=model,
        messages=messages,
        max_tokens=max_completion if max_completion is not None else max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=0 if top_k is None or top_k == -1 else top_k,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        min_tokens=_int(body, "min_tokens", 0) or 0,
        seed=_int(body, "seed", INT64_MIN),
        stop=_stop(body.get("stop")),
        stop_token_ids=list(stop_ids or []),
        ignore_eos=_bool(body, "ignore_eos", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        stream=stream,
        include_usage=include_usage,
        chat_template_kwargs=dict(kwargs or {}),
    )
