"""Tool-call parsers: a model's raw text in, content and tool-call events out, streaming.

Formats:
- `hermes`: each call is JSON inside tags, `<tool_call>{"name": N, "arguments": {...}}</tool_call>`
  (the Hermes / Qwen2.5 / Qwen3 function-calling format). The arguments text is passed on
  verbatim, so integers of any size stay exact.
- `qwen3_coder`: `<tool_call><function=N><parameter=P>value</parameter>...</function></tool_call>`
  (Qwen3-Coder's XML format). Each value is converted by the tool's JSON schema (integer,
  number, boolean, object, array, string); integers are written as their digits, never
  through a float. A `</parameter>` counts as the end of a value only when the next tag
  (`<parameter=`, `</function>` or `</tool_call>`) follows, so values may contain tags.
- `forced` (not a CLI choice): the whole output is a JSON array of `{"name", "arguments"}`
  objects, produced under a JSON-schema constraint when `tool_choice` forces a call
  (see `tool_choice.py`).

Every parser has `feed(text) -> events` and `finish() -> events`. Events: `Content(text)`,
`ToolCallStart(index, name)`, `ToolCallArgs(index, text)`. For each index the `ToolCallArgs`
texts concatenate to one JSON value; a call cut off by the end of the output (max_tokens)
is closed at its longest closable prefix (partial-json-parser completes the rest where it
can). A hermes / forced call cut before its arguments began is still a call once its name
is complete, with the arguments partial-json-parser reads from the cut body (`{}` if none);
a call whose name was cut is dropped. A call the output ended in (max_tokens, EOS, a stop
string) is followed by a `ToolCallCut` event. A hermes body that is malformed before a call began
(or a complete JSON value that names no call) is content, `<tool_call>` and all, up to its
first malformed character; the text after it is parsed again. Whitespace-only content
between or after calls is dropped. Feeding the text in any split gives the same events, concatenated, as feeding it
whole.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import partial_json_parser
from partial_json_parser import Allow

from services.frontend import strict_json
from services.frontend.parsers.json_prefix import JsonPrefixScanner

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class Content:
    text: str


@dataclass
class ToolCallStart:
    index: int
    name: str


@dataclass
class ToolCallArgs:
    index: int
    text: str


@dataclass
class ToolCallCut:
    """Call `index` did not end by itself: the output ended (EOS, a stop string, max_tokens)
    inside it, and its arguments were closed at their longest closable prefix. Its API
    then does not report the answer as a finished tool call (finish_reason "tool_calls",
    stop_reason "tool_use")."""

    index: int


Event = Content | ToolCallStart | ToolCallArgs | ToolCallCut


def partial_prefix_len(buf: str, tag: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if tag.startswith(buf[-k:]):
            return k
    return 0


def close_partial_json(emitted: str, seen: str, scanner: JsonPrefixScanner) -> str:
    """The text to append to `emitted` (a closable prefix of `seen`) so that it becomes valid
    JSON, using as much of `seen` as partial-json-parser can complete."""
    try:
        completed = partial_json_parser.ensure_json(seen)
        if completed.startswith(emitted):
            json.loads(completed)
            return completed[len(emitted):]
    except Exception:  # the library raises several types on text it cannot complete
        pass
    return scanner.closing


class ToolParser:
    """Base: content handling (whitespace-only tails held back), call numbering, and the
    text around `<tool_call>...</tool_call>` (for the tagged formats).
    tools: function name -> its JSON schema for the parameters ({} if none)."""

    def __init__(self, tools: dict[str, dict[str, Any]] | None = None):
        self.tools = tools or {}
        self.num_calls = 0
        self._pending_ws = ""
        self._buf = ""  # text fed and not yet consumed

    def _text_until_call(self, out: list[Event]) -> bool:
        """Content up to `<tool_call>` in _buf: emit it and consume the tag (True), or emit
        all but a possible start of the tag, which stays in _buf (False: feed more)."""
        i = self._buf.find(TOOL_CALL_OPEN)
        if i < 0:
            keep = partial_prefix_len(self._buf, TOOL_CALL_OPEN)
            self._content(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._content(self._buf[:i], out)
        self._buf = self._buf[i + len(TOOL_CALL_OPEN):]
        return True

    def _skip_call_close(self) -> bool:
        """After a call: consume whitespace and `</tool_call>` from _buf. True when the
        text goes on (tag consumed, or missing: go on with text), False: feed more."""
        s = self._buf.lstrip()
        if s.startswith(TOOL_CALL_CLOSE):
            self._buf = s[len(TOOL_CALL_CLOSE):]
        elif TOOL_CALL_CLOSE.startswith(s):
            return False
        return True

    def _content(self, text: str, out: list[Event]) -> None:
        text = self._pending_ws + text
        stripped = text.rstrip()
        self._pending_ws = text[len(stripped):]
        if stripped:
            out.append(Content(stripped))

    def _start_call(self, name: str, out: list[Event]) -> int:
        self._pending_ws = ""
        index = self.num_calls
        self.num_calls += 1
        out.append(ToolCallStart(index, name))
        return index

    def _finish_content(self, out: list[Event]) -> None:
        if self._pending_ws and self.num_calls == 0:
            out.append(Content(self._pending_ws))
        self._pending_ws = ""

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError


class _CallBody:
    """One `{"name": N, "arguments": {...}}` object, streamed: the start event once the name
    is known, then the arguments text as it becomes closable."""

    HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""  # the body so far
        self.body = JsonPrefixScanner()
        self.args: JsonPrefixScanner | None = None
        self.args_at = 0  # offset of the arguments in text
        self.emitted = 0  # arguments characters sent
        self.index = -1

    @property
    def done(self) -> bool:
        return self.body.done or self.body.error

    def feed(self, text: str, out: list[Event]) -> str:
        """Consume text; return what follows the body once it is complete ('' before)."""
        start = len(self.text)
        self.body.feed(text)
        # a malformed body ends before its first malformed character, which is text again
        used = (self.body.end if self.body.done else
                self.body.pos if self.body.error else start + len(text)) - start
        self.text += text[:used]
        if self.args is None:
            m = self.HEAD.match(self.text)
            if m and m.end() < len(self.text):  # the value has begun: its offset is final
                self.index = self.parser._start_call(json.loads(f'"{m.group(1)}"'), out)
                self.args, self.args_at = JsonPrefixScanner(), m.end()
                self.args.feed(self.text[m.end():])
        else:
            self.args.feed(text[:used])
        if self.args is not None:
            self._emit_args(out)
        if self.body.done and self.args is None:
            self._fallback(out)
        return text[used:] if self.done else ""

    def _emit_args(self, out: list[Event]) -> None:
        assert self.args is not None  # called once the arguments began
        upto = self.args.closable
        if upto > self.emitted:
            out.append(ToolCallArgs(self.index, self.text[self.args_at + self.emitted:self.args_at + upto]))
            self.emitted = upto

    def _whole_call(self, name: Any, args: Any, out: list[Event]) -> None:
        """Start and end a call in one go, from a parsed body; no call unless name is a
        string."""
        if isinstance(name, str):
            self.index = self.parser._start_call(name, out)
            out.append(ToolCallArgs(self.index, json.dumps(args, ensure_ascii=False)))

    def _fallback(self, out: list[Event]) -> None:
        """A complete body whose keys were not in the usual order."""
        try:
            obj = strict_json.loads(self.text)
        except ValueError:  # JSONTooDeep included
            return
        if isinstance(obj, dict):
            self._whole_call(obj.get("name"), obj.get("arguments", obj.get("parameters", {})),
                             out)

    def _cut_before_args(self, out: list[Event]) -> None:
        """End of output before the arguments value began (or in a body whose keys are in
        another order): a call once the name is complete, its arguments what
        partial-json-parser reads from the body (an object, else {}). A cut name is not a
        name: the partial string is left out of the parse that reads it."""
        try:
            named = partial_json_parser.loads(self.text, Allow.ALL & ~Allow.STR)
            obj = partial_json_parser.loads(self.text)
        except Exception:  # the library raises several types on text it cannot complete
            return
        if isinstance(named, dict) and isinstance(obj, dict):
            args = obj.get("arguments", obj.get("parameters"))
            self._whole_call(named.get("name"), args if isinstance(args, dict) else {}, out)

    def cut(self, out: list[Event]) -> None:
        """End of output (max_tokens) inside the body: finish the call it began."""
        if self.args is None:
            self._cut_before_args(out)
        else:
            self.close(out)

    def close(self, out: list[Event]) -> None:
        """End of the body's text (cut, or malformed after the arguments began): close the
        arguments JSON."""
        if self.args is None or self.args.done:
            return
        self.args.finish()
        self._emit_args(out)
        if not self.args.done:
            emitted = self.text[self.args_at:self.args_at + self.emitted]
            seen = self.text[self.args_at:]
            if self.emitted == 0:
                out.append(ToolCallArgs(self.index, "{}"))
            else:
                out.append(ToolCallArgs(self.index, close_partial_json(emitted, seen, self.args)))


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>` (see the module docstring)."""

    def __init__(self, tools: dict[str, dict[str, Any]] | None = None):
        super().__init__(tools)
        self._state = "text"  # text | body | close
        self._body: _CallBody | None = None

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._buf += text
        while self._buf:
            if self._state == "text":
                if not self._text_until_call(out):
                    break
                self._state, self._body = "body", _CallBody(self)
            elif self._state == "body":
                body = self._body
                assert body is not None  # set with the "body" state
                self._buf = body.feed(self._buf, out)
                if not body.done:
                    break
                if body.index < 0:  # no call came of it: the text is content, tag and all
                    self._content(TOOL_CALL_OPEN + body.text, out)
                    self._state = "text"
                elif body.body.error:
                    body.close(out)
                    self._state = "text"
                else:
                    self._state = "close"
            elif self._skip_call_close():  # after a body: whitespace, then </tool_call>
                self._state = "text"
            else:
                break
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._state == "text":
            self._content(self._buf, out)
        elif self._state == "body":
            assert self._body is not None  # set with the "body" state
            self._body.cut(out)
            if self._body.index >= 0:
                out.append(ToolCallCut(self._body.index))
        self._buf = ""
        self._finish_content(out)
        return out


class ForcedToolParser(ToolParser):
    """The output of a forced tool choice: `[{"name": ..., "arguments": ...}, ...]`."""

    def __init__(self, tools: dict[str, dict[str, Any]] | None = None):
        super().__init__(tools)
        self._state = "open"  # open | body | sep | end
        self._body: _CallBody | None = None

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._buf += text
        while self._buf and self._state != "end":
            if self._state in ("open", "sep"):
                s = self._buf.lstrip()
                if not s:
                    self._buf = ""
                    break
                if (self._state == "open" and s[0] == "[") or (self._state == "sep" and s[0] == ","):
                    self._buf, self._state, self._body = s[1:], "body", _CallBody(self)
                else:
                    self._state = "end"  # "]" or anything else ends the list
            else:
                body = self._body
                assert body is not None  # set with the "body" state
                self._buf = body.feed(self._buf, out)
                if not body.done:
                    break
                self._state = "end" if body.body.error else "sep"
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._state == "body":
            assert self._body is not None  # set with the "body" state
            self._body.cut(out)
            if self._body.index >= 0:
                out.append(ToolCallCut(self._body.index))
        return out


def _param_json(raw: str, schema: dict[str, Any], partial: bool = False) -> str | None:
    """A qwen3_coder parameter value (text) as JSON text, by its JSON schema.

    Integers keep every digit. A value that does not fit its schema's type becomes a JSON
    string. partial: the value was cut off; returns None when nothing sensible remains."""
    types = schema.get("type") or []
    if isinstance(types, str):
        types = [types]
    s = raw.strip()
    if s == "null" and "null" in types:
        return "null"
    for t in types:
        if t == "integer" and re.fullmatch(r"-?\d+", s):
            return str(int(s))
        if t == "number" and re.fullmatch(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?", s):
            return str(int(s)) if re.fullmatch(r"-?\d+", s) else s
        if t == "boolean" and s.lower() in ("true", "false"):
            return s.lower()
        if t in ("object", "array"):
            try:
                v = partial_json_parser.loads(s) if partial else json.loads(s)
            except Exception:  # the library raises several types on bad text
                continue
            if isinstance(v, dict if t == "object" else list):
                return json.dumps(v, ensure_ascii=False)
    if partial and types and "string" not in types:
        return None
    return json.dumps(raw, ensure_ascii=False)


class Qwen3CoderToolParser(ToolParser):
    """`<tool_call><function=N><parameter=P>v</parameter></function></tool_call>`."""

    VALUE_END = "</parameter>"
    NEXT_TAGS = ("<parameter=", "</function>", TOOL_CALL_CLOSE)

    def __init__(self, tools: dict[str, dict[str, Any]] | None = None):
        super().__init__(tools)
        self._state = "text"  # text | func | params | value | close
        self._name = self._param = ""
        self._index = -1
        self._nparams = 0

    def _schema(self, param: str) -> dict[str, Any]:
        props = (self.tools.get(self._name) or {}).get("properties") or {}
        return props.get(param) or {}

    def _emit_param(self, raw: str, out: list[Event], partial: bool = False) -> None:
        if raw.startswith("\n"):
            raw = raw[1:]
        if raw.endswith("\n") and not partial:
            raw = raw[:-1]
        value = _param_json(raw, self._schema(self._param), partial)
        if value is not None:
            sep = ", " if self._nparams else ""
            out.append(ToolCallArgs(self._index, f"{sep}{json.dumps(self._param, ensure_ascii=False)}: {value}"))
            self._nparams += 1

    def _value_end(self, final: bool) -> int | None:
        """Offset of the `</parameter>` that ends the value in _buf; None: not known yet;
        -1: no end (only at the end of output)."""
        j = self._buf.find(self.VALUE_END)
        while j >= 0:
            after = self._buf[j + len(self.VALUE_END):].lstrip()
            if any(after.startswith(t) for t in self.NEXT_TAGS):
                return j
            if not after or any(t.startswith(after) for t in self.NEXT_TAGS):
                return j if final else None
            j = self._buf.find(self.VALUE_END, j + 1)
        return -1 if final else None

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._buf += text
        while self._buf:
            s = self._buf.lstrip()
            if self._state == "text":
                if not self._text_until_call(out):
                    break
                self._state = "func"
            elif self._state == "func":
                if "<function=".startswith(s) or (s.startswith("<function=") and ">" not in s):
                    break
                if not s.startswith("<function="):
                    self._state = "text"  # not a call after all
                    continue
                end = s.index(">")
                self._name = s[len("<function="):end].strip()
                self._index = self._start_call(self._name, out)
                self._nparams = 0
                out.append(ToolCallArgs(self._index, "{"))
                self._buf, self._state = s[end + 1:], "params"
            elif self._state == "params":
                if s.startswith("<parameter=") and ">" in s:
                    end = s.index(">")
                    self._param = s[len("<parameter="):end].strip()
                    self._buf, self._state = s[end + 1:], "value"
                elif s.startswith("</function>"):
                    out.append(ToolCallArgs(self._index, "}"))
                    self._buf, self._state = s[len("</function>"):], "close"
                elif any(t.startswith(s) for t in ("<parameter=", "</function>")) or s.startswith("<parameter="):
                    break
                else:  # malformed: close the call and go on with text
                    out.append(ToolCallArgs(self._index, "}"))
                    self._state = "text"
            elif self._state == "value":
                j = self._value_end(final=False)
                if j is None or j < 0:
                    break
                self._emit_param(self._buf[:j], out)
                self._buf, self._state = self._buf[j + len(self.VALUE_END):], "params"
            elif self._skip_call_close():  # close
                self._state = "text"
            else:
                break
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._state == "text":
            self._content(self._buf, out)
        elif self._state == "value":
            j = self._value_end(final=True)
            if j is not None and j >= 0:
                self._emit_param(self._buf[:j], out)
            else:
                self._emit_param(self._buf, out, partial=True)
            out += [ToolCallArgs(self._index, "}"), ToolCallCut(self._index)]
        elif self._state == "params":
            out += [ToolCallArgs(self._index, "}"), ToolCallCut(self._index)]
        self._buf = ""
        self._finish_content(out)
        return out


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}


def make_tool_parser(name: str, tools: dict[str, dict[str, Any]] | None) -> ToolParser:
    """A new parser for one response. name: "hermes", "qwen3_coder" or "forced".
    Raises KeyError for an unknown name."""
    if name == "forced":
        return ForcedToolParser(tools)
    return TOOL_PARSERS[name](tools)
