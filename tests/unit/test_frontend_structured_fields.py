"""The structured-output request fields' refusals on the fake-engine stack: vLLM's guided_*
and structured_outputs (services/frontend/structured_fields.py), and a forced tool call's
schema checked up front. Every one is a 400 in OpenAI's envelope naming the field, before the
engine (that the accepted ones constrain the output: tests/e2e/test_guided_decoding.py)."""

from __future__ import annotations

import httpx
import pytest

from services.frontend.structured_fields import choice_grammar
from shared.protocol import StructuredSpec
from tests.unit import test_frontend_support as support
from tests.unit.test_frontend_support import HI, MODEL

stack = support.stack  # module-scoped fixture

REFUSED = [
    ("bad regex", {"guided_regex": "[0-9"}, "guided_regex", "The regex cannot be compiled"),
    ("bad grammar", {"guided_grammar": "root ::= "}, "guided_grammar", "The grammar cannot be compiled"),
    ("bad schema", {"guided_json": {"type": "nonsense"}}, "guided_json", "The JSON schema cannot"),
    ("schema text not JSON", {"guided_json": "{nope"}, "guided_json", "must be a JSON schema"),
    ("empty choice", {"guided_choice": []}, "guided_choice", "non-empty strings"),
    ("choice of numbers", {"guided_choice": [1, 2]}, "guided_choice", "non-empty strings"),
    ("two guided kinds", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "Only one"),
    ("whitespace pattern", {"guided_json": {}, "guided_whitespace_pattern": " "},
     "guided_whitespace_pattern", "not supported"),
    ("structural_tag", {"structural_tag": "{}"}, "structural_tag", "not supported"),
    ("other backend", {"guided_regex": "a", "guided_decoding_backend": "outlines"},
     "guided_decoding_backend", "xgrammar"),
    ("structured_outputs not an object", {"structured_outputs": "json"}, "structured_outputs",
     "must be an object"),
    ("structured_outputs empty", {"structured_outputs": {}}, "structured_outputs", "must set one of"),
    ("structured_outputs two kinds", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs.choice", "only one"),
    ("structured_outputs unknown key", {"structured_outputs": {"regex": "a", "backend": "x"}},
     "structured_outputs.backend", "Unknown field"),
    ("structured_outputs whitespace_pattern", {"structured_outputs": {"json": {}, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "not supported"),
    ("structured_outputs bad regex", {"structured_outputs": {"regex": "(("}},
     "structured_outputs.regex", "The regex cannot be compiled"),
    ("guided and response_format", {"response_format": {"type": "json_object"}, "guided_regex": "a"},
     "guided_regex", "cannot be combined with 'response_format'"),
    ("guided and structured_outputs", {"guided_regex": "a", "structured_outputs": {"regex": "b"}},
     "structured_outputs.regex", "cannot be combined with 'guided_regex'"),
    ("guided and a forced tool", {"guided_regex": "a", "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": "required"}, "guided_regex", "cannot be combined with tool_choice"),
]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("name,extra,param,says", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_structured_output_option_that_cannot_work_is_a_400_naming_it(stack, route, name, extra,
                                                                        param, says):
    if route == "/v1/completions" and "tools" in extra:
        pytest.skip("completions have no tools")
    body = {"model": MODEL, "max_tokens": 4, **extra}
    body |= {"messages": HI} if route == "/v1/chat/completions" else {"prompt": "hi"}
    n_added = len(stack.engine.added)
    r = httpx.post(stack.url + route, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", param), err
    assert says in err["message"], err
    assert len(stack.engine.added) == n_added  # never reached the engine


@pytest.mark.parametrize("extra,spec", [
    ({"guided_regex": "[0-9]{3}"}, StructuredSpec("regex", "[0-9]{3}")),
    ({"structured_outputs": {"choice": ["a", "b"], "disable_fallback": True}},
     StructuredSpec("grammar", 'root ::= "a" | "b"')),
    ({"guided_json": {"type": "object"}}, StructuredSpec("json_schema", '{"type":"object"}')),
    ({"structured_outputs": {"json_object": True}}, StructuredSpec("json_object")),
    ({"guided_grammar": 'root ::= "x"', "guided_decoding_backend": "xgrammar"},
     StructuredSpec("grammar", 'root ::= "x"')),
])
def test_an_accepted_option_reaches_the_engine_as_its_constraint(stack, extra, spec):
    r = httpx.post(stack.url + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": HI, "max_tokens": 4, **extra})
    assert r.status_code == 200, r.text
    assert stack.engine.added[-1].sampling.structured == spec


def test_a_choice_grammar_escapes_quotes_and_backslashes_and_compiles():
    xgrammar = pytest.importorskip("xgrammar")
    text = choice_grammar(['say "hi"', "a\\b", "é"])
    assert text == 'root ::= "say \\"hi\\"" | "a\\\\b" | "é"'
    xgrammar.Grammar.from_ebnf(text)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_forced_tools_schema_that_does_not_compile_is_a_400_naming_it_before_the_engine(
        stack, choice):
    """It was the engine's refusal: 400 "The engine rejected the request: json_schema failed
    to compile", param null, and an ERROR log line."""
    tools = [{"type": "function", "function": {"name": "g"}},
             {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    n_added = len(stack.engine.added)
    r = httpx.post(stack.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": HI, "tools": tools, "tool_choice": choice})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools[1].function.parameters", err
    assert "The JSON schema cannot be compiled" in err["message"]
    assert len(stack.engine.added) == n_added
