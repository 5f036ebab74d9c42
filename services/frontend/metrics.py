"""Prometheus metrics of one frontend process: `GET /metrics` (docs/ARCHITECTURE.md §8).

Names follow vLLM's (prefix `kestrel:` instead of `vllm:`), so existing dashboards work
with the prefix changed. Every metric has the label `model_name`.

Recorded here, per request, by the generation path (`RequestTimer`, used by
services/frontend/generation.py for every API):
- `kestrel:time_to_first_token_seconds` (histogram): from the request's submission to the
  engine to its first output token, seconds.
- `kestrel:inter_token_latency_seconds` (histogram): between two outputs of one request
  that carry tokens, seconds (one observation per output; vLLM: per engine iteration).
- `kestrel:time_per_output_token_seconds` (histogram): per request, (e2e - TTFT) /
  (output tokens - 1), seconds; only for requests with 2 or more output tokens.
- `kestrel:e2e_request_latency_seconds` (histogram): submission to the last output, seconds.
- `kestrel:prompt_tokens_total`, `kestrel:generation_tokens_total` (counters, tokens):
  prompt and output tokens of finished (and aborted) requests, the same counts the API
  returns as usage.
- `kestrel:request_success_total{finished_reason}` (counter): finished requests by reason.

Read from the engine at scrape time (its `stats` utility, 0.5 s timeout; the last answer is
reused when the engine does not answer; these describe the whole engine, shared by every
frontend):
- `kestrel:num_requests_running`, `kestrel:num_requests_waiting` (gauges, requests).
- `kestrel:kv_cache_usage_perc` (gauge, fraction 0..1 of KV blocks held by requests).
- `kestrel:kv_tier_hits_total{tier}` (counter, tokens loaded from the kvstore's "cpu" or
  "disk" tier; only when the engine runs with the kvstore)
- `kestrel:kv_load_failures_total` (counter, steps whose tier loads failed in the worker:
  their requests were recomputed instead, docs/ARCHITECTURE.md §4.5; 0 without the kvstore)
- `kestrel:kv_tier_state_hits_total{tier}` (counter, a hybrid model's recurrent-state
  checkpoints loaded from a tier, docs/ARCHITECTURE.md §4.7; only for a hybrid model)
- `kestrel:prefix_cache_queries_total`, `kestrel:prefix_cache_hits_total` (counters, tokens
  looked up / found in the prefix cache since the engine started).
- `kestrel:worker_jit_compiles_total` (counter): Triton compiles and CUDA graph captures the
  worker met after it was ready (services/worker/jit_watch.py; 0 when the startup warm-ups
  covered every launch, always 0 on the CPU's torch references).
- `kestrel:engine_up` (gauge): 1 when the last stats call answered.
- Speculative decoding (only when the engine runs with `--speculative-config`;
  docs/ARCHITECTURE.md §5.5), counters as vLLM's: `kestrel:spec_decode_num_drafts` (seqs
  that verified drafts), `kestrel:spec_decode_num_draft_tokens` (drafts verified),
  `kestrel:spec_decode_num_accepted_tokens` (drafts accepted), and
  `kestrel:spec_decode_num_accepted_tokens_per_pos{position}` (seqs whose draft at
  position 0.. was accepted). Mean acceptance length = 1 + accepted_tokens / drafts
  (the engine also logs it periodically); acceptance rate = accepted_tokens / draft_tokens.

Several frontends (`kestrel serve --frontends N`, N > 1): the supervisor sets
`PROMETHEUS_MULTIPROC_DIR` for them, so the per-request metrics above are kept in
prometheus_client's multiprocess files (made owner-only) and every frontend's /metrics
answers their sum over all the frontends (a scrape reaches any one of them).

Read from the supervisor (`<runtime_dir>/restarts.json`, `{"<process>": count}`, written by
services/supervisor/restart.py at start and after every restart):
- `kestrel:process_restarts_total{process}` (counter): restarts per supervised process.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.requests import Request
from starlette.responses import Response

from shared.protocol import FinishReason
from shared.restart_counts import read_restart_counts

log = logging.getLogger("kestrel.frontend.metrics")

STATS_TIMEOUT_S = 0.5

# vLLM's buckets (vllm/engine/metrics.py), seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class RequestMetrics:
    """The per-request metrics of one frontend process, in their own registry.

    `set_model(name)` names the served model (the `model_name` label) once at startup;
    until then the label is "unknown"."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, ["model_name"]
        self.ttft = Histogram("kestrel:time_to_first_token_seconds",
                              "Time to first token, seconds.", label, registry=r,
                              buckets=TTFT_BUCKETS)
        self.itl = Histogram("kestrel:inter_token_latency_seconds",
                             "Time between two outputs of a request, seconds.", label,
                             registry=r, buckets=TPOT_BUCKETS)
        self.tpot = Histogram("kestrel:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request, "
                              "seconds.", label, registry=r, buckets=TPOT_BUCKETS)
        self.e2e = Histogram("kestrel:e2e_request_latency_seconds",
                             "End-to-end request latency, seconds.", label, registry=r,
                             buckets=E2E_BUCKETS)
        self.prompt_tokens = Counter("kestrel:prompt_tokens", "Prompt tokens processed.",
                                     label, registry=r)
        self.generation_tokens = Counter("kestrel:generation_tokens",
                                         "Generation tokens produced.", label, registry=r)
        self.success = Counter("kestrel:request_success", "Finished requests.",
                               label + ["finished_reason"], registry=r)
        self.model_name = "unknown"
        # The ITL child of model_name, looked up once (ITL is observed per output); None
        # until set_model, so that no "unknown" series shows before it is observed.
        self.itl_child: Any = None

    def set_model(self, model_name: str) -> None:
        """Label every series with `model_name` from now on, and create the labelled
        series so that they show (at 0) before any request."""
        self.model_name = model_name
        self.itl_child = self.itl.labels(model_name)
        for metric in (self.ttft, self.itl, self.tpot, self.e2e, self.prompt_tokens,
                       self.generation_tokens):
            metric.labels(model_name)


disable_created_metrics()  # no `*_created` series (as vLLM): they only add noise
# set by the supervisor for several frontends: prometheus_client then keeps every value in
# files there (read at its import); /metrics sums the files of all the frontends
MULTIPROC_DIR = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
if MULTIPROC_DIR:
    os.umask(os.umask(0o077) | 0o077)  # the value files are owner-only, as the folder
METRICS = RequestMetrics()  # one per frontend process (the serving context holds it)


class RequestTimer:
    """Times one request for the histograms of `metrics`. Create it when the request is
    sent to the engine; call `tokens(n)` for each output carrying n > 0 tokens and
    `finish(...)` once."""

    __slots__ = ("m", "start", "first", "last", "done")

    def __init__(self, metrics: RequestMetrics, start: float | None = None) -> None:
        """start: time.monotonic() of the submission to the engine (default: now)."""
        self.m = metrics
        self.start = time.monotonic() if start is None else start
        self.first: float | None = None
        self.last: float | None = None
        self.done = False

    def tokens(self, n: int) -> None:
        """An output with n new tokens arrived now."""
        if n <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.m.ttft.labels(self.m.model_name).observe(now - self.start)
        elif self.last is not None:
            child = self.m.itl_child
            if child is None:
                child = self.m.itl_child = self.m.itl.labels(self.m.model_name)
            child.observe(now - self.last)
        self.last = now

    def finish(self, reason: str | None, prompt_tokens: int, output_tokens: int) -> None:
        """The request ended (reason: stop, length, abort, error ...); tokens as in usage."""
        if self.done:
            return
        self.done = True
        m = self.m
        name = m.model_name
        now = time.monotonic()
        m.prompt_tokens.labels(name).inc(prompt_tokens)
        m.generation_tokens.labels(name).inc(output_tokens)
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            m.e2e.labels(name).observe(now - self.start)
            if self.first is not None and output_tokens > 1:
                m.tpot.labels(name).observe((now - self.first) / (output_tokens - 1))
        m.success.labels(name, reason or "abort").inc()


class _EngineCollector:
    """Engine gauges and counters from one `stats` answer, and restart counts."""

    def __init__(self, model_name: str, stats: dict[str, Any] | None, up: bool,
                 restarts: dict[str, int]):
        self.model_name, self.stats, self.up, self.restarts = model_name, stats, up, restarts

    def collect(self):
        m = [self.model_name]
        up = GaugeMetricFamily("kestrel:engine_up", "1 when the engine answered the last "
                               "stats call.", labels=["model_name"])
        up.add_metric(m, 1.0 if self.up else 0.0)
        yield up
        s = self.stats
        if s is not None:
            for name, key, doc in (
                    ("num_requests_running", "num_running", "Requests running in the engine."),
                    ("num_requests_waiting", "num_waiting", "Requests waiting in the engine."),
                    ("kv_cache_usage_perc", "kv_usage",
                     "Fraction of KV cache blocks in use by requests (0..1).")):
                g = GaugeMetricFamily("kestrel:" + name, doc, labels=["model_name"])
                g.add_metric(m, float(s.get(key, 0)))
                yield g
            for name, key, doc in (
                    ("prefix_cache_queries", "prefix_cache_queries",
                     "Prompt tokens looked up in the prefix cache."),
                    ("prefix_cache_hits", "prefix_cache_hits",
                     "Prompt tokens found in the prefix cache."),
                    ("worker_jit_compiles", "worker_jit_compiles",
                     "Triton kernel compiles and CUDA graph captures in the worker after it was "
                     "ready (each one stalls its step)."),
                    ("kv_load_failures", "kv_load_failures",
                     "Steps whose kvstore tier loads failed in the worker; their requests were "
                     "recomputed.")):
                c = CounterMetricFamily("kestrel:" + name, doc, labels=["model_name"])
                c.add_metric(m, float(s.get(key, 0)))
                yield c
            if "spec_decode_num_drafts" in s:  # the engine speculates
                yield from _spec_counters(m, s)
            if "kv_tier_hits_cpu" in s:   # the engine runs with the kvstore (KV tiers)
                c = CounterMetricFamily("kestrel:kv_tier_hits", "Prompt tokens loaded from a "
                                        "kvstore tier instead of computed.",
                                        labels=["model_name", "tier"])
                for tier in ("cpu", "disk"):
                    c.add_metric(m + [tier], float(s.get(f"kv_tier_hits_{tier}", 0)))
                yield c
            if "kv_tier_state_hits_cpu" in s:   # a hybrid model's state checkpoints (§4.7)
                c = CounterMetricFamily("kestrel:kv_tier_state_hits", "Recurrent-state checkpoints "
                                        "loaded from a kvstore tier.", labels=["model_name", "tier"])
                for tier in ("cpu", "disk"):
                    c.add_metric(m + [tier], float(s.get(f"kv_tier_state_hits_{tier}", 0)))
                yield c
        r = CounterMetricFamily("kestrel:process_restarts",
                                "Restarts of each supervised process.", labels=["process"])
        for proc, n in sorted(self.restarts.items()):
            r.add_metric([proc], float(n))
        yield r


SPEC_COUNTERS = (
    ("spec_decode_num_drafts", "Sequences that verified draft tokens (speculative decoding)."),
    ("spec_decode_num_draft_tokens", "Draft tokens verified."),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
)


def _spec_counters(m: list[str], s: dict[str, Any]):
    """The speculative decoding counters of one stats answer (module doc)."""
    for name, doc in SPEC_COUNTERS:
        c = CounterMetricFamily("kestrel:" + name, doc, labels=["model_name"])
        c.add_metric(m, float(s.get(name, 0)))
        yield c
    c = CounterMetricFamily("kestrel:spec_decode_num_accepted_tokens_per_pos",
                            "Sequences whose draft at this position (0 = the first) was accepted.",
                            labels=["model_name", "position"])
    for pos, n in enumerate(s.get("spec_decode_num_accepted_tokens_per_pos", [])):
        c.add_metric(m + [str(pos)], float(n))
    yield c


def read_restarts(runtime_dir: str | None) -> dict[str, int]:
    """Restart counts per process from the supervisor's `<runtime_dir>/restarts.json`
    (services/supervisor/restart.py); {} when there is none."""
    if not runtime_dir:
        return {}
    return read_restart_counts(runtime_dir)


class MetricsEndpoint:
    """`GET /metrics` for one app: request metrics + the engine's stats at scrape time.

    engine: an EngineClient (call_utility). metrics: the process's RequestMetrics, already
    named with the served model (`set_model`). runtime_dir: where the supervisor's
    restarts.json lives (cfg.runtime_dir).
    """

    def __init__(self, engine: Any, metrics: RequestMetrics, runtime_dir: str | None):
        self.engine = engine
        self.metrics = metrics
        self.runtime_dir = runtime_dir
        self.last_stats: dict[str, Any] | None = None

    async def __call__(self, request: Request) -> Response:
        """GET /metrics: Prometheus text; open without a key (auth.py)."""
        up = True
        try:
            self.last_stats = await self.engine.call_utility("stats", timeout=STATS_TIMEOUT_S)
        except Exception as e:  # engine slow or gone: serve the last stats, engine_up 0
            up = False
            log.debug("stats call failed: %s", e)
        extra = CollectorRegistry(auto_describe=False)
        extra.register(_EngineCollector(self.metrics.model_name, self.last_stats, up,
                                        read_restarts(self.runtime_dir)))
        requests = self.metrics.registry
        if MULTIPROC_DIR:  # every frontend's request metrics, summed
            requests = CollectorRegistry(auto_describe=False)
            MultiProcessCollector(requests, MULTIPROC_DIR)
        body = generate_latest(requests) + generate_latest(extra)
        return Response(body, media_type=CONTENT_TYPE_LATEST)
