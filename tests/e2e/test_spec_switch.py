"""Speculation switched off and on at runtime through the HTTP API (POST /debug/speculation,
docs/ARCHITECTURE.md §5.5), on a real `kestrel serve` on the CPU: the tiny-qwen3 config of
benchmarks/configs with dummy weights and a synthetic tokenizer, n-gram speculation with
policy "fixed" (every decode is looked up while on: the adaptive policy's choice would
depend on this machine's step costs) and --debug-utilities.

Switched off, a request whose prompt repeats a run of ids (n-gram lookup finds drafts in
it) runs without a lookup, a proposal, a verify step or a probe (the engine's counters in
/internal/stats stay, `spec_disabled` is true); switched on, the same request is looked up
again and verifies drafts. A bad body is a 400 and changes nothing. Then
benchmarks/spec_serve.py --tiny --one-server (one round) finishes and its JSON says that
every plain run on the one server did no speculative work while its spec runs did.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest

from benchmarks.common import write_synthetic_tokenizer
from tests.e2e.server import KestrelServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"}
PROMPT = [101, 202, 303, 404, 505, 606] * 5  # a repeated run: n-gram lookup finds its continuation
MAX_TOKENS = 24
WORK = ("spec_ngram_lookups", "spec_ngram_lookup_waits", "spec_decode_num_proposals", "spec_decode_num_probes",
        "spec_decode_num_spec_steps", "spec_decode_num_drafts", "spec_decode_num_draft_tokens")

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-qwen3")
    shutil.copy(os.path.join(ROOT, "benchmarks", "configs", "tiny-qwen3.json"), d / "config.json")
    write_synthetic_tokenizer(str(d), json.loads((d / "config.json").read_text())["vocab_size"])
    return d


def _complete(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                            "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS


def test_switched_off_over_http_the_engine_does_no_speculative_work_and_on_again_it_does(tiny_dir):
    srv = KestrelServer(str(tiny_dir), "--load-format", "dummy", "--device", "cpu", "--served-model-name", "tiny",
                        "--max-model-len", "256", "--max-num-seqs", "4", "--kv-cache-gib", "0.01",
                        "--speculative-config", json.dumps(SPEC), "--debug-utilities").start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=120) as client:
            stats0 = client.get("/internal/stats").json()
            assert stats0["spec_disabled"] is False
            r = client.post("/debug/speculation", json={"enabled": False})
            assert r.status_code == 200 and r.json() == {"ok": True, "enabled": False}, r.text
            off0 = client.get("/internal/stats").json()
            assert off0["spec_disabled"] is True
            _complete(client)
            off1 = client.get("/internal/stats").json()
            assert off1["num_generated_tokens"] - off0["num_generated_tokens"] == MAX_TOKENS
            assert {k: off1[k] for k in WORK} == {k: off0[k] for k in WORK}, (off0, off1)

            for bad in (b'{"enabled": "yes"}', b"not json", b"{}"):
                r = client.post("/debug/speculation", content=bad)
                assert r.status_code == 400, (bad, r.text)
            assert client.get("/internal/stats").json()["spec_disabled"] is True  # unchanged

            r = client.post("/debug/speculation", json={"enabled": True})
            assert r.status_code == 200 and r.json() == {"ok": True, "enabled": True}, r.text
            _complete(client)
            on1 = client.get("/internal/stats").json()
            assert on1["spec_disabled"] is False
            # "fixed" looks every decode up: about one lookup per output token
            assert on1["spec_ngram_lookups"] - off1["spec_ngram_lookups"] >= MAX_TOKENS // 4, on1
            assert on1["spec_decode_num_proposals"] > off1["spec_decode_num_proposals"], on1
            # the repeated prompt (and the seeded dummy model's own loops) gives drafts to verify
            assert on1["spec_decode_num_spec_steps"] > off1["spec_decode_num_spec_steps"], on1
    finally:
        srv.stop()
    assert srv.proc.returncode == 0, srv.log_tail()


def test_spec_serve_one_server_smoke_run(tmp_path):
    out = tmp_path / "one.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "spec_serve.py"), "--tiny", "--one-server",
                        "--repeats", "1", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=500)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["one_server"] is True and res["complete"] is True
    assert list(res["server_startup_seconds"]) == ["spec"]  # one server only
    spec_lookups = 0
    for lv in res["levels"]:
        for row in lv["kinds"].values():
            [plain], [spec] = row["rounds"]["plain"], row["rounds"]["spec"]
            assert plain["steps"] > 0 and plain["lookups"] == plain["probes"] == plain["spec_steps"] == 0, row
            spec_lookups += spec["lookups"]
    assert spec_lookups > 0
