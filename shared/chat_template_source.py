"""The chat template's Jinja dialect and the `--chat-template` setting's source.

One home for both, because the config builder must refuse a broken `--chat-template` before
anything starts (exit 2, as vLLM refuses it), and the frontend compiles the same text with
the same environment when it serves (`services/frontend/chat_template.py`).

The dialect follows the Hugging Face chat template conventions (`apply_chat_template` in
transformers): jinja2's `ImmutableSandboxedEnvironment` with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}` block tag (rendered as its
body), the globals `raise_exception(message)` and `strftime_now(format)`, and a `tojson` filter
that keeps non-ASCII characters.

`--chat-template` is a path to a Jinja file or the name (without `.jinja`) of one of the
bundled templates in `shared/chat_templates/` (`qwen3`).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")


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


def jinja_environment() -> ImmutableSandboxedEnvironment:
    """A new environment of the chat-template dialect (module docstring)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_template(source: str) -> jinja2.Template:
    """`source` compiled in the chat-template dialect. Raises ValueError ("chat template does
    not compile: <jinja's message, with the line>") on a syntax error or an unknown
    filter / test."""
    try:
        return jinja_environment().from_string(source)
    except jinja2.TemplateError as e:
        line = getattr(e, "lineno", None)  # a TemplateSyntaxError's
        where = f" (line {line})" if line else ""
        raise ValueError(f"chat template does not compile: {e}{where}") from None


def bundled_names() -> list[str]:
    """The names of the bundled templates (files `shared/chat_templates/<name>.jinja`)."""
    return sorted(f[:-6] for f in os.listdir(TEMPLATES_DIR) if f.endswith(".jinja"))


def template_path(setting: str) -> str:
    """The file a `--chat-template` value names: itself when it is a file, else the bundled
    `<setting>.jinja`. Raises ValueError naming the value and the bundled names."""
    if os.path.isfile(setting):
        return setting
    path = os.path.join(TEMPLATES_DIR, f"{setting}.jinja")
    if os.path.basename(setting) == setting and os.path.isfile(path):
        return path
    raise ValueError(f"chat template {setting!r} is neither a file nor one of the bundled "
                     f"templates {bundled_names()}")


def read_template(setting: str) -> str:
    """The Jinja text a `--chat-template` value names. Raises ValueError when it names no
    file or the file cannot be read as UTF-8."""
    path = template_path(setting)
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"chat template {setting!r} cannot be read: {e}") from None


def check_chat_template(setting: str | None) -> None:
    """The config builder's check of `--chat-template` (None: the model's own, not checked
    here): it names a file or a bundled template, and that text compiles. Raises ValueError
    starting "setting chat_template: "."""
    if not setting:
        return
    try:
        compile_template(read_template(setting))
    except ValueError as e:
        raise ValueError(f"setting chat_template: {e}") from None
