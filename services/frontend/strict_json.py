"""Request bodies parsed as strictly as RFC 8259 asks, with integers of any size exact.

The Anthropic routes parse with Python's json module (a tool input's big integers stay
exact, where orjson would refuse them) but as strictly as the OpenAI routes' orjson: not
UTF-8, NaN / Infinity tokens, a number too large for a double (`1e400`, which Python's json
reads as infinity), too deep nesting, or a lone surrogate in any string (a `\\ud800`
escape) is a 400 "not valid JSON" (`load_json`); a body nested past the parser's
recursion limit is a 400 "nested too deeply".

`loads` is the one parse of JSON text that a client (or the model) supplies inside a body:
tool-call `arguments` of chat messages and Responses items, a tool_use block's input. Python's
json recurses once per level, so text like `[[[...]]]` 1000 deep raised RecursionError (a 500)
where it was called bare; `loads` raises `JSONTooDeep` (a ValueError) instead, and also for a
document nested more than MAX_TEXT_DEPTH levels, which later steps (the chat template's
`tojson`, orjson's dumps at about 255 levels) could not handle.
"""

from __future__ import annotations

import json
import re
from typing import Any

from services.frontend.errors import InvalidRequest
from services.frontend.schema_limits import too_deep

_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_TEXT_DEPTH = 128  # levels of objects and arrays in `loads`; orjson dumps at most ~255
BODY_TOO_DEEP = "The request body is nested too deeply."


class JSONTooDeep(ValueError):
    """JSON text nested more deeply than `loads` accepts (a ValueError, so callers that
    treat bad JSON text as a client's mistake treat this one the same)."""


def loads(text: str | bytes, max_depth: int = MAX_TEXT_DEPTH, **kw: Any) -> Any:
    """`json.loads(text, **kw)` (integers of any size exact) that never raises
    RecursionError: text nested past the interpreter's recursion limit, or a value nested
    more than `max_depth` levels of objects and arrays, raises JSONTooDeep. Other bad text
    raises ValueError (json.JSONDecodeError, UnicodeDecodeError) as json.loads does."""
    try:
        value = json.loads(text, **kw)
    except RecursionError:
        raise JSONTooDeep("The JSON text is nested too deeply.") from None
    if isinstance(value, (dict, list)) and too_deep(value, max_depth):
        raise JSONTooDeep(f"The JSON text is nested more than {max_depth} levels deep.")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    """A JSON number with a fraction or exponent as a float; one past a double's range
    (`1e400`: infinity) is refused, as orjson refuses it on the OpenAI routes."""
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is out of a double's range")
    return value


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
    """The body as JSON (RFC 8259): UTF-8, no NaN / Infinity (nor numbers past a double's
    range), every string valid Unicode
    (no lone surrogates, escaped or not), as the OpenAI routes' parser (orjson) requires.
    Python's json module is used so that integers of any size stay exact. Raises
    InvalidRequest (400)."""
    try:
        text = raw.decode("utf-8")  # strict: UTF-8-encoded surrogates are rejected here
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise InvalidRequest(None, BODY_TOO_DEEP) from None
    except ValueError:  # UnicodeDecodeError is a ValueError
        raise InvalidRequest(None, "The request body is not valid JSON.") from None
    if "\\u" in text:  # only an escape can still produce a lone surrogate
        where = _first_lone_surrogate(body)
        if where is not None:
            raise InvalidRequest(where, f"The request body is not valid JSON: {where} holds a "
                                 "lone surrogate (strings must be valid Unicode).")
    return body
