"""The structured-output fields of an OpenAI chat or completions request, as one constraint.

A request names at most one constraint, in one of three forms (two at once: a 400 naming
the second):
- OpenAI's `response_format`: {"type": "text"} | {"type": "json_object"} |
  {"type": "json_schema", "json_schema": {"name", "schema", "strict"}};
- vLLM's older extra fields, one of `guided_json` (a schema object, or its JSON text),
  `guided_regex`, `guided_choice` (a list of strings), `guided_grammar` (EBNF as xgrammar
  reads it: `root ::= ...`); `guided_decoding_backend` may only name xgrammar (or auto);
  `guided_whitespace_pattern` and `structural_tag` are refused (400: not supported);
- vLLM's newer `structured_outputs`: {"json" | "regex" | "choice" | "grammar" |
  "json_object": true}, exactly one, plus the flags `disable_fallback` (no fallback backend
  here: ignored), `disable_any_whitespace` (schemas compile without free whitespace anyway);
  `whitespace_pattern`, `structural_tag`, `disable_additional_properties: true` and unknown
  keys are refused.

Each becomes a `StructuredSpec` the engine compiles with xgrammar (services/engine/structured.py):
a JSON schema (kind json_schema, `json_schema_constraint`), a regex (kind regex), an EBNF grammar
(kind grammar); a choice list is the grammar `root ::= "a" | "b"` of its literal strings.
Each is compiled here first (off the event loop, `check_grammar`), so that one xgrammar cannot
compile is a 400 naming its field before any SSE byte. A JSON schema nested more than 64 levels
is a 400 too (services/frontend/schema_limits.py).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import orjson

from services.frontend import strict_json
from services.frontend.errors import InvalidRequest
from services.frontend.schema_limits import depth_message, too_deep
from shared.grammar_errors import grammar_error_text
from shared.protocol import StructuredSpec

log = logging.getLogger("kestrel.frontend.sampling")

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
GUIDED_REFUSED = ("guided_whitespace_pattern", "structural_tag")
GUIDED_BACKENDS = ("xgrammar", "auto")
SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
SO_IGNORED = ("disable_fallback", "disable_any_whitespace")  # booleans without effect here
SO_REFUSED = ("whitespace_pattern", "structural_tag")
MAX_CHOICES = 1024  # strings of a choice list


def check_grammar(kind: str, text: str, param: str) -> None:
    """Compile `text` with xgrammar as the engine will (kind json_schema, regex or grammar);
    raise InvalidRequest(param) if it cannot. The first call imports xgrammar (and torch:
    seconds): call it off the event loop, after `warm_xgrammar` (server startup) where
    possible."""
    what = {"json_schema": "The JSON schema", "regex": "The regex", "grammar": "The grammar"}[kind]
    try:
        import xgrammar
        if kind == "json_schema":
            xgrammar.Grammar.from_json_schema(text)
        elif kind == "regex":
            xgrammar.Grammar.from_regex(text)
        else:
            xgrammar.Grammar.from_ebnf(text)
    except ImportError:  # pragma: no cover - xgrammar is a runtime dependency
        raise InvalidRequest(param, "Structured output is not available "
                             "(xgrammar is not installed).") from None
    except Exception as e:  # xgrammar raises RuntimeError/ValueError with its reason
        reason = grammar_error_text(e)
        raise InvalidRequest(param, f"{what} cannot be compiled: {reason}") from None


def json_schema_constraint(schema: dict[str, Any], param: str) -> StructuredSpec:
    """The StructuredSpec (kind json_schema) of a JSON schema object, checked with xgrammar
    (the engine's compiler): Raises InvalidRequest(param) when the schema is nested too
    deeply (more than `schema_limits.MAX_SCHEMA_DEPTH` levels) or cannot be compiled. Shared by
    OpenAI's response_format, vLLM's guided_json / structured_outputs.json, Anthropic's
    output_config.format and the tools' schemas. Call it off the event loop (`check_grammar`)."""
    if too_deep(schema):  # xgrammar would take seconds (services/frontend/schema_limits.py)
        raise InvalidRequest(param, depth_message(param))
    try:
        text = orjson.dumps(schema).decode()
    except orjson.JSONEncodeError:  # "Recursion limit reached": nested past ~255 levels
        raise InvalidRequest(param, depth_message(param)) from None
    check_grammar("json_schema", text, param)
    return StructuredSpec(kind="json_schema", spec=text)


def warm_xgrammar() -> None:
    """Import xgrammar and compile a trivial schema, so that the first request's schema
    check is fast. Blocks for seconds: the server runs it in a background thread. Never
    raises (a missing xgrammar is reported by the first structured request)."""
    try:
        check_grammar("json_schema", '{"type": "object"}', "response_format")
    except Exception as e:
        log.warning("xgrammar warm-up failed: %s", e)


def parse_response_format(value: Any) -> StructuredSpec | None:
    """`response_format` -> StructuredSpec (None for text). Raises InvalidRequest."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in (
            "text", "json_object", "json_schema"):
        raise InvalidRequest("response_format.type", "'response_format.type' must be 'text', "
                             "'json_object' or 'json_schema'.")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec(kind="json_object")
    js = value.get("json_schema")
    if not isinstance(js, dict):
        raise InvalidRequest("response_format.json_schema",
                             "'response_format.json_schema' must be an object.")
    if not isinstance(js.get("name", ""), str):
        raise InvalidRequest("response_format.json_schema.name", "'name' must be a string.")
    schema = js.get("schema", {})
    if not isinstance(schema, dict):
        raise InvalidRequest("response_format.json_schema.schema",
                             "'response_format.json_schema.schema' must be an object.")
    return json_schema_constraint(schema, "response_format.json_schema.schema")


def choice_grammar(choices: list[str]) -> str:
    """The EBNF (xgrammar's) that matches exactly one of `choices`: `root ::= "a" | "b"`,
    each a string literal with JSON's escapes (which xgrammar's EBNF reads the same)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _kind_spec(kind: str, value: Any, param: str) -> StructuredSpec:
    """One constraint of `kind` (json, regex, choice, grammar) from its request value."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = strict_json.loads(value)
            except ValueError as e:
                raise InvalidRequest(param, f"'{param}' must be a JSON schema (an object, or "
                                     f"its JSON text): {e}") from None
        if not isinstance(value, dict):
            raise InvalidRequest(param, f"'{param}' must be a JSON schema object.")
        return json_schema_constraint(value, param)
    if kind == "choice":
        if not isinstance(value, list) or not value or len(value) > MAX_CHOICES or not all(
                isinstance(c, str) and c for c in value):
            raise InvalidRequest(param, f"'{param}' must be a list of 1 to {MAX_CHOICES} "
                                 "non-empty strings.")
        text = choice_grammar(value)
        check_grammar("grammar", text, param)
        return StructuredSpec(kind="grammar", spec=text)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(param, f"'{param}' must be a non-empty string.")
    spec_kind = "regex" if kind == "regex" else "grammar"
    check_grammar(spec_kind, value, param)
    return StructuredSpec(kind=spec_kind, spec=value)


def _guided(body: dict[str, Any]) -> tuple[StructuredSpec, str] | None:
    """vLLM's guided_* fields -> (spec, the field), None when none is set."""
    for name in GUIDED_REFUSED:
        if body.get(name) is not None:
            raise InvalidRequest(name, f"'{name}' is not supported.")
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in GUIDED_BACKENDS:
        raise InvalidRequest("guided_decoding_backend", "'guided_decoding_backend' must be "
                             f"one of {list(GUIDED_BACKENDS)}: structured output uses xgrammar.")
    given = [n for n in GUIDED if body.get(n) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequest(given[1], f"Only one kind of guided decoding may be set, got "
                             f"{', '.join(given)}.")
    name = given[0]
    return _kind_spec(name.removeprefix("guided_"), body[name], name), name


def _structured_outputs(value: Any) -> tuple[StructuredSpec, str] | None:
    """vLLM's `structured_outputs` object -> (spec, its field), None when null."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("structured_outputs", "'structured_outputs' must be an object.")
    for key, v in value.items():
        p = f"structured_outputs.{key}"
        if key in SO_REFUSED and v is not None:
            raise InvalidRequest(p, f"'{p}' is not supported.")
        if key in SO_IGNORED and v is not None and not isinstance(v, bool):
            raise InvalidRequest(p, f"'{p}' must be a boolean.")
        if key == "disable_additional_properties" and v not in (None, False):
            raise InvalidRequest(p, f"'{p}' is not supported (set additionalProperties: "
                                 "false in the schema instead).")
        if key not in SO_KINDS + SO_IGNORED + SO_REFUSED + ("disable_additional_properties",):
            raise InvalidRequest(p, f"Unknown field '{p}' (one of "
                                 f"{', '.join(SO_KINDS)} is the constraint).")
    if value.get("json_object") not in (None, False, True):
        raise InvalidRequest("structured_outputs.json_object",
                             "'structured_outputs.json_object' must be a boolean.")
    given = [k for k in SO_KINDS if value.get(k) not in (None, False)]
    if not given:
        raise InvalidRequest("structured_outputs", "'structured_outputs' must set one of "
                             f"{', '.join(SO_KINDS)}.")
    if len(given) > 1:
        raise InvalidRequest(f"structured_outputs.{given[1]}", "'structured_outputs' may set "
                             f"only one constraint, got {', '.join(given)}.")
    kind, param = given[0], f"structured_outputs.{given[0]}"
    if kind == "json_object":
        return StructuredSpec(kind="json_object"), param
    return _kind_spec(kind, value[kind], param), param


def request_constraint(body: dict[str, Any]) -> tuple[StructuredSpec | None, str | None]:
    """The one structured-output constraint of a chat or completions body (module docstring)
    and the field it came from; (None, None) without one. Compiles it with xgrammar: call it
    off the event loop. Raises InvalidRequest naming the field at fault (the second one when
    two forms are given)."""
    found: list[tuple[StructuredSpec, str]] = []
    fmt = parse_response_format(body.get("response_format"))
    if fmt is not None:
        found.append((fmt, "response_format"))
    for parsed in (_guided(body), _structured_outputs(body.get("structured_outputs"))):
        if parsed is not None:
            found.append(parsed)
    if not found:
        return None, None
    if len(found) > 1:
        raise InvalidRequest(found[1][1], f"'{found[1][1]}' cannot be combined with "
                             f"'{found[0][1]}': give one structured-output constraint.")
    return found[0]
