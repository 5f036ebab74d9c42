"""The speculation policy (services/engine/spec_policy.py) and its step-cost model
(services/engine/step_cost.py), docs/ARCHITECTURE.md §5.5.

Unit level: the expected acceptance length against the truncated geometric distribution it
stands for; the cost curves against the points they were fed; the policy's choice against
hand-computed break-even points for CPU-like and GPU-like costs and batch sizes; probes.
Engine level, on a simulated clock (the oracle worker advances it by a cost per step, so
the "measured" durations are exact and the runs deterministic): with every draft wrong the
policy turns speculation off and the run costs at most 5% more simulated time than without
speculation; with every draft right it verifies k = 4 and runs faster; a request whose
drafts turn right halfway is switched back on by a probe. Outputs always equal the plain
run's.
"""

from __future__ import annotations

import pytest

from services.engine.request import Request
from services.engine.spec_policy import (EMPTY_RUN, MARGIN, PROBE_ALPHA, PROBE_DRAFTS, PROBE_MAX, PROBE_MIN,
                                         SpecPolicy,
                                         expected_accepted)
from services.engine.step_cost import CostCurve, bucket_of
from shared import protocol as P
from shared.spec_config import SpeculativeConfig
from tests.unit.test_spec_scheduler import outputs, pair, run, spec_json


def test_expected_accepted_is_the_mean_of_the_truncated_geometric():
    for a in (0.0, 0.2, 0.5, 0.9, 1.0):
        for k in range(1, 9):
            # P(exactly j accepted) = a^j (1 - a) for j < k, a^k for j = k
            mean = sum(j * a ** j * (1 - a) for j in range(k)) + k * a ** k
            assert expected_accepted(a, k) == pytest.approx(mean)


def test_cost_curve_interpolates_and_never_decreases():
    c = CostCurve()
    assert c.estimate(5) is None
    c.observe(1, 0.010)
    assert c.estimate(40) == pytest.approx(0.4)  # one point: in proportion (the pessimistic guess)
    c.observe(9, 0.026)
    assert c.estimate(5) == pytest.approx(0.018)
    assert c.estimate(17) == pytest.approx(0.042)  # past the end: the last segment's slope
    c.observe(5, 0.012)  # below the line from 1 to 9: kept, the curve stays monotone
    assert c.estimate(3) == pytest.approx(0.011)
    assert c.estimate(5) <= c.estimate(6) <= c.estimate(9)
    for _ in range(10):
        c.observe(9, 0.026)
    c.observe(9, 10.0)  # a stall: clipped to twice the bucket's mean
    assert c.estimate(9) <= 0.026 * 1.25
    assert [bucket_of(n) for n in (1, 16, 17, 20, 21)] == [1, 16, 17, 18, 18]


def _policy(k: int = 4, c0: float = 0.010, c1: float = 0.002, policy: str = "adaptive") -> SpecPolicy:
    """A policy whose cost model saw steps of c0 + c1 * n seconds, plain and spec."""
    sp = SpecPolicy(SpeculativeConfig("ngram", k, policy=policy), async_scheduling=True)
    for n in (1, 2, 4, 8, 16, 64, 256, 512):
        for spec in (False, True):
            sp.observe_step(n, c0 + c1 * n, spec)
    return sp


def _req(rid: str, acceptance: float, sp: SpecPolicy) -> Request:
    r = Request(rid, b"fe", [1, 2, 3], P.SamplingParams(max_tokens=100))
    st = sp.state(r)
    st.accepted, st.trials = acceptance, 1.0
    return r


def best_k(a: float, c0: float, c1: float, n: int = 1, b: int = 1, kmax: int = 4) -> int:
    """Brute force: the k maximising (b + sum a^i) / (c0 + c1 (n + k)) for one request of b
    decodes in a step of n tokens (k > 0 must beat k = 0 by MARGIN)."""
    rates = [(b + sum(a ** i for i in range(1, k + 1))) / (c0 + c1 * (n + k)) for k in range(kmax + 1)]
    k = max(range(1, kmax + 1), key=lambda i: rates[i])
    return k if rates[k] > (1 + MARGIN) * rates[0] else 0


def test_cpu_like_costs_speculate_only_on_high_acceptance():
    sp = _policy(c0=0.010, c1=0.002)  # a draft costs a fifth of a step
    sp.begin_step(1, 1, async_ok=True)
    assert best_k(0.1, 0.010, 0.002) == 0 and best_k(0.95, 0.010, 0.002) == 4
    for a in (0.1, 0.3, 0.5, 0.7, 0.95):
        want = best_k(a, 0.010, 0.002)
        r = _req(f"a{a}", a, sp)
        assert sp.choose([(r, 4)]) == ({r.request_id: want} if want else {}), a
    a_star = sp.break_even_acceptance()
    assert 0.1 < a_star < 0.5 and best_k(a_star * 0.99, 0.010, 0.002) == 0 < best_k(a_star * 1.01, 0.010, 0.002)
    assert sp.num_propose(_req("hi", 0.95, sp), 0, 10) == 4 and sp.num_propose(_req("lo", 0.1, sp), 0, 10) == 0


def test_gpu_like_costs_speculate_even_on_low_acceptance_but_not_at_a_large_batch():
    sp = _policy(c0=0.010, c1=0.00005)  # a draft costs 0.5% of a step
    sp.begin_step(1, 1, async_ok=True)
    r = _req("r", 0.2, sp)
    assert best_k(0.2, 0.010, 0.00005) == 3
    assert sp.choose([(r, 4)]) == {"r": 3}
    assert sp.break_even_acceptance() < 0.05
    # compute-bound at 256 tokens (c1 dominates): a draft costs about what a token earns
    sp = _policy(c0=0.010, c1=0.001)
    sp.begin_step(256, 256, async_ok=True)
    reqs = [_req(f"b{i}", 0.7, sp) for i in range(256)]
    assert sp.choose([(x, 4) for x in reqs]) == {}
    assert sp.break_even_acceptance() > 0.95
    sp.begin_step(1, 1, async_ok=True)  # the same costs at batch 1: speculate
    assert sp.choose([(reqs[0], 4)]) == {"b0": 4}


def test_the_engine_overhead_a_speculative_step_waits_for_counts_against_it():
    sp = _policy(c0=0.010, c1=0.0001)
    sp.begin_step(1, 1, async_ok=True)
    r = _req("r", 0.3, sp)
    assert sp.choose([(r, 4)])
    for _ in range(50):
        sp.cost.observe_overhead(0.006)  # the engine's own 6 ms per step, hidden when async
    sp.begin_step(1, 1, async_ok=True)
    assert sp.choose([(r, 4)]) == {}  # 0.3 + 0.09 + ... < the 60% a synchronous step costs
    sp.begin_step(1, 1, async_ok=False)  # synchronous anyway (a grammar runs): it pays again
    assert sp.choose([(r, 4)])


def test_requests_speculating_at_no_acceptance_are_probed_together_at_doubling_intervals():
    sp = _policy()
    reqs = [_req(f"r{i}", 0.0, sp) for i in range(3)]
    asks = []
    for _ in range(PROBE_MIN * 7):  # one step each: all three seqs sample
        sp.begin_step(3, 3, async_ok=True)
        asks.append([sp.num_propose(r, 0, 10) for r in reqs])
        for r, n in zip(reqs, asks[-1]):
            if n:  # the proposals came back empty (no n-gram match): a failed trial each
                sp.observe_result(r, 0, 0, n, 0)
    probes = [i for i, n in enumerate(asks) if any(n)]
    assert probes == [PROBE_MIN - 1, 3 * PROBE_MIN - 1, 7 * PROBE_MIN - 1]  # the same steps for all
    assert all(asks[i] == [4, 4, 4] for i in probes) and sp.num_probes == 3
    # the probe's drafts are verified whatever the acceptance says, once, and its outcome
    # weighs PROBE_ALPHA in the request's estimate
    r = _req("r", 0.0, sp)
    for _ in range(PROBE_MAX):
        sp.begin_step(1, 1, async_ok=True)
        if sp.num_propose(r, 0, 10):
            break
    assert sp.state(r).probing and sp.choose([(r, 3)]) == {"r": PROBE_DRAFTS}
    sp.observe_result(r, PROBE_DRAFTS, PROBE_DRAFTS, 0, 0)
    assert not sp.state(r).probing and sp.state(r).acceptance == pytest.approx(PROBE_ALPHA)
    assert sp.break_even_acceptance() < PROBE_ALPHA
    assert sp.num_propose(r, 0, 10) == 4  # now worth it: it asks again at once


def test_no_probe_where_even_perfect_drafts_would_not_pay():
    """At 256 sampled seqs on compute-bound costs, every seq verifying 4 drafts, all
    accepted, is no faster than the plain step: nobody is probed (each probe would cost a
    synchronous proposal step and a verify step); the same policy at batch 1 probes."""
    sp = _policy(c0=0.002, c1=0.001)
    reqs = [_req(f"b{i}", 0.0, sp) for i in range(256)]
    for _ in range(PROBE_MAX * 2):
        sp.begin_step(256, 256, async_ok=True)
        assert not any(sp.num_propose(r, 0, 10) for r in reqs[:4])
    assert sp.num_probes == 0
    sp.begin_step(1, 1, async_ok=True)  # the interval is long over: this step probes
    assert sp.num_probes == 1 and sp.num_propose(reqs[0], 0, 10) == 4


def test_an_empty_proposal_is_a_failed_trial_and_fixed_always_asks():
    sp = _policy()
    r = _req("r", 0.8, sp)
    for _ in range(10):
        sp.observe_result(r, 0, 0, 4, 0)
    assert sp.state(r).acceptance < 0.05
    assert sp.num_empty_proposals == sp.num_proposals == 10
    fixed = _policy(policy="fixed")
    f = _req("f", 0.0, fixed)
    fixed.begin_step(256, 256, async_ok=True)
    assert fixed.choose([(f, 3)]) == {"f": 3} and fixed.num_propose(f, 0, 2) == 2


def gpu_like(plan: P.StepPlan) -> float:
    return 0.010 + 0.00005 * sum(len(s.token_ids) for s in plan.seqs)


def cpu_like(plan: P.StepPlan) -> float:
    return 0.010 + 0.002 * sum(len(s.token_ids) for s in plan.seqs)


def _reqs(n: int, max_tokens: int | None = None) -> list[P.AddRequest]:
    """n requests of 60..109 tokens (or max_tokens each)."""
    return [P.AddRequest(f"r{i}", [3 + i, 5, 7, 11], P.SamplingParams(
        temperature=0, max_tokens=max_tokens or 60 + (i * 37) % 50, ignore_eos=True), float(i))
        for i in range(n)]


def _simulate(spec, rate, step_cost, reqs, seqs: int = 1, mistake=None):
    core, worker = pair(spec, rate, 1, step_cost=step_cost, max_model_len=400, max_num_seqs=seqs)
    if mistake is not None:
        worker.mistake = mistake
    got = outputs(run(core, worker, reqs, False), reqs)
    return got, worker.clock.t, core.stats(), worker


@pytest.mark.parametrize("step_cost,seqs", [(cpu_like, 1), (cpu_like, 6), (gpu_like, 1), (gpu_like, 6)])
def test_adaptive_never_loses(step_cost, seqs):
    """A steady load (6 requests per running slot, the queue refilling it) at per-draft
    acceptance 0, 0.3, 0.5, 0.7 and 1: never more than 3% slower than without speculation
    in simulated time, and faster where the drafts are good."""
    reqs = _reqs(6 * seqs)
    plain, t_plain, _, _ = _simulate(None, 0.0, step_cost, reqs, seqs)
    speedups = {}
    for rate in (1.0, 0.7, 0.5, 0.3, 0.0):
        got, t_spec, s, worker = _simulate(spec_json(4, "adaptive"), rate, step_cost, reqs, seqs)
        assert got == plain
        speedups[rate] = t_plain / t_spec
        if rate == 1.0:  # verifies only while the first misses bring the estimate down, and probes
            assert s["spec_decode_num_accepted_tokens"] == 0
            assert s["spec_decode_num_drafts"] <= 0.1 * sum(r.sampling.max_tokens for r in reqs)
        if rate == 0.0:
            assert all(a == k for _, _, k, a in worker.verified)
            assert s["spec_decode_k_hist"][4] >= 0.9 * s["spec_decode_num_drafts"]
            assert s["spec_decode_mean_acceptance_length"] > 4.8
    assert min(speedups.values()) >= 0.97, speedups
    assert speedups[0.0] >= (1.4 if step_cost is cpu_like else 3.0), speedups
    if step_cost is gpu_like:  # cheap drafts pay even at modest acceptance
        assert speedups[0.5] >= 1.5, speedups


def test_a_probe_switches_speculation_back_on_when_the_text_turns_repetitive():
    reqs = _reqs(1, max_tokens=300)
    plain, _, _, _ = _simulate(None, 0.0, cpu_like, reqs)
    got, _, s, worker = _simulate(spec_json(4, "adaptive"), 0.0, cpu_like, reqs,
                                  mistake=lambda rid, i: i < 100)
    assert got == plain
    before = [v for v in worker.verified if v[1] < 100]
    assert len(before) <= 6  # off after the first misses, then only probes
    first_on = min(i for _, i, _, a in worker.verified if a > 0)
    assert 100 <= first_on < 100 + 4 * PROBE_MIN  # the next probe after the text turned
    accepted = sum(a for _, i, _, a in worker.verified if i >= first_on)
    assert accepted >= 0.7 * (300 - first_on)  # on again: most later tokens were drafts
    assert s["spec_decode_num_probes"] >= 2


def sync_penalty(plan: P.StepPlan) -> float:
    """GPU-like costs where a step that verifies or proposes pays 5 ms more (the engine's
    round trip a synchronous step waits for, or a verify step without a CUDA graph)."""
    spec = any(s.num_draft or s.num_propose for s in plan.seqs)
    return gpu_like(plan) + (0.005 if spec else 0.0)


def _sim_budget(spec, rate, reqs, seqs: int, budget: int):
    core, worker = pair(spec, rate, 1, step_cost=sync_penalty, max_model_len=400, max_num_seqs=seqs,
                        budget=budget)
    return outputs(run(core, worker, reqs, False), reqs), worker.clock.t, core.stats()


@pytest.mark.parametrize("budget", [512, 32])
def test_many_requests_with_costly_speculative_steps_never_lose(budget):
    """32 running requests (a queue of 128), every speculative step 5 ms dearer: with every
    draft wrong the run is at most 3% slower than without speculation (probes come in
    steps of their own, once an interval, not one request at a time); with every draft
    right it speculates and runs faster, unless the token budget is full with decodes
    alone (budget 32): then drafts would push decodes out, and it does not lose either."""
    reqs = [P.AddRequest(f"r{i}", [3 + i % 40, 5 + i // 40, 7, 11], P.SamplingParams(
        temperature=0, max_tokens=60 + (i * 37) % 50, ignore_eos=True), float(i)) for i in range(128)]
    plain, t_plain, _ = _sim_budget(None, 0.0, reqs, 32, budget)
    wrong, t_wrong, s_wrong = _sim_budget(spec_json(4, "adaptive"), 1.0, reqs, 32, budget)
    right, t_right, _ = _sim_budget(spec_json(4, "adaptive"), 0.0, reqs, 32, budget)
    assert wrong == plain and right == plain
    assert t_plain / t_wrong >= 0.97, (t_plain / t_wrong, s_wrong["spec_decode_num_probes"])
    assert t_plain / t_right >= (1.5 if budget > 32 * 5 else 0.97), t_plain / t_right


def test_a_request_whose_proposals_come_back_empty_stops_asking_until_a_probe_step():
    """Drafts that look free (flat step costs: the break-even acceptance is near 0) and a
    request whose estimate is high: it asks EMPTY_RUN times, then only in probe steps,
    though its estimate still clears the break-even; a probe that comes back is verified
    and its verify seq asks again."""
    sp = _policy(c0=0.010, c1=0.0)
    r = _req("r", 0.9, sp)
    asks = []
    for i in range(100):
        sp.begin_step(1, 1, async_ok=True)
        if i == EMPTY_RUN:  # the estimate alone would go on asking
            assert sp.state(r).acceptance > 3 * sp.break_even_acceptance()
        if sp.num_propose(r, 0, 10):
            asks.append(i)
            sp.observe_result(r, 0, 0, 4, 0)  # came back empty
    assert asks[:EMPTY_RUN] == list(range(EMPTY_RUN))
    assert len(asks) == EMPTY_RUN + sp.num_probes and sp.num_probes <= 3  # probe steps only
    while True:  # the next probe step: its proposal comes back
        sp.begin_step(1, 1, async_ok=True)
        if sp.num_propose(r, 0, 10):
            break
    sp.observe_result(r, 0, 0, 4, 3)
    assert sp.state(r).empty == 0
    sp.begin_step(1, 1, async_ok=True)
    assert sp.choose([(r, 3)]) == {"r": PROBE_DRAFTS} and sp.num_propose(r, PROBE_DRAFTS, 10) == 4
    sp.observe_result(r, PROBE_DRAFTS, PROBE_DRAFTS, 4, 4)
    sp.begin_step(1, 1, async_ok=True)
    assert sp.choose([(r, 4)]) == {"r": 4} and sp.num_propose(r, 4, 10) == 4


def flat(plan: P.StepPlan) -> float:
    """Step seconds that do not grow with tokens: verifying looks free, the break-even
    acceptance is near 0."""
    return 0.010


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_empty_proposals_stop_the_asking_and_a_copy_that_starts_late_is_found(async_scheduling):
    """Proposals empty for the first 60 outputs (nothing to copy), then right: few seqs ask
    (each is synchronous) during the empty stretch, decodes are planned ahead there, and a
    probe step turns speculation on after the stretch ends. Outputs equal the plain run's."""
    reqs = _reqs(1, max_tokens=200)
    plain, _, _, _ = _simulate(None, 0.0, flat, reqs)
    core, worker = pair(spec_json(4, "adaptive"), 0.0, 1, step_cost=flat, max_model_len=400, max_num_seqs=1,
                        async_scheduling=async_scheduling, worker_kw={"short": lambda rid, i: 0 if i < 60 else 4})
    got = outputs(run(core, worker, reqs, async_scheduling), reqs)
    assert got == plain
    early = [p for p in worker.proposals if p[1] < 60]
    assert len(early) <= EMPTY_RUN + 3, early  # the run, then probe steps 16, 32, 64 apart
    if async_scheduling:
        assert worker.pending_fed >= 60 - 2 * len(early)
    first_on = min(i for _, i, _, a in worker.verified if a > 0)
    assert 60 <= first_on < 60 + 2 * PROBE_MAX // 4
    accepted = sum(a for _, i, _, a in worker.verified if i >= first_on)
    assert accepted >= 0.7 * (200 - first_on)


def test_ngram_lookups_that_find_nothing_never_make_a_step_wait():
    """The engine's n-gram drafter (docs/ARCHITECTURE.md §5.5) with nothing to copy, under
    async scheduling: lookups and probes are no steps of their own, and one that finds
    nothing keeps the pipeline planning ahead: after each request's first decode every
    decode feeds its pending token, and nothing is verified. Outputs equal the plain run's."""
    reqs = _reqs(6)
    plain, _, _, _ = _simulate(None, 0.0, gpu_like, reqs, seqs=6)
    core, worker = pair(spec_json(4, "adaptive"), 0.0, 1, step_cost=gpu_like, max_model_len=400, max_num_seqs=6,
                        async_scheduling=True, worker_kw={"short": lambda rid, i: 0})
    waits = []
    got = outputs(run(core, worker, reqs, True, check=lambda c: waits.append(not c.scheduler.can_schedule_ahead())),
                  reqs)
    assert got == plain and not worker.verified and not any(waits)
    s = core.stats()
    assert s["spec_decode_num_proposals"] == s["spec_decode_num_empty_proposals"] > 0
    assert s["spec_decode_num_probes"] > 0
    decodes = sum(r.sampling.max_tokens - 1 for r in reqs)
    assert worker.pending_fed >= decodes - 2 * len(reqs)


def test_a_spec_curve_of_one_point_never_prices_a_smaller_step_at_zero():
    """One spec point (257 tokens, 15.6 ms: an eager verify) and one plain point just below
    it (256 tokens, 3.2 ms: a graph decode): the slope between them is the spec step's
    extra, ~12 ms a token; below 257 the estimate once followed it down to 0 s (every draft
    then looked free at 256 seqs). It stays at spec(257) there, and grows with that slope
    above."""
    sp = SpecPolicy(SpeculativeConfig("ngram", 4), async_scheduling=True)
    sp.observe_step(256, 0.0032, False)
    sp.observe_step(257, 0.0156, True)
    assert sp.cost.spec_cost(253) == pytest.approx(0.0156)
    assert sp.cost.spec_cost(258) == pytest.approx(0.0156 + (0.0156 - 0.0032))
    sp.begin_step(252, 252, async_ok=True)
    assert sp.break_even_acceptance() == 2.0 and not sp.could_pay()


def test_steps_with_a_prefill_chunk_have_a_curve_of_their_own():
    """Decode-only steps of 256 seqs at 3.2 ms (a CUDA graph) and steps with a prefill
    chunk at 15 ms (eager): a step of 256 decodes expected with 20 prefill tokens is priced
    on the mixed curve, one of decodes alone on the decode curve; one curve of both priced
    the decode step at the mixed steps' cost as soon as its tokens passed theirs."""
    sp = SpecPolicy(SpeculativeConfig("ngram", 4), async_scheduling=True)
    for n in (64, 128, 256):
        sp.observe_step(n, 1.0e-3 + 8.5e-6 * n, False)
        sp.observe_step(n + 40, 0.014 + 3e-6 * (n + 40), False, mixed=True)
    assert sp.cost.plain_cost(256) == pytest.approx(1.0e-3 + 8.5e-6 * 256)
    assert sp.cost.plain_cost(276, mixed=True) == pytest.approx(0.014 + 3e-6 * 276, rel=0.01)
    assert sp.cost.plain_cost(276) < 0.004
    assert sp.stats()["spec_policy_inputs"]["cost_plain_mixed"]


def test_eager_verifies_at_a_large_batch_are_not_probed_even_in_a_step_with_prefill():
    """Verify steps at 256 seqs cost 17-25 ms (eager), decode steps 3.2 ms, steps with a
    prefill chunk 15 ms: all 256 seqs verifying 4 drafts, all accepted, would beat the
    mixed step but not a step of the decodes alone, where a probe's drafts found now may
    verify; so no step probes, no acceptance pays (no lookups), and a probe's drafts held
    in such a step are dropped."""
    sp = SpecPolicy(SpeculativeConfig("ngram", 4), async_scheduling=True)
    for n in (64, 128, 256):
        sp.observe_step(n, 1.0e-3 + 8.5e-6 * n, False)
        sp.observe_step(n + 40, 0.014 + 3e-6 * (n + 40), False, mixed=True)
    for n in (300, 600, 1300):
        sp.observe_step(n, 0.014 + 8e-6 * n, True)
    for mixed in (False, True):
        for _ in range(2 * PROBE_MAX):
            sp.begin_step(256 + 20 * mixed, 256, async_ok=True, mixed=mixed)
            assert not sp.could_pay() and sp.lookups_quiet()
        assert sp.num_probes == 0
    r = _req("r", 0.9, sp)
    sp.state(r).probing = True
    sp.begin_step(256, 256, async_ok=True)
    assert sp.choose([(r, 4)]) == {} and not sp.state(r).probing
    sp.begin_step(1, 1, async_ok=True)  # one seq: a verify of 5 tokens (~14 ms) vs 1 ms: no
    assert not sp.could_pay()


def _load(spec, loops: float, cost, concurrency: int = 256, max_tokens: int = 64):
    """2 x concurrency requests of 24 prompt tokens, max_tokens / 2 .. 3 max_tokens / 2
    outputs each (benchmarks/spec_load_sim.py `run_load`)."""
    from benchmarks.spec_load_sim import run_load
    return run_load(spec, concurrency, 2 * concurrency, loops, prompt=24, max_tokens=max_tokens, cost=cost)


def test_a_256_request_load_where_speculation_cannot_pay_runs_as_a_plain_one():
    """256 concurrent requests on the simulated H200 of benchmarks/spec_load_sim.py (decode
    graphs 3.2 ms at 256 seqs; verify steps and steps with prefill eager, ~15 ms), n-gram
    speculation on (adaptive), outputs that fall into loops of a few tokens (all of them,
    or 40%: drafts right there): a verify step never pays at this batch, so after the first
    steps (no verify measured yet) the engine looks up nobody, makes no step wait and
    probes nobody. Before, probes every 16..256 steps looked every request up and verified,
    and a spec curve of one point priced drafts at 0 s: 2389 lookups that made the next
    plan wait, 19 synchronous plans (this load at 1024 requests, all looping). Outputs equal
    the scripts token for token."""
    from benchmarks.spec_load_sim import h200_like
    plain = _load(None, 1.0, h200_like)
    assert plain["wrong_outputs"] == 0 and plain["sync_plans"] == 0
    for loops in (1.0, 0.4):
        got = _load(spec_json(4, "adaptive"), loops, h200_like)
        assert got["wrong_outputs"] == 0
        assert got["lookups"] <= 5 * 256, got  # the first steps (nothing measured yet) and a probe
        assert got["lookup_waits"] <= 64 and got["sync_plans"] <= 3, got
        assert got["verify_steps"] <= 2 and got["probes"] <= 2, got
        assert got["steps"] <= plain["steps"] + 2


def test_a_256_request_load_where_verifies_are_cheap_still_speculates():
    """The same load on a device where every step replays a graph (a verify of 256 x 5
    tokens 4.2 ms against a decode's 1.6 ms), every output looping: speculation pays and
    goes on, k = 4 for most verifies, in fewer steps and less simulated time than plain;
    outputs equal the scripts."""
    from benchmarks.spec_load_sim import cheap_verify
    plain = _load(None, 1.0, cheap_verify, max_tokens=256)
    got = _load(spec_json(4, "adaptive"), 1.0, cheap_verify, max_tokens=256)
    assert got["wrong_outputs"] == 0 == plain["wrong_outputs"]
    assert got["accepted"] >= 8000, got  # of ~131k output tokens (loops start after 8..80)
    assert got["k_hist"][4] >= 0.5 * sum(got["k_hist"]), got
    assert got["steps"] < 0.8 * plain["steps"] and got["sim_s"] < 0.9 * plain["sim_s"], (got, plain)
