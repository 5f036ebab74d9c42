"""Speculation switched off and on at runtime (`SpecPolicy.set_enabled`, the engine's
set_speculation utility, POST /debug/speculation; docs/ARCHITECTURE.md §5.5), as
benchmarks/spec_serve.py --one-server uses it.

Policy level: a request whose acceptance pays for k = 4 gets k = 0, asks for nothing, is not
looked up and is never probed while the policy is off, and no counter or cost curve moves;
switched on again it verifies 4 from the same estimate. Engine level, on the oracle rig's
simulated clock: a switched-off engine with n-gram speculation plans exactly the steps of
an engine without a speculative config (the same seqs, tokens and outputs, no proposal, no
verify), with the engine-side drafter and with the workers' proposals; on again, the same
requests verify drafts. The utility through `FrontendLink`: refused without
--debug-utilities and without a speculative config, accepted otherwise (the stats say so).
The route: only with --debug-utilities, loopback only, 400 for a bad body (starlette's
TestClient against the fake engine of tests/unit/test_frontend_support.py).
"""

from __future__ import annotations

import os

import pytest
from starlette.testclient import TestClient

from services.engine.core import EngineCore
from services.engine.frontend_link import FrontendLink
from services.engine.spec_policy import PROBE_MAX, SpecPolicy
from services.frontend import server
from shared import protocol as P
from shared.config import build_config
from tests.unit.engine_rig import core_config, toy_info
from tests.unit.test_frontend_support import MODEL, fake_engine_in_tempdir
from tests.unit.test_spec_policy import _policy, _req, _reqs, cpu_like
from tests.unit.test_spec_scheduler import outputs, pair, run, spec_json

COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "spec_decode_num_proposals", "spec_decode_num_empty_proposals", "spec_decode_num_probes",
            "spec_decode_num_spec_steps", "spec_ngram_lookups", "spec_ngram_lookup_waits", "spec_decode_k_hist")


def _counters(sp: SpecPolicy) -> dict:
    s = sp.stats()
    return {k: s[k] for k in COUNTERS} | {"inputs": s["spec_policy_inputs"]}


@pytest.mark.parametrize("policy", ["adaptive", "fixed"])
def test_a_switched_off_policy_gives_k_0_asks_nothing_and_counts_nothing(policy):
    sp = _policy(c0=0.010, c1=0.002, policy=policy)  # CPU-like: acceptance 0.95 pays for k = 4
    hi, lo = _req("hi", 0.95, sp), _req("lo", 0.0, sp)  # lo: only a probe would ask for it
    sp.begin_step(2, 2, async_ok=True)
    assert sp.choose([(hi, 4)]) == {"hi": 4} and sp.num_propose(hi, 4, 10) == 4
    assert sp.may_ask(hi) and sp.wants_lookup(hi, exact=True)
    sp.set_enabled(False)
    assert sp.stats()["spec_disabled"] is True
    before = _counters(sp)
    for _ in range(2 * PROBE_MAX):  # long past any probe interval
        sp.begin_step(2, 2, async_ok=True)
        assert sp.choose([(hi, 4), (lo, 4)]) == {}
        for r in (hi, lo):
            assert sp.num_propose(r, 0, 10) == 0 and not sp.may_ask(r)
            assert not sp.wants_lookup(r, exact=True) and not sp.wants_lookup(r, exact=False)
        assert sp.lookups_quiet()
        sp.observe_step(2, 0.5, False)  # a plain step, not measured: the curves stay
        sp.observe_overhead(0.5)
    assert _counters(sp) == before and not sp.state(lo).probing
    sp.set_enabled(True)
    assert sp.stats()["spec_disabled"] is False
    sp.begin_step(2, 2, async_ok=True)  # the same estimate and costs as before: k = 4 again
    assert sp.choose([(hi, 4)]) == {"hi": 4} and sp.num_propose(hi, 4, 10) == 4


def _plans(step_cost):
    """step_cost, recording each plan's seqs as (request, tokens, drafts, proposals)."""
    seen: list = []

    def cost(plan: P.StepPlan) -> float:
        seen.append([(s.request_id, len(s.token_ids), s.num_draft, s.num_propose) for s in plan.seqs])
        return step_cost(plan)

    return cost, seen


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("drafter", ["engine", "worker"])
def test_a_switched_off_engine_plans_the_steps_of_one_without_speculation(async_scheduling, drafter):
    """Drafts always right (speculation pays on these CPU-like costs): off, the plans equal
    those of an engine without a speculative config; on again, the requests verify drafts.
    drafter "worker": the engine asks the workers' proposer (num_propose) instead of looking
    n-gram drafts up itself."""
    reqs = _reqs(4)
    cost, plain_plans = _plans(cpu_like)
    core, worker = pair(None, step_cost=cost, max_model_len=400, max_num_seqs=2, async_scheduling=async_scheduling)
    want = outputs(run(core, worker, reqs, async_scheduling), reqs)
    plain_stats = core.stats()

    cost, spec_plans = _plans(cpu_like)
    core, worker = pair(spec_json(4, "adaptive"), step_cost=cost, max_model_len=400, max_num_seqs=2,
                        async_scheduling=async_scheduling)
    if drafter == "worker":
        core.scheduler.drafts.drafter = None
    before = _counters(core.spec)
    core.spec.set_enabled(False)
    assert outputs(run(core, worker, reqs, async_scheduling), reqs) == want
    assert spec_plans == plain_plans
    assert not worker.proposals and not worker.verified
    stats = core.stats()
    assert stats["spec_disabled"] is True and _counters(core.spec) == before
    assert stats["num_sync_plans"] == plain_stats["num_sync_plans"]

    core.spec.set_enabled(True)
    assert outputs(run(core, worker, reqs, async_scheduling), reqs) == want
    assert sum(a for _, _, _, a in worker.verified) > 0
    stats = core.stats()
    assert stats["spec_disabled"] is False and stats["spec_decode_num_accepted_tokens"] > 0
    if drafter == "engine":
        assert stats["spec_ngram_lookups"] > 0


def _link(debug: bool, spec: str | None) -> FrontendLink:
    cfg = core_config(block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                      debug_utilities=debug, speculative_config=spec)
    core = EngineCore(cfg, toy_info(vocab_size=100, eos=0, max_model_len=cfg.max_model_len), num_blocks=16)
    return FrontendLink(core, lambda ident, msg: None, cfg, "engine-0")


def _call(link: FrontendLink, args: dict) -> P.UtilityResult:
    return link.utility(P.UtilityCall(7, "set_speculation", args))


def test_set_speculation_is_refused_without_debug_utilities_or_a_speculative_config():
    link = _link(debug=False, spec=spec_json(4, "adaptive"))
    res = _call(link, {"enabled": False})
    assert res.call_id == 7 and "debug utilities are off" in res.error and link.core.spec.enabled
    res = _call(_link(debug=True, spec=None), {"enabled": False})
    assert res.error == "no speculative config"


def test_set_speculation_switches_the_policy_and_the_stats_show_it():
    link = _link(debug=True, spec=spec_json(4, "adaptive"))
    stats = link.utility(P.UtilityCall(1, "stats", {})).result
    assert stats["spec_disabled"] is False
    res = _call(link, {"enabled": False})
    assert res.error is None and res.result == {"ok": True, "enabled": False} and not link.core.spec.enabled
    assert link.utility(P.UtilityCall(2, "stats", {})).result["spec_disabled"] is True
    assert _call(link, {"enabled": "no"}).error == "enabled must be true or false"
    assert _call(link, {}).error == "enabled must be true or false"
    assert not link.core.spec.enabled  # a refused call changes nothing
    assert _call(link, {"enabled": True}).result == {"ok": True, "enabled": True} and link.core.spec.enabled


@pytest.fixture()
def fake_engine():
    with fake_engine_in_tempdir("kss-") as engine:
        yield engine


def _app(fake_engine, debug: bool):
    fake, model_dir, d = fake_engine
    cfg = build_config({"engine_address": fake.address, "served_model_name": MODEL, "model": model_dir,
                        "startup_timeout_s": 20, "runtime_dir": os.path.join(d, "run"),
                        "debug_utilities": debug}, env={})
    return server.create_app(cfg)


def test_debug_speculation_route_only_with_debug_utilities_and_only_from_loopback(fake_engine):
    loopback = ("127.0.0.1", 40000)
    with TestClient(_app(fake_engine, debug=False), client=loopback) as client:
        assert client.post("/debug/speculation", json={"enabled": False}).status_code == 404
    app = _app(fake_engine, debug=True)
    with TestClient(app, client=("10.1.2.3", 40000)) as client:
        assert client.post("/debug/speculation", json={"enabled": False}).status_code == 404
    with TestClient(app, client=loopback) as client:
        for bad in (b"{", b"[]", b'{"on": true}', b'{"enabled": 1}', b'{"enabled": "false"}'):
            r = client.post("/debug/speculation", content=bad)
            assert r.status_code == 400 and "enabled" in r.json()["error"], (bad, r.text)
        r = client.post("/debug/speculation", json={"enabled": False})
        # the fake engine answers every utility call with its method's name
        assert r.status_code == 200 and r.json() == {"method": "set_speculation"}
