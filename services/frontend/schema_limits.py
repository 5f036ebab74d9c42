"""The nesting limit of the JSON schemas a request brings (response_format, Anthropic's
output_config.format, tool parameter schemas).

A schema is compiled by xgrammar in the engine (a forced tool call's, a response format's);
a deeply nested one takes seconds to tens of seconds there (a 300-level array schema: 18 s
on the 2-core VM, with other requests waiting), and orjson cannot serialize past about 255
levels at all. No real schema comes near: OpenAI's structured outputs allow 10 levels of
nesting. So a schema with more than MAX_SCHEMA_DEPTH levels of objects and arrays is refused
with a 400 before it reaches the engine (docs/ARCHITECTURE.md §7).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

MAX_SCHEMA_DEPTH = 64  # levels of JSON objects and arrays, the outermost counted


def too_deep(value: Any, limit: int = MAX_SCHEMA_DEPTH) -> bool:
    """Whether `value` (parsed JSON: dicts, lists, scalars) nests more than `limit` levels
    of dicts and lists. Iterative (no recursion limit), and it stops at the first path past
    the limit."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children: Iterable[Any]
        if isinstance(v, dict):
            children = v.values()
        elif isinstance(v, list):
            children = v
        else:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def depth_message(param: str | None = None) -> str:
    """The 400's message for a schema past the limit (at `param`, when the message names it)."""
    what = f"'{param}' is" if param else "The schema is"
    return f"{what} nested too deeply (more than {MAX_SCHEMA_DEPTH} levels of objects and arrays)."
