"""The `input` and `instructions` of an OpenAI Responses request, as chat-template messages.

Follows the OpenAI API reference (Responses, `input`) and the openai SDK's
`ResponseInputItemParam` types. Accepted:
- `input` a string: one user message.
- `input` a list of items:
  - messages (`type` "message" or absent, with a `role`): roles user, system, developer
    (sent to the template as system) and assistant; `content` a string or a list of parts
    `input_text` / `output_text` / `text` ({"text"}) and `refusal` ({"refusal"}), joined
    with newlines (an empty list in a user message is a 400, code empty_array, as on chat). Images, files and audio are rejected (a text-only server).
  - `function_call` {"call_id", "name", "arguments": JSON text}: a call the model made,
    attached to the assistant turn before it (a new assistant turn if there is none).
  - `function_call_output` {"call_id", "output": a string or a list of `input_text`
    parts}: a tool message with that `tool_call_id`.
  - `reasoning` items (the model's earlier thinking): validated and left out of the prompt,
    as the reasoning templates drop earlier turns' thinking.
  Anything else (`item_reference`, built-in tool calls) is a 400 naming the item.
- `instructions` (a string): a system message before the input.

The messages have the shape `openai_protocol.parse_messages` gives the chat template:
{"role", "content": str, ("tool_calls": [{"id", "type": "function", "function": {"name",
"arguments": object or JSON text}}]), ("tool_call_id")}. Every error is an
`InvalidRequest` naming the field (`input[2].content[0].text` style).
"""

from __future__ import annotations

from typing import Any

from services.frontend import strict_json
from services.frontend.errors import InvalidRequest
from services.frontend.strict_json import JSONTooDeep

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")


def _text_parts(param: str, content: Any, what: str) -> str:
    """A string, or a list of text parts joined with newlines; raises InvalidRequest."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(param, f"{what} must be a string or a list of text parts.")
    texts = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"{p}.text", f"A {kind} part needs a string 'text'.")
        elif kind == "refusal":
            text = part.get("refusal")
            if not isinstance(text, str):
                raise InvalidRequest(f"{p}.refusal", "A refusal part needs a string 'refusal'.")
        elif kind in ("input_image", "input_file", "input_audio"):
            raise InvalidRequest(f"{p}.type", f"Content parts of type {kind!r} are not "
                                 "supported: this server serves a text-only model.")
        else:
            raise InvalidRequest(f"{p}.type", "A content part's type must be one of "
                                 f"{', '.join(TEXT_PARTS)} or refusal.")
        texts.append(text)
    return "\n".join(texts)


def _string(item: dict[str, Any], param: str, name: str) -> str:
    v = item.get(name)
    if not isinstance(v, str) or not v:
        raise InvalidRequest(f"{param}.{name}", f"'{name}' must be a non-empty string.")
    return v


def _function_call(param: str, item: dict[str, Any]) -> dict[str, Any]:
    """A `function_call` item -> a template-ready tool call (arguments parsed when they are
    a JSON object, kept as text when JSON of another kind)."""
    call_id, name = _string(item, param, "call_id"), _string(item, param, "name")
    args = item.get("arguments", "")
    if not isinstance(args, str):
        raise InvalidRequest(f"{param}.arguments", "'arguments' must be JSON text.")
    try:
        value = strict_json.loads(args) if args.strip() else {}
    except JSONTooDeep as e:
        raise InvalidRequest(f"{param}.arguments", f"'arguments': {e}") from None
    except ValueError:
        raise InvalidRequest(f"{param}.arguments", "'arguments' must be JSON text.") from None
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": value if isinstance(value, dict) else args}}


def _reasoning(param: str, item: dict[str, Any]) -> None:
    """Validate a `reasoning` item: `summary` and `content` lists of text parts."""
    for name in ("summary", "content"):
        parts = item.get(name)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(
                isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
            raise InvalidRequest(f"{param}.{name}",
                                 f"'{name}' must be a list of parts with a string 'text'.")


def _message(param: str, item: dict[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{param}.role", f"A message's role must be one of "
                             f"{', '.join(ROLES)}.")
    content = item.get("content")
    if content is None and role == "assistant":
        content = ""
    if content == [] and role == "user":  # as on the chat route (openai_protocol._content)
        raise InvalidRequest(f"{param}.content", f"Invalid '{param}.content': empty array. Expected "
                             "an array with minimum length 1, but got an empty array instead.",
                             code="empty_array")
    text = _text_parts(f"{param}.content", content, "A message's content")
    # OpenAI's "developer" role is the system role of newer models; templates know "system".
    return {"role": "system" if role == "developer" else role, "content": text}


def input_messages(value: Any, instructions: Any) -> list[dict[str, Any]]:
    """`input` and `instructions` -> chat-template messages (see the module docstring).
    Raises InvalidRequest for a missing or empty input, an item of an unsupported type or
    a malformed field."""
    out: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest("instructions", "'instructions' must be a string.")
        if instructions:
            out.append({"role": "system", "content": instructions})
    if value is None:
        raise InvalidRequest("input", "Missing required parameter: 'input'.")
    if isinstance(value, str):
        return out + [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("input", "'input' must be a string or a non-empty list of "
                             "input items.")
    for i, item in enumerate(value):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(p, "Each input item must be an object.")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message(p, item))
        elif kind == "function_call":
            call = _function_call(p, item)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, p, "call_id"),
                        "content": _text_parts(f"{p}.output", item.get("output"),
                                               "'output'")})
        elif kind == "reasoning":
            _reasoning(p, item)
        elif kind == "item_reference":
            raise InvalidRequest(f"{p}.type", "Item references are not supported: this "
                                 "server keeps no responses; send the items themselves.")
        else:
            raise InvalidRequest(f"{p}.type", "An input item's type must be message, "
                                 "function_call, function_call_output or reasoning.")
    return out
