"""Validation of Anthropic Messages API requests (POST /v1/messages and
/v1/messages/count_tokens), following Anthropic's API reference.

Accepted: model, max_tokens (required on /v1/messages, >= 1), messages (roles user,
assistant and system; content a string or blocks `text`, `image` (base64 source),
`tool_use`, `tool_result`, and `thinking` / `redacted_thinking` in assistant turns, which
are not replayed; a `system` message, Anthropic's "mid-conversation system message", holds a
string or text blocks and is rendered as a system turn where it stands), system (a string or
text blocks: the first system turn), stop_sequences, temperature [0, 1], top_p (0, 1], top_k
in [0, 2**31 - 1] (0: off; larger values would overflow the worker's sampler), stream, tools
(custom tools: name, description, input_schema), tool_choice (auto / any / tool with name /
none, disable_parallel_tool_use), metadata (user_id, accepted and unused), thinking and
output_config (anthropic_fields.py: every documented thinking type; structured output with
output_config.format), and the fields accepted without effect (anthropic_fields'
IGNORED_FIELDS: cache_control, context_management, service_tier, ...). Any other top-level
field is a 400 "<field>: Extra inputs are not permitted", as Anthropic answers. Blocks may
carry keys not read here (citations): they are ignored; a `cache_control` (top-level, on a
block or a tool) is checked (an object of type "ephemeral", anthropic_fields'
`check_cache_control`) and unused. A null optional field is the same as an absent one.
As Anthropic's API rules: a message's content (array or string) is not empty unless it is
the final assistant message's ("all messages must have non-empty content ..."), a text block's text
(in messages, system and system messages) is not empty ("text content blocks must be
non-empty"), a tool's name matches `^[a-zA-Z0-9_-]{1,128}$` and its `strict` is a boolean.

Sampling values go to the engine as on the OpenAI routes (anthropic_api.py, with
openai_sampling's `engine_temperature` / `engine_top_p`): a temperature below 1e-5 is greedy
(0.0), a top_p below 1e-6 is sent as 1e-6. The server's sampling defaults
(`--generation-config`, `--override-generation-config`, docs/ARCHITECTURE.md §7.5) fill
temperature, top_p and top_k where the request sets none, and give min_p and
repetition_penalty (no Anthropic fields); max_tokens is required, so only the override's
max_new_tokens applies to it, as a ceiling (`max_tokens_cap`).

Images: the served models are text-only. An image block is decoded and checked with Pillow
(a bad one is a 400 "invalid image"); a valid one is then rejected with a 400 saying that the
model does not support images.

The body is parsed with Python's json module, so integers of any size in tool inputs stay
exact, but as strictly as the OpenAI routes' orjson: not UTF-8, NaN / Infinity tokens, too
deep nesting, or a lone surrogate in any string (a `\\ud800` escape) is a 400 "not valid
JSON", before any other check. Every error is an `InvalidRequest` naming the field
(`messages.0.content.1.source`).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
from dataclasses import dataclass, field
from typing import Any

from services.frontend.anthropic_fields import (Thinking, check_cache_control, check_known_fields,
                                                parse_output_config, parse_thinking)
from services.frontend.errors import InvalidRequest
from services.frontend.openai_sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS
from services.frontend.schema_limits import depth_message, too_deep
from services.frontend.strict_json import load_json
from services.frontend.structured_fields import json_schema_constraint
from shared.config_generation import NO_DEFAULTS, GenerationDefaults
from shared.protocol import StructuredSpec

IMAGE_MEDIA_TYPES = {"image/jpeg": "JPEG", "image/png": "PNG", "image/gif": "GIF",
                     "image/webp": "WEBP"}
TOOL_CHOICES = ("auto", "any", "tool", "none")
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")  # Anthropic's rule for a custom tool's name
EMPTY_CONTENT = "all messages must have non-empty content except for the optional final assistant message"
MAX_TOP_K = 2**31 - 1  # larger values would overflow the worker's sampler tensors


@dataclass
class MessagesRequest:
    """A validated request. messages: template-ready dicts ({"role", "content": str} plus
    "tool_calls" for assistant tool_use, role "tool" with "tool_call_id" for tool_result).
    tools: template-ready [{"type": "function", "function": {...}}]; tool_schemas: name ->
    input_schema. tool_choice: "auto" | "any" | "tool" | "none"; tool_name for "tool".
    thinking: the thinking switch and display (anthropic_fields.Thinking). output_format:
    output_config.format as the engine's constraint (None: free text). min_p,
    repetition_penalty: the server's defaults (no request field). max_tokens_cap: the
    server's ceiling on max_tokens (None: none); max_tokens is the request's own."""

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    stop_sequences: list[str] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens_cap: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    tool_choice: str = "auto"
    tool_name: str | None = None
    parallel_tool_use: bool = True
    thinking: Thinking = field(default_factory=Thinking)
    output_format: StructuredSpec | None = None


def is_prefill(messages: list[dict[str, Any]]) -> bool:
    """Whether the template messages end with an assistant message of text (no tool calls):
    Anthropic's prefill, which the answer continues (rendered with the chat template's
    `continue_final_message`); the response holds the continuation only."""
    final = messages[-1] if messages else {}
    text = final.get("content")
    return (final.get("role") == "assistant" and not final.get("tool_calls")
            and isinstance(text, str) and bool(text.strip()))


def _type_name(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(v), "a number")


def _need(cond: object, param: str, message: str) -> None:
    """Raise InvalidRequest(param) naming `param` in the message unless `cond` is true."""
    if not cond:
        raise InvalidRequest(param, f"{param}: {message}")


def _text_of(blocks: Any, param: str) -> str:
    """A string, or a list of text blocks joined with newlines."""
    if isinstance(blocks, str):
        return blocks
    _need(isinstance(blocks, list), param, f"Input should be a string or an array of text blocks, not {_type_name(blocks)}.")
    texts = []
    for j, b in enumerate(blocks):
        p = f"{param}.{j}"
        _need(isinstance(b, dict) and b.get("type") == "text", p, "Input should be a text block.")
        texts.append(_block_text(b, p))
    return "\n".join(texts)


def _block_text(block: dict[str, Any], param: str) -> str:
    """The text of a text block at `param`, checked as Anthropic checks it: a string, not
    empty ("text content blocks must be non-empty"), and a well-formed cache_control."""
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequest(f"{param}.text", f"{param}.text: Field required (a string).")
    _need(text != "", f"{param}.text", "text content blocks must be non-empty")
    check_cache_control(block, param)
    return text


def check_image(block: dict[str, Any], param: str) -> None:
    """Decode and verify a base64 image block with Pillow, then reject it (text-only model).
    Raises InvalidRequest: a bad source / media type / image, or "does not support images"."""
    src = block.get("source")
    if not isinstance(src, dict):
        raise InvalidRequest(f"{param}.source", f"{param}.source: Field required (an object).")
    _need(src.get("type") == "base64", f"{param}.source.type",
          "Only base64 image sources are supported.")
    media: Any = src.get("media_type")  # a JSON value, checked below
    _need(media in IMAGE_MEDIA_TYPES, f"{param}.source.media_type",
          f"Input should be one of {', '.join(IMAGE_MEDIA_TYPES)}.")
    data: Any = src.get("data")  # a JSON value, checked below
    _need(isinstance(data, str) and data, f"{param}.source.data", "Field required (base64 text).")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{param}.source.data", f"{param}.source.data: The image is not valid base64.") from None
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw)) as img:
            fmt = img.format
            img.verify()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise InvalidRequest(f"{param}.source.data",
                             f"{param}.source.data: Invalid image: the data is not a readable {media} image.") from None
    _need(fmt == IMAGE_MEDIA_TYPES[media], f"{param}.source.media_type",
          f"The image is {fmt}, but media_type says {media}.")
    raise InvalidRequest(param, f"{param}: This model does not support images (it is text-only).")


def _tool_result_text(content: Any, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    _need(isinstance(content, list), param, "Input should be a string or an array of blocks.")
    texts = []
    for j, b in enumerate(content):
        p = f"{param}.{j}"
        _need(isinstance(b, dict), p, "Input should be an object.")
        check_cache_control(b, p)
        if b.get("type") == "image":
            check_image(b, p)
        _need(b.get("type") == "text" and isinstance(b.get("text"), str), p,
              "Input should be a text block.")
        texts.append(b["text"])
    return "\n".join(texts)


def _message(i: int, msg: Any, final: bool) -> list[dict[str, Any]]:
    """One Anthropic message as template messages (tool results become role "tool").
    final: it is the last of `messages` (only a final assistant message may have no content
    blocks, as Anthropic's API rules)."""
    param = f"messages.{i}"
    _need(isinstance(msg, dict), param, "Input should be an object.")
    role = msg.get("role")
    _need(role in ("user", "assistant", "system"), f"{param}.role",
          "Input should be 'user', 'assistant' or 'system'.")
    content = msg.get("content")
    if role == "system":  # a mid-conversation system message: text only
        return [{"role": "system", "content": _text_of(content, f"{param}.content")}]
    _need(content or (role == "assistant" and final) or not isinstance(content, (str, list)),
          param, EMPTY_CONTENT)  # "" as [] (Anthropic refuses both)
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    _need(isinstance(content, list), f"{param}.content",
          f"Input should be a string or an array of content blocks, not {_type_name(content)}.")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        p = f"{param}.content.{j}"
        _need(isinstance(b, dict), p, "Input should be a content block object.")
        check_cache_control(b, p)
        kind = b.get("type")
        if kind == "text":
            texts.append(_block_text(b, p))
        elif kind == "image":
            check_image(b, p)
        elif kind == "tool_use":
            _need(role == "assistant", p, "tool_use blocks belong to assistant messages.")
            _need(isinstance(b.get("id"), str), f"{p}.id", "Field required (a string).")
            _need(isinstance(b.get("name"), str), f"{p}.name", "Field required (a string).")
            _need(isinstance(b.get("input"), dict), f"{p}.input", "Field required (an object).")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": b["input"]}})
        elif kind == "tool_result":
            _need(role == "user", p, "tool_result blocks belong to user messages.")
            _need(isinstance(b.get("tool_use_id"), str), f"{p}.tool_use_id", "Field required (a string).")
            text = _tool_result_text(b.get("content"), f"{p}.content")
            if b.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "content": text, "tool_call_id": b["tool_use_id"]})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not replayed
        else:
            raise InvalidRequest(f"{p}.type", f"{p}.type: Unsupported content block type {kind!r}.")
    out = list(results)
    if texts or calls or not results:
        m: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            m["tool_calls"] = calls
        out.append(m)
    return out


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    _need(ok and (lo < v if lo_open else lo <= v) and v <= hi, name,
          f"Input should be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}].")
    return float(v)


def _tools(body: dict, req: MessagesRequest) -> None:
    tools = body.get("tools")
    if tools is not None:
        _need(isinstance(tools, list), "tools", "Input should be an array of tools.")
        for j, t in enumerate(tools):
            p = f"tools.{j}"
            _need(isinstance(t, dict), p, "Input should be an object.")
            _need(t.get("type") in (None, "custom"), f"{p}.type",
                  f"Tool type {t.get('type')!r} is not supported; only custom tools are.")
            name = t.get("name")
            _need(isinstance(name, str), f"{p}.name", "Field required (a string).")
            _need(TOOL_NAME.match(name), f"{p}.name",
                  f"String should match pattern '{TOOL_NAME.pattern}'.")
            _need(name not in req.tool_schemas, f"{p}.name", f"Tool names must be unique ({name!r}).")
            schema = t.get("input_schema")
            _need(isinstance(schema, dict), f"{p}.input_schema", "Field required (a JSON schema object).")
            _need(not too_deep(schema), f"{p}.input_schema", depth_message())
            desc = t.get("description")
            _need(desc is None or isinstance(desc, str), f"{p}.description", "Input should be a string.")
            strict = t.get("strict")
            _need(strict is None or isinstance(strict, bool), f"{p}.strict", "Input should be a boolean.")
            check_cache_control(t, p)
            fn = {"name": name, "parameters": schema}
            if desc:
                fn["description"] = desc
            req.tools.append({"type": "function", "function": fn})
            req.tool_schemas[name] = schema
    choice = body.get("tool_choice")
    if choice is None:
        return
    _need(isinstance(choice, dict) and choice.get("type") in TOOL_CHOICES, "tool_choice.type",
          f"Input should be one of {', '.join(TOOL_CHOICES)}.")
    req.tool_choice = choice["type"]
    dp = choice.get("disable_parallel_tool_use")
    _need(dp is None or isinstance(dp, bool), "tool_choice.disable_parallel_tool_use", "Input should be a boolean.")
    req.parallel_tool_use = not dp
    if req.tool_choice == "tool":
        _need(isinstance(choice.get("name"), str), "tool_choice.name", "Field required (a string).")
        _need(choice["name"] in req.tool_schemas, "tool_choice.name",
              f"Tool {choice['name']!r} is not in 'tools'.")
        req.tool_name = choice["name"]
    if req.tool_choice in ("any", "tool"):
        _need(bool(req.tool_schemas), "tool_choice", "tool_choice requires 'tools'.")


def _check_forced_schemas(req: MessagesRequest) -> None:
    """Compile each input_schema a forced answer (tool_choice any / tool) may use with
    xgrammar, as the OpenAI routes do (`openai_tools`): one the engine could not compile is
    a 400 naming `tools.<j>.input_schema`, not the engine's refusal. Off the event loop."""
    if req.tool_choice not in ("any", "tool"):
        return
    for j, (name, schema) in enumerate(req.tool_schemas.items()):
        if (req.tool_choice == "tool" and name != req.tool_name) or not schema:
            continue
        try:
            json_schema_constraint(schema, f"tools.{j}.input_schema")
        except InvalidRequest as e:
            raise InvalidRequest(e.param, f"{e.param}: {e.message}") from None


def parse_messages_request(raw: bytes, count_only: bool = False,
                           defaults: GenerationDefaults = NO_DEFAULTS) -> MessagesRequest:
    """Parse and validate a body (JSON bytes). count_only: the count_tokens route (no
    max_tokens, no sampling fields). defaults: the server's sampling defaults (see the
    module docstring). Raises InvalidRequest."""
    body = load_json(raw)
    if not isinstance(body, dict):
        raise InvalidRequest(None, "The request body must be a JSON object.")
    check_known_fields(body)
    check_cache_control(body, None)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model", "model: Field required (a string).")
    max_tokens = body.get("max_tokens")
    if not count_only:
        _need(max_tokens is not None, "max_tokens", "Field required.")
        _need(isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1,
              "max_tokens", "Input should be an integer greater than or equal to 1.")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest("messages", "messages: Field required (a non-empty array of "
                                         "messages).")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _text_of(system, "system")
        if text:
            messages.append({"role": "system", "content": text})
    for i, m in enumerate(msgs):
        messages += _message(i, m, final=i == len(msgs) - 1)
    if is_prefill(messages):  # Anthropic refuses a prefill's trailing whitespace
        text = messages[-1]["content"]
        _need(text == text.rstrip(), "messages", "final assistant content cannot end with trailing whitespace")
    req = MessagesRequest(model=model, messages=messages,
                          max_tokens=None if count_only else max_tokens)
    stops = body.get("stop_sequences")
    if stops is not None:
        _need(isinstance(stops, list) and all(isinstance(s, str) and s for s in stops),
              "stop_sequences", "Input should be an array of non-empty strings.")
        # capped as OpenAI's `stop` (each one is matched against every streamed chunk)
        _need(len(stops) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_CHARS for s in stops),
              "stop_sequences", f"At most {MAX_STOP_STRINGS} stop sequences of at most "
              f"{MAX_STOP_CHARS} characters each are allowed.")
        req.stop_sequences = list(dict.fromkeys(stops))
    if not count_only:
        d = defaults
        req.temperature = _number(body, "temperature",
                                  1.0 if d.temperature is None else d.temperature, 0.0, 1.0)
        req.top_p = _number(body, "top_p", 1.0 if d.top_p is None else d.top_p, 0.0, 1.0,
                            lo_open=True)
        top_k = body.get("top_k")
        _need(top_k is None or (isinstance(top_k, int) and not isinstance(top_k, bool)
                                and 0 <= top_k <= MAX_TOP_K),
              "top_k", f"Input should be an integer between 0 and {MAX_TOP_K}.")
        req.top_k = (d.top_k or 0) if top_k is None else top_k
        req.min_p = 0.0 if d.min_p is None else d.min_p
        req.repetition_penalty = 1.0 if d.repetition_penalty is None else d.repetition_penalty
        req.max_tokens_cap = d.max_tokens_cap
        stream = body.get("stream")
        stream = False if stream is None else stream
        _need(isinstance(stream, bool), "stream", "Input should be a boolean.")
        req.stream = stream
    meta = body.get("metadata")
    _need(meta is None or isinstance(meta, dict), "metadata", "Input should be an object.")
    _tools(body, req)
    if not count_only:
        _check_forced_schemas(req)
    req.thinking = parse_thinking(body.get("thinking"), None if count_only else max_tokens)
    req.output_format = parse_output_config(body)
    if req.output_format is not None:
        # The grammar holds from the first token: no room for a reasoning part, so the
        # template's thinking switch is off (on both routes: count_tokens agrees).
        req.thinking = Thinking()
    return req
