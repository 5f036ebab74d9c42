"""Chat templates: a model's Jinja template turned into a prompt string.

Follows the Hugging Face chat template conventions (`apply_chat_template` in transformers):
the template runs in jinja2's `ImmutableSandboxedEnvironment` with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}` block tag (rendered as
its body), the globals `raise_exception(message)` and `strftime_now(format)`, and a `tojson`
filter that keeps non-ASCII characters. The render variables are `messages`,
`add_generation_prompt`, `tools`, `documents`, the tokenizer's special tokens (`bos_token`,
`eos_token`, ...) and any extra keyword arguments (e.g. `enable_thinking`).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.frontend.errors import InvalidRequest


def _raise_exception(message: str) -> None:
    """Template global: a template rejects its input (HF's `raise_exception`)."""
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    """Template global: the local time now, formatted with strftime."""
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Template filter: JSON as Python's json.dumps writes it, non-ASCII kept by default."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    HF; for serving it renders just its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body", []), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template.

    source: the Jinja text (tokenizer_config.json's chat_template).
    special_tokens: render variables such as {"bos_token": "<s>", "eos_token": "</s>"}.
    Raises ValueError if the template does not compile (a fault of the model folder).
    """

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template does not compile: {e}") from None
        self._special_tokens = dict(special_tokens or {})

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """The prompt text for `messages` (dicts with "role" and "content", content a string).

        add_generation_prompt: end with the header of an assistant turn, so that the model
        answers. kwargs become extra template variables (chat_template_kwargs).
        Raises InvalidRequest (param "messages") when the template rejects the messages
        (its raise_exception) or fails on them; the message is the template's own.
        """
        variables = {**self._special_tokens, **kwargs}
        try:
            return self._template.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.TemplateError as e:
            raise InvalidRequest("messages",
                                 f"The chat template rejected the messages: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise InvalidRequest("messages",
                                 f"The chat template failed on the messages: {e}") from None
