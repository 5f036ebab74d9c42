"""xgrammar's error messages, made fit for an API client.

xgrammar's C++ errors start with a log prefix: the time and its source location, e.g.
`[15:39:31] /project/cpp/json_schema_converter.cc:5082: Unsupported type "bogus"`. Both
the frontend (schema check) and the engine (grammar compile) report these to clients.
"""

from __future__ import annotations

import re

# "[hh:mm:ss] <path>:<line>: " at the start of a line (a path has no spaces).
_PREFIX = re.compile(r"^\s*(?:\[\d{1,2}:\d{2}:\d{2}\]\s*)?\S+\.(?:cc|cpp|h|hpp|py):\d+:\s*")


def grammar_error_text(e: BaseException | str, limit: int = 300) -> str:
    """The first non-empty line of an xgrammar error without its time and source prefix,
    cut to `limit` characters; the exception's type name when it has no message."""
    text = str(e)
    for line in text.splitlines():
        line = _PREFIX.sub("", line).strip()
        if line:
            return line[:limit]
    return type(e).__name__ if isinstance(e, BaseException) else "unknown error"
