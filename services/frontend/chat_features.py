"""Chat features shared by the OpenAI and Anthropic routes: the chat template chosen with
`--chat-template`, and per request the output parser (reasoning with `--reasoning-parser`,
tool calls with `--tool-call-parser`, stop strings).

`--chat-template` is a name of a file under shared/chat_templates/ without `.jinja`
(`qwen3`), or a path to a Jinja file (`shared/chat_template_source.py`, where the config
builder refuses one that names no file or does not compile); without it, the model's own
template is used. A
template that does not render tools (or tool calls) gets them through the fallback of
`tool_prompt.py`; that is logged once, at load.
"""

from __future__ import annotations

import logging
from typing import Any

from services.frontend.chat_template import ChatTemplate
from services.frontend.parsers.output import ChatOutputParser
from services.frontend.parsers.reasoning import REASONING_PARSERS, THINK_OPEN
from services.frontend.parsers.tool_parsers import make_tool_parser
from services.frontend.tokenizer import Tokenizer
from shared.chat_template_source import read_template

log = logging.getLogger("kestrel.frontend.chat")


def load_chat_template(setting: str | None, tokenizer: Tokenizer) -> ChatTemplate | None:
    """The chat template to use: `setting` (a bundled name or a file path) or the model's.
    Returns None when there is none (chat requests then fail with 500).
    Raises ValueError when `setting` names no file, or its template does not compile."""
    source = read_template(setting) if setting else tokenizer.chat_template
    if source is None:
        return None
    template = ChatTemplate(source, tokenizer.special_tokens)
    sup = template.support
    if sup.needs_fallback:
        log.warning("the chat template renders %s; Kestrel adds them to the prompt itself "
                    "(a system block of tools, calls and results as <tool_call> / "
                    "<tool_response> text)%s", " and ".join(
                        w for w, ok in (("no tools", sup.renders_tools),
                                        ("no tool calls", sup.renders_tool_calls)) if not ok),
                    "" if sup.renders_system or sup.renders_tools else
                    "; it renders no system message either, so requests with tools get 400 "
                    "(use --chat-template)")
    return template


class ChatFeatures:
    """The frontend's tool-call and reasoning settings (None: off)."""

    def __init__(self, tool_call_parser: str | None = None, reasoning_parser: str | None = None):
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser

    def template_kwargs(self) -> dict[str, Any]:
        """Extra template variables: the tool-call format the parser reads (Kestrel's
        templates describe that format to the model)."""
        return {"tool_call_format": "xml" if self.tool_call_parser == "qwen3_coder" else "json"}

    def reasons(self, thinking: bool, forced: bool) -> bool:
        """Whether a response is split into reasoning and content: a reasoning parser is
        set, enable_thinking is on, and no tool call is forced."""
        return bool(self.reasoning_parser) and thinking and not forced

    def output_parser(self, prompt: str, stops: list[str], thinking: bool,
                      tools: dict[str, dict[str, Any]] | None, forced: bool,
                      parallel: bool = True) -> ChatOutputParser:
        """The parser of one response. prompt: the rendered prompt (a prompt that ends with
        `<think>` starts the output inside the reasoning). thinking: enable_thinking.
        tools: name -> parameter schema of the request's tools (None: no tool parsing).
        forced: the output is constrained to the forced-call JSON (tool_choice). parallel:
        parallel tool calls allowed (False: only the first call is passed on, also when
        the model writes more unforced)."""
        reasoning = None
        if self.reasoning_parser and self.reasons(thinking, forced):
            reasoning = REASONING_PARSERS[self.reasoning_parser](
                True, starts_inside=prompt.rstrip().endswith(THINK_OPEN))
        tool_parser = None
        if forced:
            tool_parser = make_tool_parser("forced", tools)
        elif tools and self.tool_call_parser:
            tool_parser = make_tool_parser(self.tool_call_parser, tools)
        return ChatOutputParser(reasoning, tool_parser, stops, None if parallel else 1)
