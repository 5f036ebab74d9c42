"""Top-level fields of an Anthropic Messages request other than messages and tools: the
set of known fields, `thinking` and `output_config` (anthropic_protocol.py calls these).

Sources: Anthropic's API reference as the official `anthropic` Python SDK (2.14) types it
(`MessageCreateParams`, its beta variant and `MessageCountTokensParams`), and the requests
of the Claude Code CLI (2.1): `thinking: {"type": "adaptive"}`, `output_config: {"effort":
...}`, `context_management`, `metadata.user_id`, `cache_control` on blocks, `anthropic-beta`
headers.

Known fields (KNOWN_FIELDS): a body holding any other top-level key is a 400
invalid_request_error `<key>: Extra inputs are not permitted` (every such key named, in
body order), the message Anthropic's API gives. Of the known fields, those in IGNORED_FIELDS
are accepted and have no effect here (prompt caching is automatic: the engine's prefix
cache; no server tools, containers, MCP servers, service tiers or context editing); the rest
are read by anthropic_protocol.py. The SDK's `betas`, `user_profile_id` and `workspace_id`
are headers, not body fields; headers are never checked. The same set applies to
count_tokens, where the sampling fields are ignored.

thinking (`parse_thinking`): `{"type": "enabled", "budget_tokens": N}` (N >= 1024 and
< max_tokens; not enforced: the reasoning ends when the model closes it) and `{"type":
"adaptive"}` (the model decides) turn the chat template's thinking switch on
(`enable_thinking`) and, with `--reasoning-parser`, split the answer into `thinking` and
`text` blocks; `{"type": "disabled"}` and `{"type": "between_tools"}` ("thinking turned
off", per the SDK) turn it off, as does no `thinking`. `display`: "summarized" (the default
here: the reasoning text is returned) or "omitted" (thinking blocks are kept, their text
left empty).

output_config (`parse_output_config`): `format: {"type": "json_schema", "schema": {...}}`
constrains the text to the schema with the same grammar machinery as OpenAI's
`response_format` (structured_fields' `json_schema_constraint`, compiled by xgrammar in the
engine; a schema it cannot compile is a 400 on `output_config.format.schema`). `effort`
("low", "medium", "high", "xhigh", "max") and `task_budget` are accepted and unused. The
beta's top-level `output_format` (the same object) is read as `output_config.format`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.frontend.errors import InvalidRequest
from services.frontend.structured_fields import json_schema_constraint
from shared.protocol import StructuredSpec

# Read by anthropic_protocol.py.
USED_FIELDS = frozenset({
    "model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature",
    "top_p", "top_k", "tools", "tool_choice", "metadata", "thinking", "output_config",
    "output_format"})
# Accepted, no effect here (see the module docstring).
IGNORED_FIELDS = frozenset({
    "cache_control", "container", "context_management", "diagnostics", "inference_geo",
    "mcp_servers", "service_tier", "speed", "billing_policy", "compaction",
    "fallback_credit_token", "fallbacks", "thread"})
KNOWN_FIELDS = USED_FIELDS | IGNORED_FIELDS

THINKING_ON = ("enabled", "adaptive")
THINKING_OFF = ("disabled", "between_tools")
THINKING_DISPLAY = ("summarized", "omitted")
EFFORTS = ("low", "medium", "high", "xhigh", "max")


def check_known_fields(body: dict[str, Any]) -> None:
    """Raise InvalidRequest (400) naming every top-level key of `body` outside
    KNOWN_FIELDS, as Anthropic's API does: "<key>: Extra inputs are not permitted"."""
    extra = [k for k in body if k not in KNOWN_FIELDS]
    if extra:
        raise InvalidRequest(extra[0], "; ".join(f"{k}: Extra inputs are not permitted"
                                                 for k in extra))


def check_cache_control(holder: dict[str, Any], param: str | None) -> None:
    """Check the `cache_control` of `holder` (the body, a block or a tool at `param`; None:
    the body): absent, null, or an object of type "ephemeral" (other keys, such as `ttl`
    and Claude Code's `scope`, are not read: the prefix cache is automatic). Raises
    InvalidRequest naming `<param>.cache_control` otherwise."""
    cc = holder.get("cache_control")
    if cc is None:
        return
    name = f"{param}.cache_control" if param else "cache_control"
    if not isinstance(cc, dict):
        raise InvalidRequest(name, f"{name}: Input should be an object ({{\"type\": \"ephemeral\"}}).")
    if cc.get("type") != "ephemeral":
        raise InvalidRequest(f"{name}.type", f"{name}.type: Input should be 'ephemeral'.")


@dataclass(frozen=True)
class Thinking:
    """The request's thinking setting. on: enable_thinking for the chat template and the
    reasoning parser. omit_text: display "omitted" (thinking blocks without their text)."""

    on: bool = False
    omit_text: bool = False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_thinking(value: Any, max_tokens: int | None) -> Thinking:
    """`thinking` -> Thinking (None: off). max_tokens: the request's (None on count_tokens:
    the budget is then not compared with it). Raises InvalidRequest naming the field."""
    if value is None:
        return Thinking()
    kinds = THINKING_ON + THINKING_OFF
    if not isinstance(value, dict) or value.get("type") not in kinds:
        raise InvalidRequest("thinking.type", "thinking.type: Input should be "
                             + ", ".join(repr(k) for k in kinds[:-1]) + f" or {kinds[-1]!r}.")
    kind = value["type"]
    if kind == "enabled":
        budget: Any = value.get("budget_tokens")  # a JSON value, checked here
        if not _is_int(budget) or budget < 1024:
            raise InvalidRequest("thinking.budget_tokens", "thinking.budget_tokens: Input "
                                 "should be an integer greater than or equal to 1024.")
        if max_tokens is not None and budget >= max_tokens:
            raise InvalidRequest("thinking.budget_tokens",
                                 "thinking.budget_tokens: Must be less than max_tokens.")
    display = value.get("display")
    if display is not None and (kind not in THINKING_ON or display not in THINKING_DISPLAY):
        raise InvalidRequest("thinking.display", "thinking.display: Input should be "
                             "'summarized' or 'omitted' (with type 'enabled' or 'adaptive').")
    return Thinking(on=kind in THINKING_ON, omit_text=display == "omitted")


def _format_constraint(fmt: Any, param: str) -> StructuredSpec | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise InvalidRequest(f"{param}.type", f"{param}.type: Input should be 'json_schema'.")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param}.schema",
                             f"{param}.schema: Field required (a JSON schema object).")
    try:
        return json_schema_constraint(schema, f"{param}.schema")
    except InvalidRequest as e:  # Anthropic's envelope has no param: the message names it
        raise InvalidRequest(e.param, f"{param}.schema: {e.message}") from None


def parse_output_config(body: dict[str, Any]) -> StructuredSpec | None:
    """`output_config` (and the beta's top-level `output_format`) -> the constraint of the
    answer's text (None: free text). Checks `effort` and `task_budget` and drops them.
    Compiles the schema with xgrammar: call it off the event loop. Raises InvalidRequest
    naming the field."""
    config = body.get("output_config")
    spec = None
    if config is not None:
        if not isinstance(config, dict):
            raise InvalidRequest("output_config", "output_config: Input should be an object.")
        effort = config.get("effort")
        if effort is not None and effort not in EFFORTS:
            raise InvalidRequest("output_config.effort", "output_config.effort: Input should "
                                 "be " + ", ".join(repr(e) for e in EFFORTS) + ".")
        budget = config.get("task_budget")
        if budget is not None and not isinstance(budget, dict):
            raise InvalidRequest("output_config.task_budget",
                                 "output_config.task_budget: Input should be an object.")
        spec = _format_constraint(config.get("format"), "output_config.format")
    legacy = _format_constraint(body.get("output_format"), "output_format")
    if spec is not None and legacy is not None:
        raise InvalidRequest("output_format", "output_format: Give the format once, in "
                             "output_config.format.")
    return spec or legacy
