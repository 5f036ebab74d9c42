"""Validation of an OpenAI Responses request body (POST /v1/responses).

Follows the OpenAI API reference (Responses, create) and the openai SDK's
`response_create_params`. Fields:
- `model` (required), `input` and `instructions` (responses_input.py);
- `max_output_tokens` (>= 1; default: the server's default max_tokens, else the rest of
  the context), `temperature` [0, 2], `top_p` (0, 1], and vLLM's extensions `top_k`,
  `min_p`, `repetition_penalty`, `seed` (openai_sampling's ranges; the server's sampling
  defaults where absent);
- `tools`: function tools in the Responses' flat shape {"type": "function", "name",
  "description"?, "parameters"?, "strict"?}; other tool types are a 400. `tool_choice`:
  "auto" | "none" | "required" | {"type": "function", "name"}; `parallel_tool_calls`.
  Checked by openai_tools (the chat route's rules), with the error's field named in the
  Responses' shape (`tools[0].name`, `tool_choice.name`);
- `text.format`: {"type": "text"} | {"type": "json_object"} | {"type": "json_schema",
  "name", "schema", "strict"?}, the grammar constraint of chat's `response_format`; when
  tool_choice forces a call, the call's constraint applies instead (the answer has no text);
- `reasoning.effort`: "none" turns the template's thinking off (enable_thinking false);
  other efforts and `reasoning.summary` are accepted and change nothing;
- `stream`; `stream_options` (an object; its boolean `include_obfuscation` is accepted and
  changes nothing); `store` (accepted, treated as false: nothing is kept); `metadata` (echoed).
Not supported (a 400 naming the field, unless the value is neutral): `previous_response_id`,
`conversation`, `prompt` and `background: true` (they need stored state), `top_logprobs`
above 0 and `include: ["message.output_text.logprobs"]`. Other fields (`include`, `user`,
`truncation`, `service_tier`, `prompt_cache_key`, ...) are accepted and ignored, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


from services.frontend.body import json_object
from services.frontend.errors import InvalidRequest
from services.frontend.openai_sampling import SamplingRequest, get_bool, get_int, parse_sampling
from services.frontend.structured_fields import parse_response_format
from services.frontend.openai_tools import TOOL_CHOICES, ToolRequest, parse_tools
from services.frontend.responses_input import input_messages
from shared.config_generation import NO_DEFAULTS, GenerationDefaults

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
STATEFUL = ("previous_response_id", "conversation", "prompt")


@dataclass
class ResponsesRequest:
    """A validated Responses request. messages: chat-template messages (instructions
    first). sampling: the engine's sampling fields (`structured` holds text.format's
    constraint or a forced call's). tools: the tool fields. thinking: the template's
    enable_thinking. echo: the request fields the response object repeats (instructions,
    max_output_tokens, metadata, parallel_tool_calls, reasoning, temperature, text,
    tool_choice, tools, top_p, truncation, user), in the Responses' shapes."""

    model: str
    messages: list[dict[str, Any]]
    sampling: SamplingRequest
    tools: ToolRequest
    thinking: bool = True
    echo: dict[str, Any] = field(default_factory=dict)

    @property
    def stream(self) -> bool:
        return self.sampling.stream


def _load(raw: bytes) -> dict[str, Any]:
    body = json_object(raw)
    if body.get("model") is None:
        raise InvalidRequest("model", "Missing required parameter: 'model'.")
    if not isinstance(body["model"], str):
        raise InvalidRequest("model", "'model' must be a string.")
    return body


def _unsupported(body: dict[str, Any]) -> None:
    """400 for the fields this server cannot honour (see the module docstring)."""
    for name in STATEFUL:
        if body.get(name) is not None:
            raise InvalidRequest(name, f"'{name}' is not supported: this server keeps no "
                                 "responses or conversations (store is treated as false); "
                                 "send the whole conversation in 'input'.")
    stream_options = body.get("stream_options")
    if stream_options is not None:  # {include_obfuscation}: accepted, nothing to obfuscate here
        if not isinstance(stream_options, dict):
            raise InvalidRequest("stream_options", "'stream_options' must be an object.")
        get_bool(stream_options, "include_obfuscation", False, "stream_options.include_obfuscation")
    if get_bool(body, "background", False):
        raise InvalidRequest("background", "'background' responses are not supported.")
    get_bool(body, "store", False)
    if get_int(body, "top_logprobs", 0, 20):
        raise InvalidRequest("top_logprobs", "'top_logprobs' is not supported on "
                             "/v1/responses yet.")
    include = body.get("include")
    if include is not None and (not isinstance(include, list)
                                or not all(isinstance(s, str) for s in include)):
        raise InvalidRequest("include", "'include' must be a list of strings.")
    if include and "message.output_text.logprobs" in include:
        raise InvalidRequest("include", "'message.output_text.logprobs' is not supported on "
                             "/v1/responses yet.")


def _responses_param(param: str | None) -> str | None:
    """A chat-shaped tool field name (`tools[0].function.name`) in the Responses' flat
    shape (`tools[0].name`)."""
    return param.replace(".function.", ".").replace(".function", "") if param else param


def _tools(body: dict[str, Any]) -> tuple[ToolRequest, list[dict[str, Any]], Any]:
    """(the tool fields, the tools echoed in the Responses' shape, tool_choice echoed)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequest("tools", "'tools' must be an array of tools.")
    chat_tools: list[Any] = []
    for j, t in enumerate(tools or []):
        if not isinstance(t, dict):
            raise InvalidRequest(f"tools[{j}]", "Each tool must be an object.")
        if t.get("type") != "function":
            raise InvalidRequest(f"tools[{j}].type", "Only tools of type 'function' are "
                                 "supported by this server.")
        chat_tools.append({"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}})
    chat_choice = choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise InvalidRequest("tool_choice.name", "A function tool_choice needs a "
                                 "string 'name'.")
        chat_choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None and choice not in TOOL_CHOICES:
        raise InvalidRequest("tool_choice", "'tool_choice' must be 'none', 'auto', "
                             "'required' or {'type': 'function', 'name': ...}.")
    try:
        req = parse_tools({"tools": chat_tools, "tool_choice": chat_choice,
                           "parallel_tool_calls": body.get("parallel_tool_calls")})
    except InvalidRequest as e:
        raise InvalidRequest(_responses_param(e.param), e.message) from None
    echoed = [{"type": "function", "name": t["function"]["name"],
               "description": t["function"].get("description"),
               "parameters": t["function"]["parameters"],
               "strict": tools[j].get("strict") if tools else None}
              for j, t in enumerate(req.tools)]
    if choice is None:
        choice = "auto" if req.tools else "none"
    return req, echoed, choice


def _text_format(body: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(the grammar constraint of text.format or None, `text` echoed)."""
    text = body.get("text")
    if text is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise InvalidRequest("text", "'text' must be an object.")
    fmt = text.get("format")
    if fmt is None:
        return None, {**text, "format": {"type": "text"}}
    if not isinstance(fmt, dict):
        raise InvalidRequest("text.format", "'text.format' must be an object.")
    chat_format: dict[str, Any] = {"type": fmt.get("type")}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise InvalidRequest("text.format.name", "A json_schema format needs a 'name'.")
        if "schema" not in fmt:
            raise InvalidRequest("text.format.schema", "A json_schema format needs a "
                                 "'schema'.")
        chat_format["json_schema"] = {"name": fmt["name"], "schema": fmt["schema"]}
    try:
        spec = parse_response_format(chat_format)
    except InvalidRequest as e:
        param = (e.param or "").replace("response_format.json_schema", "text.format")
        raise InvalidRequest(param.replace("response_format", "text.format"),
                             e.message.replace("response_format.json_schema", "text.format")
                             .replace("response_format", "text.format")) from None
    return spec, text


def _reasoning(body: dict[str, Any]) -> tuple[bool, Any]:
    """(enable_thinking, `reasoning` echoed)."""
    r = body.get("reasoning")
    if r is None:
        return True, None
    if not isinstance(r, dict):
        raise InvalidRequest("reasoning", "'reasoning' must be an object.")
    effort = r.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise InvalidRequest("reasoning.effort", "'reasoning.effort' must be one of "
                             f"{', '.join(EFFORTS)}.")
    return effort != "none", {"effort": effort, "summary": r.get("summary")}


def parse_responses_request(raw: bytes, vocab_size: int,
                            defaults: GenerationDefaults = NO_DEFAULTS) -> ResponsesRequest:
    """Parse and validate a Responses request body (JSON bytes); see the module docstring.
    vocab_size: the tokenizer's (sampling fields naming token ids). defaults: the server's
    sampling defaults, for the fields the body does not set (parse_sampling). Raises
    InvalidRequest naming the first bad field."""
    body = _load(raw)
    _unsupported(body)
    messages = input_messages(body.get("input"), body.get("instructions"))
    max_output = get_int(body, "max_output_tokens", 1)
    sub = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    sampling = parse_sampling({**sub, "max_tokens": max_output,
                               "stream": get_bool(body, "stream", False)}, vocab_size,
                              defaults=defaults)
    tools, tools_echo, choice_echo = _tools(body)
    structured, text_echo = _text_format(body)
    # A forced call writes no text: its constraint wins over text.format (openai-agents
    # sends both when an agent with an output type must call a tool).
    sampling.structured = tools.constraint() if tools.forced else structured
    thinking, reasoning_echo = _reasoning(body)
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(v, str) for v in metadata.values())):
        raise InvalidRequest("metadata", "'metadata' must be an object of strings.")
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise InvalidRequest("truncation", "'truncation' must be 'auto' or 'disabled'.")
    echo = {"instructions": body.get("instructions"), "max_output_tokens": max_output,
            "metadata": metadata or {}, "parallel_tool_calls": tools.parallel,
            "reasoning": reasoning_echo, "temperature": sampling.temperature,
            "text": text_echo, "tool_choice": choice_echo, "tools": tools_echo,
            "top_p": sampling.top_p, "truncation": truncation or "disabled",
            "user": body.get("user") if isinstance(body.get("user"), str) else None}
    return ResponsesRequest(model=body["model"], messages=messages, sampling=sampling,
                            tools=tools, thinking=thinking, echo=echo)
