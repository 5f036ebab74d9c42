"""Validation of the tool-calling fields of an OpenAI chat request.

Follows the OpenAI API reference (Chat Completions):
- `tools`: [{"type": "function", "function": {"name", "description"?, "parameters"?,
  "strict"?}}]; names match `^[a-zA-Z0-9_-]{1,64}$` and are unique; parameters is a JSON
  schema object (default: any object).
- `tool_choice`: "none" | "auto" | "required" | {"type": "function", "function": {"name"}}
  naming one of `tools`. Default "auto" when tools are given, "none" otherwise.
- `parallel_tool_calls`: boolean, default true (with false, a forced answer has one call, and
  an unforced one passes on only its first: the output parser's max_calls).
- In `messages`: assistant `tool_calls` [{"id", "type": "function", "function": {"name",
  "arguments": JSON text}}] and role "tool" messages with `tool_call_id`.

`required` and a named choice are enforced with a JSON-schema constraint (`tool_choice.py`)
that the engine compiles; each schema such an answer may use is compiled here first
(xgrammar, off the event loop), so one it cannot compile is a 400 naming
`tools[j].function.parameters` before any SSE byte.
Every error is an `InvalidRequest` naming the field (`tools[0].function.name` style).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from services.frontend import strict_json
from services.frontend.errors import InvalidRequest
from services.frontend.openai_sampling import get_bool
from services.frontend.parsers.tool_choice import forced_call_constraint
from services.frontend.schema_limits import depth_message, too_deep
from services.frontend.strict_json import JSONTooDeep
from services.frontend.structured_fields import json_schema_constraint
from shared.protocol import StructuredSpec

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
TOOL_CHOICES = ("none", "auto", "required")


@dataclass
class ToolRequest:
    """The validated tool fields. tools: template-ready [{"type": "function", "function":
    {...}}]; schemas: name -> parameter schema; choice: "none" | "auto" | "required" |
    "named" (then `name` is set); parallel: parallel_tool_calls."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    choice: str = "none"
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """The answer must be a tool call (required or named)."""
        return self.choice in ("required", "named")

    @property
    def active(self) -> bool:
        """Tools are rendered into the prompt and calls are parsed from the output."""
        return bool(self.tools) and self.choice != "none"

    def constraint(self) -> StructuredSpec:
        """The engine's JSON-schema constraint of a forced answer, compiled by the engine
        (each tool's schema in it has been compiled by `parse_tools` already, off the event
        loop). A schema the engine still cannot compile fails the request with 400."""
        return forced_call_constraint(self.schemas, self.name, self.parallel)


def _tool(j: int, t: Any, req: ToolRequest) -> None:
    p = f"tools[{j}]"
    if not isinstance(t, dict):
        raise InvalidRequest(p, "Each tool must be an object.")
    if t.get("type", "function") != "function":
        raise InvalidRequest(f"{p}.type", "Only tools of type 'function' are supported.")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise InvalidRequest(f"{p}.function", "A tool needs a 'function' object.")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise InvalidRequest(f"{p}.function.name", "A function name must be 1-64 letters, "
                             "digits, underscores or dashes.")
    if name in req.schemas:
        raise InvalidRequest(f"{p}.function.name", f"Tool names must be unique ({name!r}).")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise InvalidRequest(f"{p}.function.description", "'description' must be a string.")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidRequest(f"{p}.function.parameters",
                             "'parameters' must be a JSON schema object.")
    if params is not None and too_deep(params):  # services/frontend/schema_limits.py
        raise InvalidRequest(f"{p}.function.parameters", depth_message(f"{p}.function.parameters"))
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise InvalidRequest(f"{p}.function.strict", "'strict' must be a boolean.")
    clean: dict[str, Any] = {"name": name}
    if desc:
        clean["description"] = desc
    clean["parameters"] = params if params is not None else {"type": "object",
                                                                "properties": {}}
    req.tools.append({"type": "function", "function": clean})
    req.schemas[name] = params or {}


def parse_tools(body: dict[str, Any]) -> ToolRequest:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body. Raises InvalidRequest
    for malformed tools, an unknown tool_choice, a named tool not in `tools`, or a forcing
    tool_choice without tools."""
    req = ToolRequest()
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequest("tools", "'tools' must be an array of tools.")
        for j, t in enumerate(tools):
            _tool(j, t, req)
    req.parallel = get_bool(body, "parallel_tool_calls", True)
    choice = body.get("tool_choice")
    if choice is None:
        req.choice = "auto" if req.tools else "none"
    elif isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise InvalidRequest("tool_choice", "'tool_choice' must be 'none', 'auto', "
                                 "'required' or {'type': 'function', 'function': {'name'}}.")
        req.choice = choice
    elif isinstance(choice, dict):
        if choice.get("type") != "function":
            raise InvalidRequest("tool_choice.type", "'tool_choice.type' must be 'function'.")
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise InvalidRequest("tool_choice.function.name",
                                 "A named tool_choice needs 'function': {'name': ...}.")
        if name not in req.schemas:
            raise InvalidRequest("tool_choice.function.name",
                                 f"Tool {name!r} is not one of 'tools'.")
        req.choice, req.name = "named", name
    else:
        raise InvalidRequest("tool_choice", "'tool_choice' must be a string or an object.")
    if req.forced and not req.tools:
        raise InvalidRequest("tool_choice", f"tool_choice '{choice}' requires 'tools'.")
    if req.forced:
        _check_forced_schemas(req)
    return req


def _check_forced_schemas(req: ToolRequest) -> None:
    """Compile the parameter schema of each tool a forced answer may call (the named one,
    or all for "required") with xgrammar, as response_format's schema is checked: a schema
    the engine could not compile is a 400 naming `tools[j].function.parameters` here, not
    the engine's refusal with no param. Compiles: call it off the event loop."""
    for j, tool in enumerate(req.tools):
        name = tool["function"]["name"]
        if req.choice == "named" and name != req.name:
            continue
        schema = req.schemas[name]
        if schema:
            json_schema_constraint(schema, f"tools[{j}].function.parameters")


def parse_tool_calls(param: str, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` -> template-ready [{"id", "type", "function":
    {"name", "arguments": object (or the text when it is JSON but not an object)}}].
    Integers of any size stay exact (Python's json). Raises InvalidRequest."""
    if not isinstance(calls, list):
        raise InvalidRequest(param, "'tool_calls' must be an array.")
    out = []
    for j, call in enumerate(calls):
        p = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise InvalidRequest(f"{p}.function", "A tool call needs a 'function' object.")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(f"{p}.function.name", "A tool call needs a function name.")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                value = strict_json.loads(args) if args.strip() else {}
            except JSONTooDeep as e:
                raise InvalidRequest(f"{p}.function.arguments", f"'arguments': {e}") from None
            except ValueError:
                raise InvalidRequest(f"{p}.function.arguments",
                                     "'arguments' must be JSON text.") from None
            args = value if isinstance(value, dict) else args
        elif not isinstance(args, dict):
            raise InvalidRequest(f"{p}.function.arguments", "'arguments' must be JSON text.")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidRequest(f"{p}.id", "'id' must be a string.")
        out.append({"id": call_id or f"call_{j}", "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out
