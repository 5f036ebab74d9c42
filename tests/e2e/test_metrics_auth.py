"""`kestrel serve` with --api-key, as a user runs it: the key on every API route, /metrics
in Prometheus text, the startup log (settings with sources, startup report), and the file
modes of shm segments and ipc sockets. One server for the module."""

from __future__ import annotations

import json
import os
import re
import stat

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.config import FIELDS
from tests.e2e.server import KestrelServer, segments

pytestmark = pytest.mark.timeout(300)

KEY = "kestrel-test-key-7f3a"
MODEL = "SmolLM2-135M-Instruct"
SOURCES = r"(default|env|config file|cli|derived|profile:[a-z0-9]+)"

# Routes of docs/ARCHITECTURE.md §7.2 and issue 6, whether or not they are registered yet: the key check comes
# before routing, so each must answer 401 without the key.
API_ROUTES = [
    ("GET", "/v1/models"), ("GET", "/v1/models/" + MODEL), ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"),
    ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("GET", "/openapi.json"),
    ("POST", "/reset_prefix_cache"), ("GET", "/no/such/route"), ("GET", "/healthz"),
    ("GET", "/metrics/extra"),
]


def _registered_routes() -> list[tuple[str, str]]:
    """Every route the frontend app registers (read from the app, never started)."""
    from services.frontend.server import create_app
    from shared.config import build_config

    app = create_app(build_config({"api_key": KEY}, env={}))
    out = []
    for r in app.routes:
        path = re.sub(r"\{[^}]+\}", "x", getattr(r, "path", ""))
        for m in sorted(getattr(r, "methods", None) or {"GET"}):
            if m != "HEAD" and path:
                out.append((m, path))
    return out


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = KestrelServer(str(smollm2_dir), "--api-key", KEY).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def _is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def _assert_401(r: httpx.Response, path: str) -> None:
    assert r.status_code == 401, (path, r.status_code, r.text)
    body = r.json()
    if _is_anthropic(path):
        assert body["type"] == "error", body
        assert body["error"]["type"] == "authentication_error", body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    else:
        assert set(body) == {"error"}, body
        assert body["error"]["type"] == "authentication_error", body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def test_every_api_route_rejects_a_missing_or_wrong_key_in_its_own_envelope(server, http):
    routes = sorted(set(API_ROUTES) | set(_registered_routes()))
    checked = 0
    for method, path in routes:
        if path in ("/health", "/metrics"):
            continue
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"x-api-key": "wrong-key"},
                        {"Authorization": "Basic " + KEY}, {"x-api-key": KEY + "x"}):
            r = http.request(method, path, headers=headers, content=b"{}")
            _assert_401(r, path)
            checked += 1
    assert checked >= 5 * len(API_ROUTES)


def test_health_and_metrics_are_open_without_a_key(http):
    assert http.get("/health").status_code == 200
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")


def test_both_header_forms_are_accepted(http):
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        r = http.get("/v1/models", headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["data"][0]["id"] == MODEL


def _metrics(http) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}} parsed by prometheus_client's parser."""
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(http.get("/metrics").text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _total(m, name) -> float:
    return sum(m.get(name, {}).values())


def test_metrics_count_the_requests_and_tokens_the_api_reported(server, http):
    before = _metrics(http)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0,
                           timeout=120)
    kw = dict(model=MODEL, temperature=0, max_tokens=12)
    prompt = completion = 0
    for text in ("Name a color.", "Count to three."):
        r = client.chat.completions.create(messages=[{"role": "user", "content": text}], **kw)
        prompt += r.usage.prompt_tokens
        completion += r.usage.completion_tokens
    chunks = list(client.chat.completions.create(
        messages=[{"role": "user", "content": "Say hello."}], stream=True,
        stream_options={"include_usage": True}, **kw))
    usage = chunks[-1].usage
    prompt += usage.prompt_tokens
    completion += usage.completion_tokens

    after = _metrics(http)

    def delta(name):
        return _total(after, name) - _total(before, name)

    assert delta("kestrel:prompt_tokens_total") == prompt
    assert delta("kestrel:generation_tokens_total") == completion
    assert delta("kestrel:time_to_first_token_seconds_count") == 3
    assert delta("kestrel:e2e_request_latency_seconds_count") == 3
    assert delta("kestrel:e2e_request_latency_seconds_sum") > 0
    assert delta("kestrel:time_to_first_token_seconds_sum") > 0
    assert delta("kestrel:inter_token_latency_seconds_count") >= completion - 3
    assert delta("kestrel:time_per_output_token_seconds_count") >= 1
    # +Inf bucket equals the count (a well-formed histogram).
    inf = {k: v for k, v in after["kestrel:e2e_request_latency_seconds_bucket"].items()
           if dict(k)["le"] == "+Inf"}
    assert sum(inf.values()) == _total(after, "kestrel:e2e_request_latency_seconds_count")
    # Engine-side series, from its stats utility.
    assert _total(after, "kestrel:engine_up") == 1
    assert _total(after, "kestrel:num_requests_running") == 0
    assert _total(after, "kestrel:num_requests_waiting") == 0
    assert 0 <= _total(after, "kestrel:kv_cache_usage_perc") <= 1
    queries = _total(after, "kestrel:prefix_cache_queries_total")
    assert queries - _total(before, "kestrel:prefix_cache_queries_total") >= prompt - 3
    assert 0 <= _total(after, "kestrel:prefix_cache_hits_total") <= queries
    restarts = after["kestrel:process_restarts_total"]
    assert {dict(k)["process"] for k in restarts} >= {"engine", "worker-0", "frontend-0"}
    assert all(v == 0 for v in restarts.values())


def test_reset_prefix_cache_needs_the_key_and_succeeds_when_idle(http):
    _assert_401(http.post("/reset_prefix_cache"), "/reset_prefix_cache")
    r = http.post("/reset_prefix_cache", headers={"x-api-key": KEY})
    assert r.status_code == 200, r.text
    assert r.json() == {"ok": True}


def _full_log(server) -> str:
    with open(server.log.name) as fh:
        return fh.read()


def test_startup_log_lists_every_setting_with_its_source_and_the_report(server):
    log = _full_log(server)
    for f in FIELDS:
        assert re.search(rf"^\s+{f.name}\s+.*\[{SOURCES}\]$", log, re.M), f.name
    assert re.search(r"^\s+api_key\s+'\*\*\*'\s+\[cli\]$", log, re.M)
    assert KEY not in log  # the key is never printed
    assert re.search(r"^\s+max_num_seqs\s+16\s+\[profile:cpu\]$", log, re.M) or \
        re.search(r"^\s+max_num_seqs\s+\d+\s+\[profile:\w+\]$", log, re.M)
    report = [line.split("startup report: ", 1)[1] for line in log.splitlines()
              if "[supervisor]" in line and "startup report: " in line]
    text = "\n".join(report)
    for part in ("device: ", "kernels: attention", "memory: weights ", " GiB, KV cache ",
                 "graph sizes: ", "KV blocks: ", " KV tokens", "phases: load ", "ready "):
        assert part in text, (part, text)


def test_segments_sockets_and_runtime_files_are_owner_only(server):
    segs = segments(server.instance_id)
    assert segs, "the plan ring segment should exist"
    for path in segs:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    runtime = f"/tmp/kestrel-{server.instance_id}"
    assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o700
    socks = [os.path.join(runtime, n) for n in os.listdir(runtime)
             if stat.S_ISSOCK(os.stat(os.path.join(runtime, n)).st_mode)]
    assert len(socks) >= 2, os.listdir(runtime)
    for path in socks + [os.path.join(runtime, "config.json"),
                         os.path.join(runtime, "startup_report.json")]:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    with open(os.path.join(runtime, "startup_report.json")) as fh:
        assert json.load(fh)["kv_tokens"] > 0


def test_only_the_http_port_listens_on_tcp_and_only_on_loopback(server):
    procs = [psutil.Process(server.proc.pid)] + server.children()
    listening = []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet") if hasattr(p, "net_connections") \
                else p.connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        listening += [c.laddr for c in conns if c.status == psutil.CONN_LISTEN]
    assert listening, "the frontend should listen"
    assert all(a.ip == "127.0.0.1" for a in listening), listening
    assert {a.port for a in listening} == {server.port}, listening
