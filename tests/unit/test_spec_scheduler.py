"""The engine side of speculative decoding (docs/ARCHITECTURE.md §5.5) against a scripted
oracle worker (tests/unit/spec_oracle_rig.py): `EngineCore` + the real scheduler and block manager
on an in-process executor, no model weights.

The truth is the same requests run without speculation on the same oracle: outputs (tokens,
finish reasons, stop ids, logprobs) must be equal token for token whatever the drafts, the
mistakes in them, async scheduling, concurrency, chunked prefill or preemption. The oracle's
paged KV makes any read of a rejected draft's KV or of a trimmed block fail the run.
"""

from __future__ import annotations

import json
import random

import msgspec
import pytest

from services.engine.block_manager import blocks_needed
from services.engine.core import EngineCore
from services.engine.executor import InProcessExecutor
from services.engine.pipeline import StepPipeline
from shared import protocol as P
from tests.unit.engine_rig import Outbox, core_config, toy_info
from tests.unit.spec_oracle_rig import EOS, VOCAB, FakeClock, OracleDrafter, OracleWorker, oracle_continuation

BS = 4


def cpu_like(plan: P.StepPlan) -> float:
    """Simulated step seconds: a fixed cost and one per token, as on a small CPU."""
    return 0.010 + 0.002 * sum(len(s.token_ids) for s in plan.seqs)


def spec_json(k: int = 4, policy: str = "fixed") -> str:
    return json.dumps({"method": "ngram", "num_speculative_tokens": k, "policy": policy})


def make_core(spec: str | None, async_scheduling: bool = False, num_blocks: int = 1000,
              budget: int = 32, max_num_seqs: int = 8, max_model_len: int = 200,
              prefix_caching: bool = True, clock=None) -> EngineCore:
    cfg = core_config(async_scheduling=async_scheduling, block_size=BS, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=budget, max_model_len=max_model_len,
                      enable_prefix_caching=prefix_caching, speculative_config=spec)
    kw = {} if clock is None else {"clock": clock}
    return EngineCore(cfg, toy_info(VOCAB, EOS, cfg.max_model_len), num_blocks=num_blocks, **kw)


def pair(spec: str | None, rate: float = 0.0, seed: int = 0, step_cost=cpu_like, worker_kw=None,
         **core_kw) -> tuple[EngineCore, OracleWorker]:
    """A core and its oracle worker on one simulated clock (the policy's step costs are
    then exact and deterministic); drafts wrong at `rate` (seeded)."""
    clock = FakeClock()
    core = make_core(spec, clock=clock, **core_kw)
    worker = OracleWorker(BS, mistake=mistakes(rate, seed), bm=core.scheduler.bm, clock=clock,
                          step_cost=step_cost, **(worker_kw or {}))
    if spec is not None:
        OracleDrafter.install(core, worker)
    return core, worker


def requests(seed: int, n: int = 12) -> list[P.AddRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 40))]
        sp = P.SamplingParams(temperature=0, max_tokens=rng.randrange(1, 40),
                              ignore_eos=rng.random() < 0.5,
                              stop_token_ids=[rng.randrange(1, VOCAB)] if rng.random() < 0.3 else [],
                              logprobs=0 if rng.random() < 0.3 else None)
        out.append(P.AddRequest(f"r{i}", prompt, sp, float(i)))
    return out


def run(core: EngineCore, worker: OracleWorker, reqs: list[P.AddRequest], async_scheduling: bool,
        check=None, max_turns: int = 20000) -> Outbox:
    """Add `reqs`, advance the pipeline until idle; check(core) after every turn."""
    for r in reqs:  # a copy: admission seeds the request's parameters
        assert core.add(b"fe", msgspec.structs.replace(r, sampling=msgspec.structs.replace(r.sampling))) is None
    pipeline = StepPipeline(core, InProcessExecutor(worker), async_scheduling)
    outbox = Outbox()
    for _ in range(max_turns):
        if not pipeline.busy():
            break
        outbox.take(pipeline.advance())
        if check is not None:
            check(core)
    else:
        raise AssertionError("engine did not finish")
    assert not core.requests
    return outbox


def outputs(outbox: Outbox, reqs: list[P.AddRequest]) -> dict:
    res = {}
    for r in reqs:
        outs = outbox.outputs[r.request_id]
        assert all(o.finish_reason is None for o in outs[:-1])
        assert outs[-1].error is None, outs[-1]
        res[r.request_id] = (outbox.tokens(r.request_id), outs[-1].finish_reason, outs[-1].stop_token_id,
                             [(lp.token_id, lp.logprob) for o in outs for lp in o.logprobs])
    return res


def truth(reqs: list[P.AddRequest], **kw) -> dict:
    core, worker = pair(None, **kw)
    return outputs(run(core, worker, reqs, False), reqs)


def mistakes(rate: float, seed: int = 0):
    def wrong(rid: str, i: int) -> bool:
        return random.Random(f"{seed}/{rid}/{i}").random() < rate
    return wrong


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("rate", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_outputs_with_speculation_equal_outputs_without(async_scheduling, rate, policy):
    reqs = requests(seed=7)
    core, worker = pair(spec_json(4, policy), rate, async_scheduling=async_scheduling,
                        worker_kw={"short": lambda rid, i: (i * 7 + len(rid)) % 6})
    got = outputs(run(core, worker, reqs, async_scheduling), reqs)
    assert got == truth(reqs)
    s = core.stats()
    assert s["spec_decode_num_drafts"] > 0, "nothing was verified"
    assert s["spec_decode_num_drafts"] == len(worker.verified)
    assert s["spec_decode_num_draft_tokens"] == sum(k for _, _, k, _ in worker.verified)
    assert s["spec_decode_num_accepted_tokens"] == sum(a for *_, a in worker.verified)
    per_pos = [sum(a > i for *_, a in worker.verified) for i in range(4)]
    assert s["spec_decode_num_accepted_tokens_per_pos"] == per_pos
    if rate == 0.0 and policy == "fixed":
        assert all(a == k for _, _, k, a in worker.verified)
    if rate == 1.0:
        assert s["spec_decode_num_accepted_tokens"] == 0
    assert core.scheduler.bm.num_free_blocks == core.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_plain_requests_keep_async_scheduling_while_others_speculate_less(async_scheduling):
    """With every draft wrong the adaptive policy stops speculating: decodes go back to
    being planned ahead (pending tokens fed), and the outputs stay the plain ones."""
    reqs = [P.AddRequest(f"r{i}", [1 + i, 2, 3], P.SamplingParams(temperature=0, max_tokens=120,
                                                                    ignore_eos=True), float(i))
            for i in range(4)]
    core, worker = pair(spec_json(4, "adaptive"), 1.0, async_scheduling=async_scheduling)
    got = outputs(run(core, worker, reqs, async_scheduling), reqs)
    assert got == truth(reqs)
    # 4 requests x 120 tokens: a verify at most at the start and at each (doubling) probe
    assert len(worker.verified) <= 4 * 6, len(worker.verified)
    assert (worker.pending_fed > 300) == async_scheduling, worker.pending_fed


def test_stop_inside_the_accepted_tokens_drops_the_rest():
    """Perfect drafts, k = 4: a step emits 5 tokens; a stop token id or EOS inside them ends
    the request there, later tokens (and their logprobs) are dropped."""
    prompt = [5, 6, 7, 8]  # EOS at output 9 and 22: inside the steps [6..10] and [21..25]
    cont = oracle_continuation(prompt, 30)
    first_eos = cont.index(EOS)
    assert first_eos % 5  # the steps emit outputs 0, 1..5, 6..10, ...: not the last of one
    # the stop id: first seen inside a step, as the last token of a block (its KV, written
    # as a draft's, is not registered: the prefix cache then holds what a plain run leaves)
    stop_id = next(t for i, t in enumerate(cont) if i >= 5 and i % 5 and t != EOS and cont.index(t) == i
                   and (len(prompt) + i + 1) % BS == 0)
    cases = {
        "stop": (P.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id],
                                  logprobs=0), cont[:cont.index(stop_id) + 1], "stop", stop_id),
        "eos": (P.SamplingParams(temperature=0, max_tokens=30, logprobs=0), cont[:first_eos + 1], "stop", EOS),
        "len": (P.SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), cont[:7], "length", None),
        "min": (P.SamplingParams(temperature=0, max_tokens=30, min_tokens=first_eos + 2),
                cont[:cont.index(EOS, first_eos + 1) + 1], "stop", EOS),
    }
    for rid, (sp, want, reason, stop) in cases.items():
        reqs = [P.AddRequest(rid, prompt, sp, 0.0)]
        core, worker = pair(spec_json(4))
        got = outputs(run(core, worker, reqs, False), reqs)[rid]
        assert got[:3] == (want, reason, stop), rid
        plain_core, plain_worker = pair(None)
        assert got == outputs(run(plain_core, plain_worker, reqs, False), reqs)[rid]
        assert set(core.scheduler.bm.cached) == set(plain_core.scheduler.bm.cached), rid
        if sp.logprobs is not None:
            assert [t for t, _ in got[3]] == want
        emitted = worker.emitted[rid]
        assert emitted[:len(want)] == want
        if rid != "len":
            assert len(emitted) > len(want), f"{rid}: the stop was not inside a step's tokens"
        else:  # k never exceeds what max_tokens lets the request emit
            assert emitted == want
        assert all(i + k < sp.max_tokens for _, i, k, _ in worker.verified)


def test_drafts_and_proposals_stay_below_max_model_len():
    """A request that may fill the context: no draft, bonus token or drafter KV position
    past max_model_len."""
    reqs = [P.AddRequest("m", [1, 2, 3, 4, 5], P.SamplingParams(temperature=0, max_tokens=25,
                                                               ignore_eos=True), 0.0)]
    core, worker = pair(spec_json(4), max_model_len=30)
    ends: list[int] = []
    execute = worker.execute

    def spy(plan: P.StepPlan) -> P.StepResult:
        ends.extend(s.start_pos + len(s.token_ids) + s.num_propose for s in plan.seqs)
        return execute(plan)

    worker.execute = spy  # type: ignore[method-assign]
    got = outputs(run(core, worker, reqs, False), reqs)
    assert got == truth(reqs, max_model_len=30)
    assert len(got["m"][0]) == 25 and got["m"][1] == "length"
    assert worker.verified and max(ends) <= 30


def _block_check(core: EngineCore) -> None:
    """Every request holds no more blocks than its tokens need: its tokens, or those of the
    plan in flight (a plain decode planned ahead, or drafts and a proposal: under async
    scheduling a plan may still be out when this runs); nothing leaks."""
    bm = core.scheduler.bm
    for r in core.requests.values():
        ahead = r.num_computed_tokens + (core.spec.kmax if r.spec_inflight and core.spec else 0)
        need = blocks_needed(max(r.num_tokens, ahead), bm.block_size)
        assert len(r.block_ids) <= need, (r, len(r.block_ids), need)
    assert bm.num_free_blocks + sum(1 for c in bm.ref_cnt if c) == bm.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_block_counts_never_exceed_need_and_return_to_the_cold_run_values(async_scheduling):
    reqs = requests(seed=11)

    def final_state(spec: str | None, rate: float):
        core, worker = pair(spec, rate, 3, async_scheduling=async_scheduling)
        got = outputs(run(core, worker, reqs, async_scheduling, check=_block_check), reqs)
        bm = core.scheduler.bm
        assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_cnt)
        return got, (bm.num_free_blocks, len(bm.evictable), set(bm.cached)), bm.stats()

    plain, cold, _ = final_state(None, 0.0)
    for rate in (0.0, 0.5):
        got, state, _ = final_state(spec_json(4), rate)
        assert got == plain
        assert state == cold  # the same blocks named (by content), free and evictable


def test_prefix_cache_hits_after_a_speculative_request_equal_those_after_a_plain_one():
    first = P.AddRequest("a", list(range(1, 11)), P.SamplingParams(temperature=0, max_tokens=37,
                                                                   ignore_eos=True), 0.0)

    def second_hit(spec: str | None, rate: float) -> tuple[int, list[int], dict]:
        core, worker = pair(spec, rate, 5)
        out_a = run(core, worker, [first], False)
        a_tokens = out_a.tokens("a")
        follow = P.AddRequest("b", list(first.prompt_token_ids) + a_tokens + [9, 9],
                              P.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), 1.0)
        out_b = run(core, worker, [follow], False)
        s = core.stats()
        return out_b.final("b").num_cached_tokens, out_b.tokens("b"), {
            k: s[k] for k in ("prefix_cache_hits", "prefix_cache_hit_blocks", "num_cached_blocks")}

    plain = second_hit(None, 0.0)
    assert plain[0] == (10 + 37 - 1) // BS * BS  # every full block with KV (the last token has none)
    for rate in (0.0, 0.3, 1.0):
        assert second_hit(spec_json(4), rate) == plain


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_while_requests_hold_drafts_keeps_outputs(async_scheduling, monkeypatch):
    from services.engine.scheduler import Scheduler

    held: list[int] = []
    real = Scheduler._preempt

    def preempt(self, victim):
        held.append(len(victim.draft_token_ids))
        real(self, victim)
        assert victim.draft_token_ids == [] and not victim.spec_inflight

    monkeypatch.setattr(Scheduler, "_preempt", preempt)
    # the newest requests have the shortest prompts: they decode (and hold drafts) while
    # older ones still prefill and take their blocks
    reqs = [P.AddRequest(f"p{i}", [random.Random(i).randrange(1, VOCAB) for _ in range(26 - 3 * i)],
                         P.SamplingParams(temperature=0, max_tokens=25, ignore_eos=True), float(i))
            for i in range(8)]
    core, worker = pair(spec_json(4), 0.2, 9, async_scheduling=async_scheduling, num_blocks=16, budget=16,
                        max_model_len=64)
    got = outputs(run(core, worker, reqs, async_scheduling, check=_block_check), reqs)
    assert got == truth(reqs)
    assert held, "test did not exercise preemption"
    assert any(held), "no request held drafts when preempted"
    assert core.stats()["num_preemptions"] == len(held)


def test_a_result_that_does_not_match_its_plan_is_refused():
    core = make_core(spec_json(2))
    core.add(b"fe", P.AddRequest("x", [1, 2, 3], P.SamplingParams(temperature=0, max_tokens=10), 0.0))
    out = core.plan_step()
    assert out is not None and out.plan.seqs[0].num_propose == 0  # n-gram drafts are the engine's
    with pytest.raises(ValueError):  # a prefill's last chunk verifies nothing: one token
        core.finish_step(out, P.StepResult(out.plan.step_id, [4, 5], num_sampled=[2]))
    with pytest.raises(ValueError):
        core.finish_step(out, P.StepResult(out.plan.step_id, [4, 5], num_sampled=[1]))


def test_the_count_of_running_requests_that_need_their_results_follows_the_queue():
    """`Scheduler._num_sync_running` (running requests with penalties or a grammar: the
    policy's `async_ok`, kept as a count rather than a pass per step) equals a recount over
    the running requests after every turn, through admissions, preemptions (few blocks) and
    finishes, and is 0 at the end."""
    reqs = [P.AddRequest(f"p{i}", [random.Random(i).randrange(1, VOCAB) for _ in range(26 - 3 * i)],
                         P.SamplingParams(temperature=0, max_tokens=25, ignore_eos=True,
                                          repetition_penalty=1.3 if i % 3 == 0 else 1.0), float(i))
            for i in range(8)]
    core, worker = pair(spec_json(4, "adaptive"), 0.2, 9, async_scheduling=True, num_blocks=16, budget=16,
                        max_model_len=64)
    seen = []

    def check(c):
        s = c.scheduler
        want = sum(r.has_penalty or r.grammar is not None for r in s.running)
        assert s._num_sync_running == want
        seen.append(want)

    run(core, worker, reqs, True, check=check)
    assert core.scheduler._num_sync_running == 0 and max(seen) > 0
    assert core.scheduler.num_preemptions > 0
