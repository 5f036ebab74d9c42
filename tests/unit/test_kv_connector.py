"""The scheduler <-> KV connector seam (services/engine/kv_connector.py): the scheduler
asks, applies the answers and owns its queues; the connector's reservations are its own.

The connector here is `BookConnector` (tests/unit/kv_tier_rig.py): the real `LoadBook`
policy with the test as its store. The truth is the contract in the connector's and the
book's docs, written out by hand per case: which lookups are asked, which slots are loaded
into which blocks, which go back to the store.
"""

from __future__ import annotations

import random

from services.engine.block_manager import BlockManager
from services.engine.kv_connector import KVLoad
from services.engine.request import RequestStatus
from services.engine.scheduler import Scheduler
from shared import protocol as P
from tests.unit.kv_tier_rig import BS, BookConnector
from tests.unit.test_prefix_cache import EOS, VOCAB, req


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def make(num_blocks: int = 64, budget: int = 64) -> tuple[Scheduler, BookConnector]:
    conn = BookConnector()
    return Scheduler(BlockManager(num_blocks, BS), 8, budget, 400, [EOS], connector=conn), conn


def test_a_request_is_asked_about_once_per_wait_and_again_after_preemption():
    sched, conn = make()
    a = req("a", tokens(1, 3 * BS + 2), 5)
    sched.add(a)
    assert sched.schedule() is None and conn.queued == [(a, 0)]
    assert a.status is RequestStatus.WAITING_FOR_KV and sched.waiting_for_kv == {"a": a}
    assert not sched.has_work(), "a parked request does not make a step"
    conn.settle(a, None)  # a miss
    assert list(sched.waiting) == [a] and not sched.waiting_for_kv
    out = sched.schedule()
    assert [s.start_pos for s in out.plan.seqs] == [0] and conn.queued == []
    assert out.plan.kv_loads == [] and not conn.book.answered("a"), "admission ends the lookup"
    sched.update(out, [1])
    sched._preempt(a)  # as under memory pressure: from token 0 again
    assert sched.bm.reset_prefix_cache()  # (its blocks were evicted meanwhile)
    assert sched.schedule() is None and conn.queued == [(a, 0)]


def test_a_request_with_nothing_past_its_local_hit_is_settled_without_asking():
    sched, conn = make()
    short = req("s", tokens(2, BS), 2)  # no full block before its last token
    sched.add(short)
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["s"] and conn.queued == []


def test_a_reservation_survives_a_failed_admission_and_loads_when_blocks_free_up():
    sched, conn = make(num_blocks=6)
    h = req("h", tokens(3, 4 * BS - 1), 1)
    conn.book.answer(h, None)  # (asked already: a miss)
    sched.add(h)
    sched.schedule()  # h holds 4 of the 6 blocks until it finishes
    b = req("b", tokens(4, 5 * BS + 2), 2)
    sched.add(b)
    assert sched.schedule() is None and conn.queued == [(b, 0)]
    conn.settle(b, KVLoad(0, [10, 11, 12, 13, 14, 15], ["cpu"] * 5 + ["disk"]))
    assert sched.schedule() is None, "b needs 6 blocks, 2 are free"
    # cut at admission to the 5 blocks before b's last token; the 6th slot went back
    assert conn.book.reservation("b") == KVLoad(0, [10, 11, 12, 13, 14], ["cpu"] * 5)
    assert conn.book.to_release == [15] and conn.queued == [], "not asked again"
    sched.finish(h, "abort")
    out = sched.schedule()
    (seq,) = out.plan.seqs
    assert out.plan.kv_loads == list(zip([10, 11, 12, 13, 14], b.block_ids[:5]))
    assert (seq.start_pos, seq.token_ids) == (5 * BS, b.prompt_token_ids[5 * BS:])
    assert conn.book.hit_tokens == {"cpu": 5 * BS} and conn.book.to_release == [15]


def test_a_request_finished_while_parked_hands_back_its_late_reservation():
    sched, conn = make()
    b = req("b", tokens(5, 4 * BS + 1), 2)
    sched.add(b)
    sched.schedule()
    sched.finish(b, "abort")
    assert not sched.waiting_for_kv and not sched.requests
    conn.settle(b, KVLoad(0, [7, 8], ["cpu", "cpu"]))
    assert conn.book.to_release == [7, 8] and not conn.book.answered("b")
    assert not sched.waiting and sched.schedule() is None


def test_a_prompt_logprobs_request_is_never_parked():
    sched, conn = make()
    sp = P.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    r = req("p", tokens(6, 4 * BS + 1), 2)
    r.sampling = sp
    sched.add(r)
    out = sched.schedule()
    assert [s.start_pos for s in out.plan.seqs] == [0] and conn.queued == []


def test_new_cached_blocks_go_to_the_connector_and_results_report_the_transfers():
    sched, conn = make()
    a = req("a", tokens(7, 2 * BS + 1), 3)
    conn.book.answer(a, None)
    sched.add(a)
    out = sched.schedule()
    sched.update(out, [1])
    assert conn.cached == [(a.block_ids[i], a.block_hashes[i]) for i in range(2)]
    sched.transfers_done(out.plan, True)
    assert conn.done == [], "a plan without transfers is not reported"
    assert sched.transfer_plan() is None, "no stores wait: no transfer-only plan"
