"""Validation of OpenAI request bodies: Chat Completions and (legacy) Completions.

Follows the OpenAI API reference for the request bodies. Chat: model, messages (roles
system, developer (sent to the template as system), user, assistant (with `tool_calls`),
tool (with `tool_call_id`); content a string or a list of text parts, not an empty list in a
user message: OpenAI's 400 "empty array", code empty_array), logprobs,
top_logprobs (0-20, needs logprobs), chat_template_kwargs (an object; not the keys the
renderer sets itself, `chat_template.RESERVED`), vLLM's add_generation_prompt (default
true) and continue_final_message (default false; the prompt ends right after the final
assistant message's text, which the answer continues; not both true), tools / tool_choice /
parallel_tool_calls (`openai_tools`), and the shared sampling fields of `openai_sampling`
(n, seed, penalties, logit_bias, stop, response_format, stream, stream_options, vLLM's
top_k/min_p/min_tokens/...).
Completions: model, prompt (a string, a list of strings, a list of token ids or a list of
lists of token ids; not a list mixing these forms), echo, logprobs (0-5 per OpenAI, up to
20 here), suffix (rejected), best_of (must equal n), and the same sampling fields.

Unknown fields are ignored, as OpenAI-compatible servers do; known fields that Kestrel
cannot honour (the legacy `functions`) are rejected unless they hold their neutral value.
Every error is an `InvalidRequest` naming the field (`messages[2].content` style).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


from services.frontend.body import json_object
from services.frontend.chat_template import check_template_kwargs
from services.frontend.errors import InvalidRequest
from services.frontend.openai_sampling import (MAX_TOP_LOGPROBS, SamplingRequest, get_bool,
                                               get_int, is_int, parse_sampling)
from services.frontend.openai_tools import ToolRequest, parse_tool_calls, parse_tools
from shared.config_generation import NO_DEFAULTS, GenerationDefaults

ROLES = ("system", "developer", "user", "assistant", "tool")

# field -> neutral values (accepted and ignored); any other value is "not supported".
UNSUPPORTED_UNLESS_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
}


@dataclass
class ChatCompletionRequest:
    """A validated chat request. messages: as `parse_messages` returns them. sampling: the
    shared sampling fields (`structured` holds the forced-call constraint when tool_choice
    forces a call). logprobs: None, or the number of alternatives per output token
    (top_logprobs, 0 = the chosen token only). tools: the tool fields."""

    model: str
    messages: list[dict[str, Any]]
    sampling: SamplingRequest
    logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: ToolRequest = field(default_factory=ToolRequest)
    add_generation_prompt: bool = True      # vLLM's extensions: the template's flags
    continue_final_message: bool = False

    @property
    def thinking(self) -> bool:
        """chat_template_kwargs.enable_thinking (default true, as Qwen3's template)."""
        return self.chat_template_kwargs.get("enable_thinking", True) is not False

    @property
    def stream(self) -> bool:
        return self.sampling.stream


@dataclass
class CompletionRequest:
    """A validated completions request. prompts: one entry per prompt, each a string or a
    list of token ids. logprobs: None or the alternatives per token (completions format).
    echo: prepend the prompt (and its logprobs) to each choice."""

    model: str
    prompts: list[str | list[int]]
    sampling: SamplingRequest
    logprobs: int | None = None
    echo: bool = False

    @property
    def stream(self) -> bool:
        return self.sampling.stream


def _content(i: int, role: str, content: Any) -> str:
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        if not content and role == "user":  # OpenAI's schema: a user turn's parts, minItems 1
            raise InvalidRequest(param, f"Invalid '{param}': empty array. Expected an array with "
                                 "minimum length 1, but got an empty array instead.", code="empty_array")
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
    """Validate `messages` and normalize each to {"role", "content": str, ("name"),
    ("tool_calls": see openai_tools.parse_tool_calls), ("tool_call_id")}.
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
        if role == "assistant" and msg.get("tool_calls") is not None:
            norm["tool_calls"] = parse_tool_calls(f"messages[{i}].tool_calls",
                                                  msg["tool_calls"])
        if role == "tool":
            if not isinstance(msg.get("tool_call_id"), str):
                raise InvalidRequest(f"messages[{i}].tool_call_id",
                                     "A tool message needs a string 'tool_call_id'.")
            norm["tool_call_id"] = msg["tool_call_id"]
        out.append(norm)
    return out


def _load(raw: bytes) -> dict[str, Any]:
    body = json_object(raw)
    model = body.get("model")
    if model is None:
        raise InvalidRequest("model", "Missing required parameter: 'model'.")
    if not isinstance(model, str):
        raise InvalidRequest("model", "'model' must be a string.")
    return body


def parse_chat_request(raw: bytes, vocab_size: int,
                       defaults: GenerationDefaults = NO_DEFAULTS) -> ChatCompletionRequest:
    """Parse and validate a chat request body (JSON bytes).

    vocab_size: token ids (logit_bias, stop_token_ids) must be below it. defaults: the
    server's sampling defaults, for the fields the body does not set (parse_sampling).
    Raises InvalidRequest for invalid JSON, a body that is not an object, a missing model
    or messages, or any field of the wrong type or out of range (param names the field).
    """
    body = _load(raw)
    messages = parse_messages(body.get("messages"))
    for name, neutral in UNSUPPORTED_UNLESS_NEUTRAL.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v)
                                    for v in neutral):
            raise InvalidRequest(name, f"'{name}' is not supported by this server yet.")
    want_logprobs = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and top > 0 and not want_logprobs:
        raise InvalidRequest("top_logprobs", "'top_logprobs' requires 'logprobs' to be true.")
    kwargs = check_template_kwargs(body.get("chat_template_kwargs"))
    add_gen = get_bool(body, "add_generation_prompt", True)
    cont = get_bool(body, "continue_final_message", False)
    if add_gen and cont:  # vLLM's rule: one or the other
        raise InvalidRequest("continue_final_message", "'continue_final_message' and "
                             "'add_generation_prompt' cannot both be true.")
    tools = parse_tools(body)
    sampling = parse_sampling(body, vocab_size, defaults=defaults)
    if tools.forced:
        if sampling.structured is not None:
            field = sampling.structured_param or "response_format"
            raise InvalidRequest(field, f"'{field}' cannot be combined with tool_choice "
                                 f"'{tools.choice}'.")
        sampling.structured = tools.constraint()
    return ChatCompletionRequest(
        model=body["model"], messages=messages, sampling=sampling,
        logprobs=(top or 0) if want_logprobs else None,
        chat_template_kwargs=kwargs, tools=tools, add_generation_prompt=bool(add_gen),
        continue_final_message=bool(cont))


def _prompts(value: Any, vocab_size: int) -> list[str | list[int]]:
    """`prompt` in its four forms -> a list of prompts (strings or token-id lists).

    The forms are OpenAI's: a string, a list of strings, a list of token ids, a list of
    lists of token ids. A list mixing them (`["a", [1]]`, `["a", 1]`, `[[1], 2]`) is none of
    those, and an empty list (also an empty inner one: `[[]]`) holds no prompt: both raise
    InvalidRequest("prompt"), as do an empty string and a token id outside the vocabulary."""
    msg = ("'prompt' must be a string, a list of strings, a list of token ids or a list "
           "of lists of token ids, and not empty.")
    if value is None:
        raise InvalidRequest("prompt", "Missing required parameter: 'prompt'.")
    if isinstance(value, str):
        prompts: list[Any] = [value]
    elif not isinstance(value, list) or not value:
        raise InvalidRequest("prompt", msg)
    elif all(is_int(t) for t in value):
        prompts = [value]
    elif all(isinstance(p, str) for p in value) or all(
            isinstance(p, list) and p and all(is_int(t) for t in p) for p in value):
        prompts = value
    else:
        raise InvalidRequest("prompt", msg)
    for p in prompts:
        if isinstance(p, list):
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequest("prompt", f"Token id {bad[0]} is outside the vocabulary "
                                     f"({vocab_size} tokens).")
        elif not p:
            raise InvalidRequest("prompt", "A prompt must not be empty.")
    return prompts


def parse_completion_request(raw: bytes, vocab_size: int,
                             defaults: GenerationDefaults = NO_DEFAULTS) -> CompletionRequest:
    """Parse and validate a completions request body (JSON bytes), with the server's
    sampling `defaults` as for chat.

    Raises InvalidRequest as parse_chat_request does; also for `suffix` (not supported),
    `best_of` different from n, and max_tokens 0 without echo."""
    body = _load(raw)
    prompts = _prompts(body.get("prompt"), vocab_size)
    if body.get("suffix") not in (None, ""):
        raise InvalidRequest("suffix", "'suffix' is not supported by this server.")
    sampling = parse_sampling(body, vocab_size, min_max_tokens=0, defaults=defaults)
    best_of = get_int(body, "best_of", 1)
    if best_of is not None and best_of != sampling.n:
        raise InvalidRequest("best_of", "'best_of' must equal 'n' (or be left out).")
    echo = get_bool(body, "echo", False)
    if sampling.max_tokens == 0 and not echo:
        raise InvalidRequest("max_tokens", "'max_tokens' may be 0 only with 'echo'.")
    return CompletionRequest(
        model=body["model"], prompts=prompts, sampling=sampling,
        logprobs=get_int(body, "logprobs", 0, MAX_TOP_LOGPROBS), echo=echo)
