"""Speculative decoding is lossless through the HTTP API, for every proposer (issue 15).

The real SmolLM2 is served once without speculation and once per proposer with
`--speculative-config` (policy "fixed": every decode verifies k drafts, so nothing is left to
the policy's choice): n-gram prompt lookup, a draft model (a dummy 2-layer draft of the
target's shape), an EAGLE head and a DFlash block drafter (random weights: their drafts are
mostly rejected, which is what has to leave no trace). Every server has the same small KV
cache, so the concurrent pass preempts (checked in `/internal/stats`).

The same requests go to each, greedy: 8 chat prompts (half ask to repeat a text, so n-gram
drafts are accepted), each once at concurrency 1 and again at concurrency 8 (the second
round hits the prefix cache, and runs every answer to max_tokens, `ignore_eos`, so that the
8 outgrow the KV cache), plus one with a JSON-schema response format, one with a stop
string and one with logprobs (top 2). The outputs must be equal token for token (text,
finish reason and completion tokens) to the server without speculation's, and the logprobs
equal within 1e-3 (fp32 on the CPU; the verify step and a plain decode run the same math in
a different batch shape).
"""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import pytest

from tests.e2e.server import KestrelServer

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 40
K = 3
TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
        "single step. All that glitters is not gold.")
CODE = "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
PROMPTS = [
    f"Repeat this text exactly: {TEXT}",
    f"Repeat this code exactly:\n{CODE}",
    f"Copy the following sentence twice: {TEXT[:60]}",
    f"Rewrite this code with the function named plus:\n{CODE}",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "Explain in one sentence what a prime number is.",
]
PROPOSERS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": K, "policy": "fixed"},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": K, "policy": "fixed",
                    "load_format": "dummy", "draft_num_layers": 2},
    "eagle": {"method": "eagle", "num_speculative_tokens": K, "policy": "fixed", "load_format": "dummy"},
    "dflash": {"method": "dflash", "num_speculative_tokens": K, "policy": "fixed", "load_format": "dummy"},
}
SERVE_ARGS = ("--kv-cache-gib", "0.015", "--max-model-len", "256", "--max-num-seqs", "8")

pytestmark = pytest.mark.timeout(1800)


def _chat(client: httpx.Client, prompt: str, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _summary(resp: dict) -> tuple:
    c = resp["choices"][0]
    return c["message"]["content"], c["finish_reason"], resp["usage"]["completion_tokens"]


def _run_all(base_url: str) -> dict:
    """Every request of the module doc -> its response JSON, by name."""
    out: dict = {}
    with httpx.Client(base_url=base_url, timeout=600) as client:
        for i, p in enumerate(PROMPTS):
            out[f"c1-{i}"] = _chat(client, p)
        with cf.ThreadPoolExecutor(8) as pool:
            # every answer runs to max_tokens here (ignore_eos), so 8 at once outgrow the KV cache
            futs = {f"c8-{i}": pool.submit(_chat, client, p, ignore_eos=True) for i, p in enumerate(PROMPTS)}
            out.update({k: f.result() for k, f in futs.items()})
        schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"]}
        out["json_schema"] = _chat(client, "Give a person as JSON with a name and an age.",
                                   response_format={"type": "json_schema",
                                                    "json_schema": {"name": "person", "schema": schema}})
        out["stop"] = _chat(client, PROMPTS[0], stop=["fox"])
        out["logprobs"] = _chat(client, PROMPTS[1], logprobs=True, top_logprobs=2)
        stats = client.get("/internal/stats").json()
    out["_stats"] = stats
    return out


def test_the_baseline_preempted(baseline):
    """The concurrent pass outgrew the small KV cache (so every proposer is checked across a
    preemption), and every block came back."""
    stats = baseline["_stats"]
    assert stats["num_preemptions"] > 0, stats
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"], stats


@pytest.fixture(scope="module")
def baseline(smollm2_dir) -> dict:
    srv = KestrelServer(str(smollm2_dir), *SERVE_ARGS).start()
    try:
        return _run_all(srv.base_url)
    finally:
        srv.stop()


@pytest.mark.parametrize("name", list(PROPOSERS))
def test_greedy_output_with_speculation_equals_output_without(smollm2_dir, baseline, name):
    srv = KestrelServer(str(smollm2_dir), *SERVE_ARGS, "--speculative-config", json.dumps(PROPOSERS[name])).start()
    try:
        got = _run_all(srv.base_url)
    finally:
        srv.stop()
    stats = got.pop("_stats")
    for key, want in baseline.items():
        if key == "_stats":
            continue
        assert _summary(got[key]) == _summary(want), (name, key)
    # the grammar held over accepted drafts
    person = json.loads(got["json_schema"]["choices"][0]["message"]["content"])
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    assert got["stop"]["choices"][0]["finish_reason"] == "stop" and "fox" not in _summary(got["stop"])[0]
    lp_got = got["logprobs"]["choices"][0]["logprobs"]["content"]
    lp_want = baseline["logprobs"]["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in lp_got] == [t["token"] for t in lp_want]
    for a, b in zip(lp_got, lp_want):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-3)
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
    # speculation really ran, the concurrent pass preempted, and every block came back
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_draft_tokens"] > 0, stats
    if name == "ngram":  # the repeat prompts are accepted
        assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert stats["num_preemptions"] > 0, stats
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"], stats
