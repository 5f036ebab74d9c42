"""Request bodies parsed as strictly as RFC 8259 asks, with integers of any size exact.

The Anthropic routes parse with Python's json module (a tool input's big integers stay
exact, where orjson would refuse them) but as strictly as the OpenAI routes' orjson: not
UTF-8, NaN / Infinity tokens, too deep nesting, or a lone surrogate in any string (a
`\\ud800` escape) is a 400 "not valid JSON" (`load_json`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from services.frontend.errors import InvalidRequest

_SURROGATE = re.compile("[\ud800-\udfff]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _first_lone_surrogate(doc: Any) -> str | None:
    """The dotted path of a string (object key or value) of `doc` that holds a lone
    surrogate, or None. Iterative: the depth of `doc` is bounded by json's recursion only."""
    todo: list[tuple[str, Any]] = [("", doc)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return path or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                if _SURROGATE.search(k):  # the path names it escaped (it is quoted back)
                    k = k.encode("utf-8", "backslashreplace").decode("utf-8")
                    return f"{path}.{k}" if path else k
                p = f"{path}.{k}" if path else k
                todo.append((p, x))
        elif isinstance(v, list):
            todo.extend((f"{path}.{i}" if path else str(i), x) for i, x in enumerate(v))
    return None


def load_json(raw: bytes) -> Any:
    """The body as JSON (RFC 8259): UTF-8, no NaN / Infinity, every string valid Unicode
    (no lone surrogates, escaped or not), as the OpenAI routes' parser (orjson) requires.
    Python's json module is used so that integers of any size stay exact. Raises
    InvalidRequest (400)."""
    try:
        text = raw.decode("utf-8")  # strict: UTF-8-encoded surrogates are rejected here
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise InvalidRequest(None, "The request body is not valid JSON.") from None
    if "\\u" in text:  # only an escape can still produce a lone surrogate
        where = _first_lone_surrogate(body)
        if where is not None:
            raise InvalidRequest(where, f"The request body is not valid JSON: {where} holds a "
                                 "lone surrogate (strings must be valid Unicode).")
    return body
