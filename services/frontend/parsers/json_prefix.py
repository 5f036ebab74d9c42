"""Incremental scanning of one JSON value (RFC 8259) as its text streams in.

Used by the tool-call parsers to stream a tool call's `arguments` verbatim (so integers of
any size stay exact) while knowing, after every character:
- whether the value is complete (and where it ended), and
- the longest prefix that can be closed into valid JSON by appending characters only
  (`closable`), with the characters that close it (`closing`).

Closable points: right after `{` or `[`, inside a string that is a value (not a key, not in
an escape), after a complete value, and after a number or literal that is valid as it
stands. Not closable: inside a key, after `:` or `,`, in the middle of `tru` or `1e`.
Malformed input sets `error` and stops the scan.
"""

from __future__ import annotations

import json

_WS = " \t\r\n"


class JsonPrefixScanner:
    """Feed text with `feed`; read `done`, `end`, `error`, `closable`, `closing`.

    end: offset (in all text fed so far) just past the value once `done`.
    closable: length of the longest closable prefix seen so far; closing: its suffix.
    """

    def __init__(self) -> None:
        self._stack: list[list[str]] = []  # [kind "o"|"a", state]
        self._in_str = self._key = self._esc = False
        self._uni = 0
        self._scalar = ""
        self._started = False
        self.done = self.error = False
        self.pos = self.end = 0
        self.closable = 0
        self.closing = ""

    # -- state helpers
    def _closers(self) -> str:
        return "".join("}" if k == "o" else "]" for k, _ in reversed(self._stack))

    def _closing_now(self) -> str | None:
        if self.done:
            return ""
        if self._in_str:
            if self._key or self._esc or self._uni:
                return None
            return '"' + self._closers()
        if self._scalar:
            try:
                json.loads(self._scalar)
            except ValueError:
                return None
            return self._closers()
        if not self._stack:
            return None
        kind, state = self._stack[-1]
        if (kind == "o" and state in ("key0", "after")) or (kind == "a" and state in ("value0", "after")):
            return self._closers()
        return None

    def _expects_value(self) -> bool:
        if not self._stack:
            return not self._started
        kind, state = self._stack[-1]
        return (kind == "o" and state == "value") or (kind == "a" and state in ("value0", "value"))

    def _value_done(self) -> None:
        if not self._stack:
            self.done = True
            self.end = self.pos + 1
        else:
            self._stack[-1][1] = "after"

    def _char(self, c: str) -> None:
        if self._in_str:
            if self._uni:
                self._uni -= 1
            elif self._esc:
                self._esc = False
                if c == "u":
                    self._uni = 4
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
                if self._key:
                    self._stack[-1][1] = "colon"
                else:
                    self._value_done()
            return
        if self._scalar:
            if c in _WS or c in ",}]":
                try:
                    json.loads(self._scalar)
                except ValueError:
                    self.error = True
                    return
                self._scalar = ""
                self.pos -= 1  # the scalar ended one character earlier
                self._value_done()
                self.pos += 1
                if self.done:
                    self.end = self.pos  # the delimiter is not part of the value
                    return
            else:
                self._scalar += c
                return
        if c in _WS:
            return
        top = self._stack[-1] if self._stack else None
        if c in "{[\"" and self._expects_value():
            self._started = True
            if c == "{":
                self._stack.append(["o", "key0"])
            elif c == "[":
                self._stack.append(["a", "value0"])
            else:
                self._in_str, self._key = True, False
        elif c == '"' and top and top[0] == "o" and top[1] in ("key0", "key"):
            self._in_str, self._key = True, True
        elif c == ":" and top and top == ["o", "colon"]:
            top[1] = "value"
        elif c == "," and top and top[1] == "after":
            top[1] = "key" if top[0] == "o" else "value"
        elif c == "}" and top and top[0] == "o" and top[1] in ("key0", "after"):
            self._stack.pop()
            self._value_done()
        elif c == "]" and top and top[0] == "a" and top[1] in ("value0", "after"):
            self._stack.pop()
            self._value_done()
        elif self._expects_value() and (c == "-" or c.isdigit() or c in "tfn"):
            self._started = True
            self._scalar = c
        else:
            self.error = True

    def feed(self, text: str) -> None:
        """Scan more text; stops at the end of the value or at the first malformed char."""
        for c in text:
            if self.done or self.error:
                return
            self._char(c)
            if self.error:
                return
            if not self.done:
                self.pos += 1
            closing = self._closing_now()
            if closing is not None:
                self.closable = self.end if self.done else self.pos
                self.closing = closing

    def finish(self) -> None:
        """The text ended: a top-level number or literal at the very end is complete."""
        if not self.done and not self.error and not self._stack and self._scalar:
            try:
                json.loads(self._scalar)
                self.done, self.end = True, self.pos
                self.closable, self.closing = self.pos, ""
            except ValueError:
                self.error = True
