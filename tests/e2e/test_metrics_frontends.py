"""`kestrel serve --frontends 2`: a Prometheus scrape of /metrics reaches whichever frontend
the kernel picks (SO_REUSEPORT), so every scrape must show the request counters of all the
frontends (they used to be per process: counters went up and down between scrapes)."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server import KestrelServer

pytestmark = pytest.mark.timeout(300)

MODEL = "SmolLM2-135M-Instruct"
SUMMED = ("kestrel:prompt_tokens_total", "kestrel:generation_tokens_total",
          "kestrel:request_success_total", "kestrel:e2e_request_latency_seconds_count")


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = KestrelServer(str(smollm2_dir), "--frontends", "2").start()
    yield srv
    srv.stop()


def _scrape(base_url: str) -> dict[str, float]:
    """One scrape on a new connection (each may reach another frontend): {name: total}."""
    with httpx.Client(base_url=base_url, timeout=60) as c:
        text = c.get("/metrics").text
    out = dict.fromkeys(SUMMED, 0.0)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in out:
                out[s.name] += s.value
    return out


def test_every_frontend_scrape_counts_the_requests_of_all_frontends(server):
    before = _scrape(server.base_url)
    prompt = completion = 0
    for i in range(8):  # a new connection each: the kernel spreads them over both frontends
        with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                           timeout=120) as client:
            r = client.completions.create(model=MODEL, prompt=f"Count to {i + 2}:",
                                          max_tokens=3, temperature=0)
        prompt += r.usage.prompt_tokens
        completion += r.usage.completion_tokens
    want = {"kestrel:prompt_tokens_total": prompt, "kestrel:generation_tokens_total": completion,
            "kestrel:request_success_total": 8, "kestrel:e2e_request_latency_seconds_count": 8}
    for _ in range(12):
        after = _scrape(server.base_url)
        assert {k: after[k] - before[k] for k in SUMMED} == want
