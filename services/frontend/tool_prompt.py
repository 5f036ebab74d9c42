"""Tools in the prompt when the model's chat template cannot render them.

Many small models' templates ignore `tools`, assistant `tool_calls` and tool results: the
default model's (SmolLM2-135M-Instruct) renders only `role` and `content`. Rendering a
request's tools through such a template would drop them silently (the prompt is the same with
and without them). So each template is probed once, when it is loaded (`probe_tool_support`):
probe conversations are rendered and the result is searched for the probe's own names, so a
date the template prints (`strftime_now`) cannot fool the check:

- `renders_tools`: a probe tool's name appears when it is passed as `tools`;
- `renders_tool_calls`: a probe call's function name appears in an assistant turn;
- `renders_system`: a system message's text appears.

When the template does not render tools, `with_fallback` presents them the way the
Hermes / Qwen2.5 / Qwen3 templates (and Kestrel's `templates/qwen3.jinja`, word for word) do:
a system block listing each function's JSON schema inside `<tools></tools>` and saying how to
call, in the format the server's `--tool-call-parser` reads (`tool_call_format` "json":
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, hermes and the default; "xml":
`<tool_call><function=N><parameter=P>v</parameter></function></tool_call>`, qwen3_coder), so
the model's calls parse back. The block is appended to the first system message, or becomes
one. When the template does not render assistant tool calls either, earlier calls are written
into the assistant's content in the same format and tool results become user turns of
`<tool_response>` blocks (consecutive results share one turn), as those templates do.
A template that renders neither tools nor a system message has no place for the block: such a
request is refused with 400 naming `--chat-template` (`InvalidRequest`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.frontend.errors import InvalidRequest

_PROBE_TOOL = "kestrel_probe_tool_7f3a"
_PROBE_CALL = "kestrel_probe_call_7f3a"
_PROBE_SYSTEM = "kestrel_probe_system_7f3a"

_JSON_HOW = ("For each function call, return a json object with the function name and "
             "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
             '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
_XML_HOW = ("To call a function, reply with:\n<tool_call>\n<function=FUNCTION_NAME>\n"
            "<parameter=PARAMETER_NAME>\nvalue\n</parameter>\n</function>\n</tool_call>")

# A template render: (messages, tools or None) -> prompt text; raises InvalidRequest.
Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]


@dataclass(frozen=True)
class ToolSupport:
    """What a chat template renders (see the module docstring)."""

    renders_tools: bool = True
    renders_tool_calls: bool = True
    renders_system: bool = True

    @property
    def needs_fallback(self) -> bool:
        """Some tool part of a request would be dropped by the template itself."""
        return not (self.renders_tools and self.renders_tool_calls)


def _shows(render: Render, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
           marker: str) -> bool:
    try:
        return marker in render(messages, tools)
    except InvalidRequest:  # the template rejects the probe: it cannot be relied on for it
        return False


def probe_tool_support(render: Render) -> ToolSupport:
    """Probe a template (`render`: messages, tools -> text) once; see the module docstring."""
    user = {"role": "user", "content": "Hello."}
    tool = {"type": "function", "function": {"name": _PROBE_TOOL, "description": "Probe.",
                                             "parameters": {"type": "object",
                                                            "properties": {}}}}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_probe", "type": "function",
         "function": {"name": _PROBE_CALL, "arguments": {}}}]}
    result = {"role": "tool", "content": "Done.", "tool_call_id": "call_probe"}
    return ToolSupport(
        renders_tools=_shows(render, [user], [tool], _PROBE_TOOL),
        renders_tool_calls=_shows(render, [user, call, result], [tool], _PROBE_CALL),
        renders_system=_shows(render, [{"role": "system", "content": _PROBE_SYSTEM}, user],
                              None, _PROBE_SYSTEM))


def tools_block(tools: list[dict[str, Any]], fmt: str) -> str:
    """The fallback system text for `tools` ([{"type": "function", "function": {...}}]).
    fmt: "json" (hermes) or "xml" (qwen3_coder)."""
    listed = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    how = _XML_HOW if fmt == "xml" else _JSON_HOW
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n{how}")


def _call_text(call: dict[str, Any], fmt: str) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if fmt == "xml":
        params = "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
            "\n</parameter>\n" for k, v in (args.items() if isinstance(args, dict) else []))
        return f"<tool_call>\n<function={fn['name']}>\n{params}</function>\n</tool_call>"
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, ' \
           f'"arguments": {text}}}\n</tool_call>'


def _history_as_text(messages: list[dict[str, Any]], fmt: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    results = False  # out[-1] is a user turn of tool results
    for m in messages:
        if m.get("role") == "tool":
            block = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            if results:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            results = True
            continue
        results = False
        if m.get("role") == "assistant" and m.get("tool_calls"):
            parts = ([m["content"]] if m.get("content") else []) + [
                _call_text(c, fmt) for c in m["tool_calls"]]
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": "\n".join(parts)}
        out.append(m)
    return out


def with_fallback(support: ToolSupport, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None, fmt: str
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render with a template of `support`: unchanged when it renders
    them itself, else rewritten as the module docstring says (tools then None). fmt: the
    `tool_call_format`, "json" or "xml". Raises InvalidRequest (param "tools") when tools
    must be shown and the template renders no system message."""
    if not support.renders_tool_calls and any(
            m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        messages = _history_as_text(messages, fmt)
    if not tools or support.renders_tools:
        return messages, tools
    if not support.renders_system:
        raise InvalidRequest("tools", "The model's chat template renders neither tools nor a "
                             "system message, so the tools cannot be put in the prompt. Start "
                             "the server with --chat-template naming a template that renders "
                             "`tools` (e.g. --chat-template qwen3, or a Jinja file).")
    block = tools_block(tools, fmt)
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        text = f"{first['content']}\n\n{block}" if first.get("content") else block
        return [first | {"content": text}, *messages[1:]], None
    return [{"role": "system", "content": block}, *messages], None
