"""The OpenAPI 3.1 document of Kestrel's HTTP API, served at GET /openapi.json.

Written by hand from the validators (`openai_protocol`, `openai_sampling`,
`responses_protocol`, `tokenize_api`, `anthropic_protocol`): request bodies list the main
fields with their constraints; every route documents its success response and its error
envelope for 4xx/5xx (OpenAI's, or Anthropic's under /v1/messages). Also documented:
/metrics and /reset_prefix_cache (server.py). `extra_paths` adds more (e.g. debug routes).
"""

from __future__ import annotations

from typing import Any

from services.frontend.anthropic_fields import IGNORED_FIELDS
from services.frontend.openai_sampling import (MAX_N, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                                               MAX_TOP_LOGPROBS)

_ERR = {"$ref": "#/components/schemas/Error"}


def _num(lo: float, hi: float, excl_lo: bool = False) -> dict[str, Any]:
    s: dict[str, Any] = {"type": ["number", "null"], "maximum": hi}
    s["exclusiveMinimum" if excl_lo else "minimum"] = lo
    return s


_INT64 = {"type": ["integer", "null"], "minimum": -(2**63), "maximum": 2**63 - 1}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}

SAMPLING_PROPS: dict[str, Any] = {
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_N},
    "seed": _INT64,
    "temperature": _num(0, 2), "top_p": _num(0, 1, excl_lo=True),
    "top_k": {"type": ["integer", "null"], "minimum": -1, "maximum": 2**31 - 1},
    "min_p": _num(0, 1),
    "presence_penalty": _num(-2, 2), "frequency_penalty": _num(-2, 2),
    "repetition_penalty": _num(0, 2, excl_lo=True),
    "logit_bias": {"type": ["object", "null"], "maxProperties": 300,
                   "additionalProperties": {"type": "number", "minimum": -100,
                                            "maximum": 100},
                   "description": "token id (as a string) -> bias added to its logit"},
    "min_tokens": {"type": ["integer", "null"], "minimum": 0},
    "max_tokens": {"type": ["integer", "null"], "minimum": 0},
    "max_completion_tokens": {"type": ["integer", "null"], "minimum": 0},
    "stop": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                       {"type": "array", "maxItems": MAX_STOP_STRINGS,
                        "items": {"type": "string", "minLength": 1,
                                  "maxLength": MAX_STOP_CHARS}},
                       {"type": "null"}]},
    "stop_token_ids": {"anyOf": [_TOKEN_IDS, {"type": "null"}]},
    "ignore_eos": {"type": ["boolean", "null"]},
    "skip_special_tokens": {"type": ["boolean", "null"]},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"],
                       "properties": {"include_usage": {"type": "boolean"},
                                      "continuous_usage_stats": {"type": "boolean"}},
                       "description": "only with stream: true; continuous_usage_stats "
                                      "(with include_usage): usage on every chunk"},
    "response_format": {"type": ["object", "null"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {
            "name": {"type": "string"}, "schema": {"type": "object"},
            "strict": {"type": ["boolean", "null"]}}}}, "required": ["type"]},
}

_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
    "name": {"type": "string"},
    "tool_calls": {"type": "array", "description": "assistant messages", "items": {
        "type": "object", "required": ["function"], "properties": {
            "id": {"type": "string"}, "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"},
                "arguments": {"type": "string", "description": "JSON text"}}}}}},
    "tool_call_id": {"type": "string", "description": "required on tool messages"}}}

_TOOLS = {
    "tools": {"type": ["array", "null"], "items": {
        "type": "object", "required": ["function"], "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                "description": {"type": "string"}, "parameters": {"type": "object"},
                "strict": {"type": "boolean"}}}}}},
    "tool_choice": {"anyOf": [
        {"enum": ["none", "auto", "required"]}, {"type": "null"},
        {"type": "object", "required": ["type", "function"], "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"],
                         "properties": {"name": {"type": "string"}}}}}],
        "description": "required / a named function force a call (structured output)"},
    "parallel_tool_calls": {"type": ["boolean", "null"]},
}

CHAT_REQUEST = {"type": "object", "required": ["model", "messages"], "properties": {
    "model": {"type": "string"},
    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    "logprobs": {"type": ["boolean", "null"]},
    "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_TOP_LOGPROBS,
                     "description": "needs logprobs: true"},
    "chat_template_kwargs": {"type": ["object", "null"],
                             "description": "enable_thinking: reasoning on/off"},
    "add_generation_prompt": {"type": ["boolean", "null"], "description": "vLLM's; default true"},
    "continue_final_message": {"type": ["boolean", "null"],
                               "description": "vLLM's: continue the final assistant message "
                                              "(needs add_generation_prompt false)"},
    **_TOOLS,
    **SAMPLING_PROPS}}

_PROMPT = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
    {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1,
                                               "items": {"type": "integer", "minimum": 0}}}]}

COMPLETION_REQUEST = {"type": "object", "required": ["model", "prompt"], "properties": {
    "model": {"type": "string"}, "prompt": _PROMPT,
    "echo": {"type": ["boolean", "null"]},
    "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
    "best_of": {"type": ["integer", "null"], "minimum": 1, "description": "must equal n"},
    "suffix": {"type": ["string", "null"], "description": "not supported: 400 unless empty"},
    **SAMPLING_PROPS}}

# ---------------------------------------------------------------- OpenAI Responses API
# From responses_protocol / responses_input's validators.

_R_TEXT_PART = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"enum": ["input_text", "output_text", "text"]}, "text": {"type": "string"}}}
_R_ITEM = {"type": "object", "properties": {
    "type": {"enum": ["message", "function_call", "function_call_output", "reasoning"],
             "description": "message when absent and `role` is set"},
    "role": {"enum": ["user", "assistant", "system", "developer"]},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _R_TEXT_PART}]},
    "call_id": {"type": "string", "minLength": 1}, "name": {"type": "string", "minLength": 1},
    "arguments": {"type": "string", "description": "JSON text"},
    "output": {"anyOf": [{"type": "string"}, {"type": "array", "items": _R_TEXT_PART}]},
    "summary": {"type": "array"}}}
RESPONSES_REQUEST = {"type": "object", "required": ["model", "input"], "properties": {
    "model": {"type": "string"},
    "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": _R_ITEM}]},
    "instructions": {"type": ["string", "null"]},
    "max_output_tokens": {"type": ["integer", "null"], "minimum": 1},
    "temperature": _num(0, 2), "top_p": _num(0, 1, excl_lo=True),
    "tools": {"type": ["array", "null"], "items": {
        "type": "object", "required": ["type", "name"], "properties": {
            "type": {"const": "function"},
            "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
            "description": {"type": "string"}, "parameters": {"type": "object"},
            "strict": {"type": ["boolean", "null"]}}}},
    "tool_choice": {"anyOf": [
        {"enum": ["none", "auto", "required"]}, {"type": "null"},
        {"type": "object", "required": ["type", "name"], "properties": {
            "type": {"const": "function"}, "name": {"type": "string"}}}]},
    "parallel_tool_calls": {"type": ["boolean", "null"]},
    "text": {"type": ["object", "null"], "properties": {"format": {
        "type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "name": {"type": "string"}, "schema": {"type": "object"},
            "strict": {"type": ["boolean", "null"]}}}}},
    "reasoning": {"type": ["object", "null"], "properties": {
        "effort": {"enum": ["none", "minimal", "low", "medium", "high", "xhigh", None]},
        "summary": {"type": ["string", "null"]}},
        "description": "effort none: the template's thinking off"},
    "store": {"type": ["boolean", "null"], "description": "treated as false"},
    "stream": {"type": ["boolean", "null"]},
    "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
    "previous_response_id": {"type": "null", "description": "not supported (no state)"}}}

TOKENIZE_REQUEST = {"anyOf": [
    {"type": "object", "required": ["prompt"], "properties": {
        "model": {"type": "string"}, "prompt": {"type": "string"},
        "add_special_tokens": {"type": "boolean"}, "return_token_strs": {"type": "boolean"}}},
    {"type": "object", "required": ["messages"], "properties": {
        "model": {"type": "string"}, "messages": {"type": "array", "minItems": 1,
                                                  "items": _MESSAGE},
        "add_generation_prompt": {"type": "boolean"}, "add_special_tokens": {"type": "boolean"},
        "chat_template_kwargs": {"type": "object"}, "return_token_strs": {"type": "boolean"}}}]}

DETOKENIZE_REQUEST = {"type": "object", "required": ["tokens"], "properties": {
    "model": {"type": "string"}, "tokens": _TOKEN_IDS}}

_USAGE = {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                           "completion_tokens": {"type": "integer"},
                                           "total_tokens": {"type": "integer"}}}


def _errors(*codes: int) -> dict[str, Any]:
    desc = {400: "invalid request (error.param names the field)", 404: "unknown model",
            413: "request body too large", 500: "internal error",
            503: "engine unavailable or overloaded (Retry-After)"}
    return {str(c): {"description": desc[c],
                     "content": {"application/json": {"schema": _ERR}}} for c in codes}


def _json_ok(desc: str, schema: dict[str, Any], sse: bool = False) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": schema}}
    if sse:
        content["text/event-stream"] = {"schema": {"type": "string"},
                                        "description": "with stream: true"}
    return {"200": {"description": desc, "content": content}}


def _post(summary: str, body: dict[str, Any], ok: dict[str, Any]) -> dict[str, Any]:
    return {"post": {"summary": summary, "requestBody": {
        "required": True, "content": {"application/json": {"schema": body}}},
        "responses": {**ok, **_errors(400, 404, 413, 500, 503)}}}


def _get(summary: str, ok: dict[str, Any], *errors: int) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {**ok, **_errors(*errors)}}}


# ---------------------------------------------------------------- Anthropic Messages API
# From anthropic_protocol's validator. Errors use Anthropic's envelope (AnthropicError).

_A_TEXT = {"type": "object", "required": ["type", "text"],
           "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_A_BLOCK = {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["text", "image", "tool_use", "tool_result", "thinking",
                      "redacted_thinking"]},
    "text": {"type": "string"},
    "source": {"type": "object", "description": "image: base64 only; validated, then "
               "rejected with 400 (text-only model)", "properties": {
                   "type": {"const": "base64"},
                   "media_type": {"enum": ["image/jpeg", "image/png", "image/gif", "image/webp"]},
                   "data": {"type": "string"}}},
    "id": {"type": "string"}, "name": {"type": "string"}, "input": {"type": "object"},
    "tool_use_id": {"type": "string"}, "is_error": {"type": "boolean"},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _A_TEXT}]}}}
_A_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": ["user", "assistant", "system"],
             "description": "system: a mid-conversation system message (text only)"},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _A_BLOCK}]}}}
_A_COMMON = {
    "model": {"type": "string", "minLength": 1},
    "messages": {"type": "array", "minItems": 1, "items": _A_MESSAGE},
    "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": _A_TEXT}]},
    "tools": {"type": "array", "description": "needs --tool-call-parser to be parsed back",
              "items": {"type": "object", "required": ["name", "input_schema"], "properties": {
                  "type": {"const": "custom"}, "name": {"type": "string", "minLength": 1},
                  "description": {"type": "string"}, "input_schema": {"type": "object"}}}},
    "tool_choice": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
        "disable_parallel_tool_use": {"type": "boolean"}}},
    "thinking": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["enabled", "adaptive", "disabled", "between_tools"]},
        "budget_tokens": {"type": "integer", "minimum": 1024,
                          "description": "enabled: below max_tokens; not enforced"},
        "display": {"enum": ["summarized", "omitted"]}}},
    "output_config": {"type": "object", "properties": {
        "format": {"type": "object", "required": ["type", "schema"], "properties": {
            "type": {"const": "json_schema"}, "schema": {"type": "object"}},
            "description": "the text is constrained to the schema (grammar)"},
        "effort": {"enum": ["low", "medium", "high", "xhigh", "max"],
                   "description": "accepted, unused"}}},
    "output_format": {"type": "object", "description": "the beta's output_config.format"},
    "metadata": {"type": "object", "properties": {"user_id": {"type": "string"}}},
    # accepted and ignored (anthropic_fields.IGNORED_FIELDS); other fields are a 400
    **{name: {"description": "accepted, no effect here"} for name in sorted(IGNORED_FIELDS)},
}
MESSAGES_REQUEST = {"type": "object", "required": ["model", "max_tokens", "messages"],
                    "additionalProperties": False, "properties": {
    **_A_COMMON,
    "max_tokens": {"type": "integer", "minimum": 1},
    "stop_sequences": {"type": "array", "items": {"type": "string", "minLength": 1}},
    "temperature": {"type": "number", "minimum": 0, "maximum": 1},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
    "stream": {"type": "boolean"}}}
COUNT_TOKENS_REQUEST = {"type": "object", "required": ["model", "messages"],
                        "additionalProperties": False,  # sampling fields: accepted, unused
                        "properties": MESSAGES_REQUEST["properties"]}
_A_ERR = {"$ref": "#/components/schemas/AnthropicError"}


def _anthropic_errors() -> dict[str, Any]:
    desc = {400: "invalid_request_error (bad JSON, lone surrogates, validation, images)",
            404: "not_found_error (unknown model)", 413: "request_too_large",
            500: "api_error", 529: "overloaded_error (engine busy or unavailable)"}
    return {str(c): {"description": d, "content": {"application/json": {"schema": _A_ERR}}}
            for c, d in desc.items()}


def _anthropic_post(summary: str, body: dict[str, Any], ok: dict[str, Any]) -> dict[str, Any]:
    return {"post": {"summary": summary, "parameters": [
        {"name": "anthropic-version", "in": "header", "required": False,
         "schema": {"type": "string"}}], "requestBody": {
        "required": True, "content": {"application/json": {"schema": body}}},
        "responses": {**ok, **_anthropic_errors()}}}


ANTHROPIC_PATHS: dict[str, Any] = {
    "/v1/messages": _anthropic_post("Anthropic Messages", MESSAGES_REQUEST, _json_ok(
        "message (content blocks text / thinking / tool_use, stop_reason, usage), or SSE "
        "events message_start ... message_stop", {"type": "object", "properties": {
            "type": {"const": "message"}, "content": {"type": "array"},
            "stop_reason": {"type": ["string", "null"]},
            "stop_sequence": {"type": ["string", "null"]},
            "usage": {"type": "object", "properties": {
                "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"},
                "cache_creation_input_tokens": {"type": "integer", "const": 0},
                "cache_read_input_tokens": {"type": "integer", "const": 0}}}}},
        sse=True)),
    "/v1/messages/count_tokens": _anthropic_post(
        "Prompt tokens of a Messages request (as its usage.input_tokens)",
        COUNT_TOKENS_REQUEST, _json_ok("count", {"type": "object", "required": ["input_tokens"],
                                                 "properties": {"input_tokens": {
                                                     "type": "integer"}}})),
}

_OPS_ERR = {"type": "object", "properties": {"ok": {"const": False}, "error": {
    "type": "object", "properties": {"message": {"type": "string"}, "type": {"type": "string"}}}}}
OPERATIONS_PATHS: dict[str, Any] = {
    "/metrics": {"get": {"summary": "Prometheus metrics (open without the API key)",
                         "responses": {"200": {"description": "Prometheus text format",
                                               "content": {"text/plain": {
                                                   "schema": {"type": "string"}}}}}}},
    "/reset_prefix_cache": {"post": {
        "summary": "Drop every cached KV block of the engine's prefix cache (no body)",
        "responses": {
            "200": {"description": "reset", "content": {"application/json": {"schema": {
                "type": "object", "properties": {"ok": {"const": True}}}}}},
            "409": {"description": "requests hold KV blocks; retry when idle (type conflict)",
                    "content": {"application/json": {"schema": _OPS_ERR}}},
            "503": {"description": "the engine did not answer within 10 s",
                    "content": {"application/json": {"schema": _OPS_ERR}}}}}},
}


def openapi_document(extra_paths: dict[str, Any] | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document (a JSON-ready dict)."""
    obj = {"type": "object"}
    paths: dict[str, Any] = {
        "/health": _get("Ready when the engine answers", _json_ok("ready", obj), 503),
        "/v1/models": _get("The served model (with max_model_len)", _json_ok("list", obj)),
        "/v1/models/{model}": {"get": {
            "summary": "One model card", "parameters": [
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {**_json_ok("model", obj), **_errors(404)}}},
        "/v1/chat/completions": _post("OpenAI Chat Completions", CHAT_REQUEST, _json_ok(
            "chat.completion, or chat.completion.chunk SSE events",
            {"type": "object", "properties": {"usage": _USAGE}}, sse=True)),
        "/v1/responses": _post("OpenAI Responses (stateless)", RESPONSES_REQUEST, _json_ok(
            "response (output items: message / function_call / reasoning), or SSE events "
            "response.created ... response.completed", {"type": "object", "properties": {
                "object": {"const": "response"}, "status": {"type": "string"},
                "output": {"type": "array"}, "usage": {"type": "object", "properties": {
                    "input_tokens": {"type": "integer"},
                    "output_tokens": {"type": "integer"},
                    "total_tokens": {"type": "integer"}}}}}, sse=True)),
        "/v1/completions": _post("OpenAI Completions", COMPLETION_REQUEST, _json_ok(
            "text_completion, or SSE events", {"type": "object",
                                               "properties": {"usage": _USAGE}}, sse=True)),
        "/tokenize": _post("Token ids of a prompt or of chat messages", TOKENIZE_REQUEST,
                           _json_ok("tokens", {"type": "object", "properties": {
                               "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                               "tokens": _TOKEN_IDS}})),
        "/detokenize": _post("Text of token ids", DETOKENIZE_REQUEST, _json_ok(
            "text", {"type": "object", "properties": {"prompt": {"type": "string"}}})),
        "/openapi.json": _get("This document", _json_ok("OpenAPI 3.1", obj)),
        "/internal/stats": _get("Engine stats (loopback clients only)", _json_ok(
            "stats", {"type": "object", "properties": {
                "num_free_blocks": {"type": "integer"}, "num_blocks": {"type": "integer"}}}),
            404, 500, 503),
    }
    paths.update(ANTHROPIC_PATHS)
    paths.update(OPERATIONS_PATHS)
    paths.update(extra_paths or {})
    return {
        "openapi": "3.1.0",
        "info": {"title": "Kestrel", "version": "0.1.0",
                 "description": "OpenAI-compatible LLM inference server, with "
                                "Anthropic's Messages API under /v1/messages."},
        "paths": paths,
        "components": {"schemas": {"Error": {
            "type": "object", "required": ["error"], "properties": {"error": {
                "type": "object", "required": ["message", "type"], "properties": {
                    "message": {"type": "string"}, "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]}}}}},
            "AnthropicError": {
                "type": "object", "required": ["type", "error"], "properties": {
                    "type": {"const": "error"}, "error": {
                        "type": "object", "required": ["type", "message"], "properties": {
                            "type": {"type": "string"}, "message": {"type": "string"}}}}}}},
    }
