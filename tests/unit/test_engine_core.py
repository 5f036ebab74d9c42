"""The engine core end to end in one process: `EngineCore` + `InProcessExecutor` + the step
pipeline over a deterministic toy model whose next token is a function of the last one.

The truth is that function iterated from each prompt's last token, computed here without
the engine. Memory is short, so requests are preempted and recompute from their cached
prefix; with async scheduling decodes feed PENDING_TOKEN. A fault in one step fails exactly
the requests of that step, and the others finish as if it never happened.
"""

from __future__ import annotations

import random

import pytest

from services.engine.core import EngineConfigError, EngineCore
from services.engine.executor import InProcessExecutor
from shared import protocol as P
from shared.plan_state import PlanState
from tests.unit.engine_rig import Outbox, core_config, drive, toy_info

VOCAB, EOS, BS = 64, 0, 4


def f(token: int) -> int:
    """The toy model: the next token after `token` (never EOS)."""
    return (token * 7 + 3) % (VOCAB - 1) + 1


def expected(prompt: list[int], n: int) -> list[int]:
    out, t = [], prompt[-1]
    for _ in range(n):
        t = f(t)
        out.append(t)
    return out


class NextTokenModel:
    """Runs plans on f. Keeps each request's tokens as the 'KV cache' and checks that every
    chunk continues it exactly (start_pos), that the block table covers it, and that a
    PENDING_TOKEN stands for the token this model sampled last for that request.

    fail_when: a request id; a plan that holds it raises RuntimeError("boom").
    failed_plans: the request ids of each plan that raised.
    """

    def __init__(self, fail_when: str | None = None):
        self.kv: dict[str, list[int]] = {}
        self.state = PlanState()
        self.last: dict[str, int] = {}
        self.pending_fed = 0
        self.fail_when = fail_when
        self.failed_plans: list[set[str]] = []

    def execute(self, plan: P.StepPlan) -> P.StepResult:
        self.state.resolve(plan)
        ids = {s.request_id for s in plan.seqs}
        if self.fail_when in ids:
            self.failed_plans.append(ids)
            self.last = {}
            raise RuntimeError("boom")
        out, drawn = [], {}
        for s in plan.seqs:
            cache = self.kv.setdefault(s.request_id, [])
            del cache[s.start_pos:]
            assert len(cache) == s.start_pos, "plan skips tokens"
            toks = list(s.token_ids)
            if toks and toks[-1] == P.PENDING_TOKEN:
                toks[-1] = self.last[s.request_id]  # KeyError: not drawn by the last plan
                self.pending_fed += 1
            assert P.PENDING_TOKEN not in toks
            cache.extend(toks)
            assert len(s.block_table) * BS >= len(cache), "blocks do not cover tokens"
            if s.sample:
                out.append(f(cache[-1]))
                drawn[s.request_id] = out[-1]
        self.last = drawn
        return P.StepResult(plan.step_id, out)


def _core(async_scheduling: bool, num_blocks: int, max_num_seqs: int = 8) -> EngineCore:
    cfg = core_config(async_scheduling=async_scheduling, block_size=BS, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=16, max_model_len=num_blocks * BS)
    return EngineCore(cfg, toy_info(VOCAB, EOS, cfg.max_model_len), num_blocks=num_blocks)


def _prompts(seed: int, n: int) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    return [(f"r{i}", [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 14))],
             rng.randrange(4, 22)) for i in range(n)]


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_core_outputs_follow_the_toy_model_under_preemption(async_scheduling, seed):
    core = _core(async_scheduling, num_blocks=12)
    prompts = _prompts(seed, 8)
    for rid, prompt, n in prompts:
        assert core.add(b"fe", P.AddRequest(rid, prompt, P.SamplingParams(max_tokens=n), 0.0)) is None
    model, outbox = NextTokenModel(), Outbox()
    drive(core, InProcessExecutor(model), async_scheduling, outbox)
    for rid, prompt, n in prompts:
        assert outbox.tokens(rid) == expected(prompt, n), rid
        assert outbox.final(rid).finish_reason == "length" and outbox.final(rid).error is None
    stats = core.stats()
    assert stats["num_preemptions"] > 0  # memory was short: recompute happened
    assert (model.pending_fed > 0) == async_scheduling
    assert not core.requests and stats["num_free_blocks"] == stats["num_blocks"] == 12


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_step_fault_fails_only_the_requests_of_that_step(async_scheduling):
    core = _core(async_scheduling, num_blocks=64, max_num_seqs=2)
    prompts = [("a", [5, 6, 7], 6), ("boom", [9, 10], 6), ("c", [11, 12, 13, 14], 6), ("d", [3], 6)]
    for rid, prompt, n in prompts:
        assert core.add(b"fe", P.AddRequest(rid, prompt, P.SamplingParams(max_tokens=n), 0.0)) is None
    model, outbox = NextTokenModel(fail_when="boom"), Outbox()
    drive(core, InProcessExecutor(model), async_scheduling, outbox)
    failed = set().union(*model.failed_plans)
    assert failed == {"a", "boom"}  # max_num_seqs 2: the first step held these two
    for rid, prompt, n in prompts:
        final = outbox.final(rid)
        if rid in failed:
            assert (final.finish_reason, final.error_kind) == ("error", "internal")
            assert final.error == "internal error in the model worker: RuntimeError: boom"
            assert outbox.tokens(rid) == []
        else:
            assert outbox.tokens(rid) == expected(prompt, n) and final.finish_reason == "length"
    assert not core.requests


def test_core_refuses_a_max_model_len_over_its_kv_cache():
    cfg = core_config(block_size=BS, max_model_len=100)
    with pytest.raises(EngineConfigError, match="exceeds the KV cache"):
        EngineCore(cfg, toy_info(VOCAB, EOS, cfg.max_model_len), num_blocks=10)


def test_abort_while_running_ends_the_request_and_frees_its_blocks():
    core = _core(False, num_blocks=64)
    core.add(b"fe", P.AddRequest("x", [1, 2, 3], P.SamplingParams(max_tokens=50), 0.0))
    core.add(b"fe", P.AddRequest("y", [4, 5], P.SamplingParams(max_tokens=5), 0.0))
    model, outbox = NextTokenModel(), Outbox()
    executor = InProcessExecutor(model)
    from services.engine.pipeline import StepPipeline

    pipeline = StepPipeline(core, executor, async_scheduling=False)
    for _ in range(3):
        outbox.take(pipeline.advance())
    core.abort(["x", "nosuch"])
    outbox.take(core.apply_aborts())
    assert outbox.final("x").finish_reason == "abort" and "x" not in core.requests
    drive(core, executor, False, outbox)
    assert outbox.tokens("y") == expected([4, 5], 5)
    assert outbox.tokens("x") == expected([1, 2, 3], 50)[:len(outbox.tokens("x"))]
    assert core.stats()["num_free_blocks"] == 64
