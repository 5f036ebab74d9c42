"""Speculative decoding's counters (docs/ARCHITECTURE.md §5.5, §8.5): the engine's stats,
their Prometheus export by the frontend (`GET /metrics`, read back with prometheus_client's
own parser) and the engine's periodic log line, each against what the scripted oracle
worker (tests/unit/spec_oracle_rig.py) recorded verifying: seqs, drafts, accepted drafts and
accepted drafts per position."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from services.engine.stats_log import StatsLog, stats_line
from services.frontend.metrics import MetricsEndpoint, RequestMetrics
from shared import protocol as P
from tests.unit.spec_oracle_rig import FakeClock
from tests.unit.test_spec_scheduler import pair, requests, run, spec_json

K = 3


def _run(spec: str | None):
    core, worker = pair(spec, 0.3, 2)
    before = core.stats()
    outbox = run(core, worker, requests(seed=5), False)
    worker.kept = sum(len(outbox.tokens(r)) for r in outbox.outputs)
    return core, worker, before


def _truth(worker) -> dict:
    v = worker.verified
    return {"drafts": len(v), "tokens": sum(k for _, _, k, _ in v), "accepted": sum(a for *_, a in v),
            "per_pos": [sum(a > i for *_, a in v) for i in range(K)]}


class StatsEngine:
    """An EngineClient stand-in: the stats utility answers the core's stats, encoded and
    decoded as the engine link carries them."""

    def __init__(self, core):
        self.core = core
        self.enc, self.dec = P.encoder(), P.decoder(P.EngineToFrontend)

    async def call_utility(self, method: str, timeout: float):
        assert method == "stats"
        return self.dec.decode(self.enc.encode(P.UtilityResult(1, self.core.stats()))).result


def _scrape(core) -> dict[tuple[str, tuple], float]:
    metrics = RequestMetrics()
    metrics.set_model("toy")
    resp = asyncio.run(MetricsEndpoint(StatsEngine(core), metrics, None)(None))  # type: ignore[arg-type]
    out = {}
    for fam in text_string_to_metric_families(resp.body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_counters_in_stats_and_metrics_equal_what_the_worker_verified():
    core, worker, _ = _run(spec_json(K))
    t = _truth(worker)
    assert t["drafts"] > 20 and 0 < t["accepted"] < t["tokens"]
    s = core.stats()
    assert (s["spec_decode_num_drafts"], s["spec_decode_num_draft_tokens"],
            s["spec_decode_num_accepted_tokens"], s["spec_decode_num_accepted_tokens_per_pos"]) == (
        t["drafts"], t["tokens"], t["accepted"], t["per_pos"])
    assert s["spec_decode_mean_acceptance_length"] == 1 + t["accepted"] / t["drafts"]
    assert s["spec_policy"] == "fixed" and s["spec_num_speculative_tokens"] == K
    assert {"acceptance", "cost_plain", "cost_spec", "engine_overhead_s", "last_step"} <= set(s["spec_policy_inputs"])
    m = _scrape(core)
    name = (("model_name", "toy"),)
    assert m[("kestrel:spec_decode_num_drafts_total", name)] == t["drafts"]
    assert m[("kestrel:spec_decode_num_draft_tokens_total", name)] == t["tokens"]
    assert m[("kestrel:spec_decode_num_accepted_tokens_total", name)] == t["accepted"]
    for pos in range(K):
        key = ("kestrel:spec_decode_num_accepted_tokens_per_pos_total", (("model_name", "toy"), ("position", str(pos))))
        assert m[key] == t["per_pos"][pos]


def test_no_speculation_exports_no_spec_metrics():
    core, _, _ = _run(None)
    assert not any(k.startswith("spec_") for k in core.stats())
    assert not any(name.startswith("kestrel:spec_decode") for name, _ in _scrape(core))


def test_the_periodic_line_carries_the_mean_acceptance_length_of_the_interval():
    core, worker, before = _run(spec_json(K))
    t = _truth(worker)
    line = stats_line(before, core.stats(), 2.0)
    assert line is not None
    assert f"mean acceptance length {1 + t['accepted'] / t['drafts']:.2f}" in line
    assert f"({t['accepted']}/{t['tokens']} draft tokens in {t['drafts']} seqs)" in line
    assert "per position " + ", ".join(f"{n / t['drafts']:.2f}" for n in t["per_pos"]) in line
    assert f"generation {worker.kept / 2.0:.1f} tok/s" in line  # the tokens kept (stops drop some)
    assert worker.kept < sum(len(e) for e in worker.emitted.values())
    # the logger: nothing before the interval is over, nothing for an interval without steps
    clock = FakeClock()
    snapshots = [before, core.stats(), core.stats()]
    log = StatsLog(lambda: snapshots.pop(0), clock, interval_s=10.0)
    clock.t = 9.0
    assert log.tick() is None
    clock.t = 10.0
    assert log.tick() == stats_line(before, core.stats(), 10.0)
    clock.t = 25.0
    assert log.tick() is None  # no step since the last line
    plain, _, plain_before = _run(None)
    text = stats_line(plain_before, plain.stats(), 1.0)
    assert text is not None and "spec decode" not in text
