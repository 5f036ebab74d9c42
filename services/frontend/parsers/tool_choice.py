"""Forcing a tool call with structured output (OpenAI tool_choice "required" or a named
function, Anthropic "any" or "tool").

The constraint is a JSON schema (StructuredSpec kind "json_schema", enforced by the engine
with xgrammar) for an array of calls, each `{"name": <one of the allowed names>, "arguments":
<that tool's parameter schema>}`, at least one. A named choice (OpenAI `{"type": "function",
"function": {"name"}}`, Anthropic `{"type": "tool", "name"}`) allows only that tool's name and
exactly one call, as OpenAI's and Anthropic's references describe it (the model "must call that
tool", once); "required" / "any" allow several unless parallel calls are off. The schema is
compiled without free whitespace (services/engine/structured.py), so once the array's `]` is
written the grammar allows only a stop token: the request ends with "stop" (finish_reason
"tool_calls" / stop_reason "tool_use"), never by running on to max_tokens. The output is then
parsed with the `forced` tool parser, whatever --tool-call-parser says, so it works with any
model and any template.
"""

from __future__ import annotations

import json
from typing import Any

from shared.protocol import StructuredSpec


def forced_call_schema(tools: dict[str, dict[str, Any]], only: str | None = None,
                       parallel: bool = True) -> dict[str, Any]:
    """The JSON schema of a forced answer. tools: name -> parameter schema; only: the one
    allowed tool (must be in tools; then exactly one call); parallel: allow more than one
    call when `only` is None."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]},
                             "arguments": params or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, params in tools.items() if only is None or name == only]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel or only is not None:
        schema["maxItems"] = 1
    return schema


def forced_call_constraint(tools: dict[str, dict[str, Any]], only: str | None = None,
                           parallel: bool = True) -> StructuredSpec:
    """`forced_call_schema` as the engine's StructuredSpec."""
    return StructuredSpec("json_schema", json.dumps(forced_call_schema(tools, only, parallel)))
