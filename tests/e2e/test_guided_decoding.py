"""vLLM's structured-output request options on a real `kestrel serve` (SmolLM2-135M-Instruct on
CPU): the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` and the newer
`structured_outputs` object, on chat and completions, through the HTTP API.

They used to be ignored (200, unconstrained). Each answer is checked with an independent
reader: `re.fullmatch` for a regex, membership for a choice list, `json.loads` +
`jsonschema.validate` for a schema. Sampling is at temperature 1 with a seed, so that only the
constraint makes the answer obey it. (The 400s of the fields are in
tests/unit/test_frontend_structured_fields.py, on the fake engine.)
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.e2e.server import KestrelServer

jsonschema = pytest.importorskip("jsonschema")

MODEL = "SmolLM2-135M-Instruct"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "rank"], "additionalProperties": False}
CHOICES = ["alpha", "beta", "gamma delta", 'quote "q"']
GRAMMAR = 'root ::= "id-" [a-c] [0-9] [0-9]'


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = KestrelServer(str(smollm2_dir), "--max-model-len", "1024").start()
    yield srv
    srv.stop()


def _answer(server, route: str, extra: dict, seed: int) -> tuple[str, str]:
    body = {"model": MODEL, "temperature": 1.0, "seed": seed, "max_tokens": 48, **extra}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "Answer with anything you like."}]
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    else:
        body["prompt"] = "Answer:"
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if route == "chat" else choice["text"]
    return text, choice["finish_reason"]


def _checks():
    three_digits = lambda t: re.fullmatch(r"[0-9]{3}", t) is not None  # noqa: E731
    one_of = lambda t: t in CHOICES  # noqa: E731
    grammar = lambda t: re.fullmatch(r"id-[a-c][0-9][0-9]", t) is not None  # noqa: E731

    def schema(t: str) -> bool:
        jsonschema.validate(json.loads(t), SCHEMA)
        return True

    def any_json(t: str) -> bool:  # xgrammar's builtin JSON grammar, as response_format json_object
        json.loads(t)
        return True
    return [
        ("guided_regex", {"guided_regex": "[0-9]{3}"}, three_digits),
        ("guided_choice", {"guided_choice": CHOICES}, one_of),
        ("guided_json", {"guided_json": SCHEMA}, schema),
        ("guided_json text", {"guided_json": json.dumps(SCHEMA)}, schema),
        ("guided_grammar", {"guided_grammar": GRAMMAR}, grammar),
        ("structured_outputs.regex", {"structured_outputs": {"regex": "[0-9]{3}"}}, three_digits),
        ("structured_outputs.choice", {"structured_outputs": {"choice": CHOICES}}, one_of),
        ("structured_outputs.json", {"structured_outputs": {"json": SCHEMA}}, schema),
        ("structured_outputs.grammar", {"structured_outputs": {"grammar": GRAMMAR}}, grammar),
        ("structured_outputs.json_object", {"structured_outputs": {"json_object": True}}, any_json),
    ]


CHECKS = _checks()


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("name,extra,obeys", CHECKS, ids=[c[0] for c in CHECKS])
def test_the_answer_obeys_the_vllm_structured_output_option(server, route, name, extra, obeys):
    for seed in (1, 2):
        text, finish = _answer(server, route, extra, seed)
        if name.endswith("json_object"):
            if finish != "stop":  # an open JSON object may run to max_tokens; then it is a prefix
                assert text.lstrip()[:1] in ("{", "["), text
                continue
        assert finish == "stop", (name, text, finish)
        assert obeys(text), (name, text)
