"""The engine's KV tier integration (docs/ARCHITECTURE.md §4 "Tiers", issue 6): the real
Scheduler, BlockManager and KVStoreConnector against a real kvstore on a thread and a toy worker that copies
its paged KV through the store's shm pool (tests/unit/kv_tier_rig.py).

The truth for every output is the same request run alone with no cache anywhere
(`test_prefix_cache.reference`); the toy model checks, position by position, that every KV
entry a request reads was computed for that position under that prefix, so a load of the
wrong bytes or into the wrong block fails the run.
"""

from __future__ import annotations

import random

import pytest

from services.engine.block_manager import BlockManager
from services.engine.kv_connector import KVLoad
from services.engine.request import RequestStatus
from services.engine.scheduler import Scheduler
from shared.protocol import KVLookup, KVPrepareStore
from tests.unit.kv_tier_rig import BS, BookConnector, TierRig, check_blocks
from tests.unit.test_prefix_cache import EOS, VOCAB, reference, req


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def outputs(*requests) -> dict:
    return {r.request_id: (r.output_token_ids, r.finish_reason) for r in requests}


@pytest.fixture
def rigs():
    made: list[TierRig] = []

    def make(**kw) -> TierRig:
        made.append(TierRig(**kw))
        return made[-1]

    yield make
    for rig in made:
        rig.close()


def warm_tier(rig: TierRig, prompt: list[int]) -> list[bytes]:
    """Run `prompt` once so that its full blocks are stored in the kvstore, then empty the
    GPU-local prefix cache: a later hit on it can only come from the tier. Returns the
    names of the prompt's blocks a later request with this prompt can load."""
    seed = req("seed", prompt, 4)
    rig.sched.add(seed)
    rig.drain()
    assert rig.bm.reset_prefix_cache()
    names = seed.block_hashes[:(len(prompt) - 1) // BS]
    assert rig.probe(names)[0] == ["cpu"] * len(names)
    return names


def test_tier_hit_waits_off_the_step_and_resumes_first_with_its_loaded_prefix(rigs):
    rig = rigs()
    prompt = tokens(0, 5 * BS + 2)
    warm_tier(rig, prompt)
    rig.hold(KVLookup)  # a slow store: the lookup stays unanswered for a while
    b, c = req("b", prompt, 5), req("c", [9, 8, 7], 6)
    rig.sched.add(b)
    rig.sched.add(c)
    plans = [rig.step() for _ in range(4)]
    assert b.status is RequestStatus.WAITING_FOR_KV and rig.sched.waiting_for_kv == {"b": b}
    assert rig.tiers.stats()["kv_tier_waiting_requests"] == 1
    assert [[s.request_id for s in p.seqs] for p in plans] == [["c"]] * 4
    assert c.num_computed_tokens == 3 + 3 and not b.block_ids
    d = req("d", [6, 6], 2)  # arrives while b waits
    rig.sched.add(d)
    rig.release()
    rig.wait(lambda: b.status is RequestStatus.WAITING, "b's reservation")
    assert list(rig.sched.waiting) == [b, d], "a request back from the store goes first"
    load = rig.tiers.book.reservation("b")
    first, slots, tiers = load.first, load.slots, load.tiers
    assert (first, len(set(slots)), tiers) == (0, 5, ["cpu"] * 5)
    plan = rig.step()
    (seq,) = [s for s in plan.seqs if s.request_id == "b"]
    assert (seq.start_pos, seq.token_ids) == (5 * BS, prompt[5 * BS:])
    assert plan.kv_loads == list(zip(slots, b.block_ids[:5]))
    assert b.num_cached_tokens == 5 * BS and rig.tiers.book.hit_tokens == {"cpu": 5 * BS}
    assert rig.tiers.stats()["kv_tier_hits_cpu"] == 5 * BS
    rig.drain()
    assert outputs(b, c, d) == reference([b, c, d])
    assert rig.probe([])[1]["pinned_slots"] == 0, "the load's slots were never handed back"


def test_gpu_hit_blocks_are_shared_and_the_tier_run_loads_into_fresh_blocks(rigs):
    rig = rigs()
    prompt = tokens(1, 5 * BS + 2)
    warm_tier(rig, prompt)
    p = req("p", prompt[:2 * BS] + [41, 42, 43], 30)  # holds the first two blocks on the GPU
    rig.sched.add(p)
    rig.run_until(lambda: p.num_registered_blocks == 2, "p's blocks in the GPU prefix cache")
    b = req("b", prompt, 4)
    rig.sched.add(b)
    rig.step()
    assert b.status is RequestStatus.WAITING_FOR_KV and rig.tiers.queued_lookups == [(b, 2)]
    rig.wait(lambda: rig.tiers.book.reservation("b") is not None, "b's reservation")
    assert b.status is RequestStatus.WAITING
    load = rig.tiers.book.reservation("b")
    first, slots = load.first, load.slots
    assert (first, len(slots)) == (2, 3)
    others = {x for r in rig.sched.running for x in r.block_ids}
    plan = rig.step()
    assert b.block_ids[:2] == p.block_ids[:2]
    assert [rig.bm.ref_cnt[x] for x in b.block_ids[:2]] == [2, 2]
    fresh = b.block_ids[2:5]
    assert others.isdisjoint(fresh) and [rig.bm.ref_cnt[x] for x in fresh] == [1, 1, 1]
    assert plan.kv_loads == list(zip(slots, fresh))
    assert rig.seqs_of("b")[0].start_pos == 5 * BS
    rig.drain()
    assert outputs(b, p) == reference([b, p])


def test_kvstore_loss_sends_waiting_requests_back_to_recompute_and_unpins_stores(rigs):
    rig = rigs(reply_timeout_s=0.5)
    p1, p2 = tokens(2, 4 * BS + 1), tokens(12, 3 * BS + 3)
    warm_tier(rig, p1)
    warm_tier(rig, p2)
    rig.hold(KVLookup, KVPrepareStore)  # answers that will never come
    b1, c = req("b1", p1, 4), req("c", [9, 8, 7], 12)
    rig.sched.add(b1)
    rig.sched.add(c)
    rig.run_until(lambda: rig.bm.store_pins, "c's first full block pinned for a store")
    pinned = set(rig.bm.store_pins)
    assert b1.status is RequestStatus.WAITING_FOR_KV and not rig.tiers.queued_lookups  # asked
    rig.stop_store()
    b2 = req("b2", p2, 4)
    rig.sched.add(b2)
    rig.step()
    assert b2.status is RequestStatus.WAITING_FOR_KV and rig.tiers.queued_lookups == [(b2, 0)]
    rig.tiers.reply_timeout_s = 0.0  # the store's silence is past the limit at the next look
    rig.run_until(lambda: c.is_finished and b1.is_finished and b2.is_finished,
                  "every request to finish without the store")
    assert [rig.seqs_of(r)[0].start_pos for r in ("b1", "b2")] == [0, 0], "no recompute"
    assert not any(p.kv_loads for p in rig.plans)
    assert not rig.tiers.connected
    assert rig.tiers.lookup(req("z", p1, 1), 0) == 0, "tiers off: nothing is asked"
    assert not rig.bm.store_pins and pinned <= set(rig.bm.evictable)
    assert rig.tiers.stats()["kv_tier_disconnects"] == 1
    assert outputs(b1, b2, c) == reference([b1, b2, c])


def test_kvstore_loss_drops_a_ready_reservation_and_tiers_resume_with_a_new_store(rigs):
    rig = rigs(reply_timeout_s=0.5)
    prompt = tokens(3, 4 * BS + 1)
    warm_tier(rig, prompt)
    b = req("b", prompt, 4)
    rig.sched.add(b)
    assert rig.step() is None and b.status is RequestStatus.WAITING_FOR_KV
    rig.wait(lambda: rig.tiers.book.reservation("b") is not None, "b's reservation")
    rig.stop_store()
    rig.wait(lambda: not rig.tiers.connected, "the engine to notice the store is gone")
    assert rig.tiers.book.reservation("b") is None and list(rig.sched.waiting) == [b]
    assert rig.tiers.book.to_release == [], "slots of a dead store would be handed back"
    plan = rig.step()
    assert plan.kv_loads == [] and plan.seqs[0].start_pos == 0
    rig.start_store()
    rig.wait(lambda: rig.tiers.connected, "a new session")
    rig.drain()
    assert outputs(b) == reference([b])
    e = req("e", tokens(4, 3 * BS + 1), 2)
    rig.sched.add(e)
    rig.drain()
    assert rig.probe(e.block_hashes[:3])[0] == ["cpu"] * 3, "the new store gets no stores"


def test_block_with_a_store_in_flight_is_not_reused_until_the_store_completes(rigs):
    rig = rigs(num_blocks=8, budget=32)
    # a1 finishes in the step that fills its 3 full blocks (they are free before the engine
    # pins them); a2's full block is pinned while a2 runs, and a2 finishes under the pin.
    a1, a2 = req("a1", tokens(5, 3 * BS + 1), 1), req("a2", tokens(15, BS + 1), 3)
    rig.hold(KVPrepareStore)
    rig.sched.add(a1)
    rig.sched.add(a2)
    rig.run_until(lambda: a1.is_finished and a2.is_finished and len(rig.bm.store_pins) == 4,
                  "the stores of a1 and a2 in flight")
    pinned = sorted(rig.bm.store_pins)
    assert rig.bm.num_free_blocks == 8 - 4
    assert rig.tiers.stats()["kv_tier_pending_stores"] == 4
    x = req("x", tokens(6, 6 * BS + 3), 2)  # needs 7 blocks at once: only 4 are free
    rig.sched.add(x)
    assert rig.step() is None  # x asks the store (a miss), then stays at the queue's head
    rig.wait(lambda: x.status is RequestStatus.WAITING, "x's lookup")
    for _ in range(5):
        assert rig.step() is None
    assert x.status is RequestStatus.WAITING and not x.block_ids and rig.bm.num_evictions == 0
    assert sorted(rig.bm.store_pins) == pinned
    rig.release()
    rig.run_until(lambda: x.block_ids, "x to be admitted once the stores completed")
    assert rig.bm.num_evictions >= 3 and set(pinned) & set(x.block_ids)
    rig.drain()
    assert set(pinned) <= {b for p in rig.plans for b, _ in p.kv_stores}
    # The tier holds a1's and a2's KV, not x's: their prompts load it and match.
    assert rig.bm.reset_prefix_cache()
    b1, b2 = req("b1", a1.prompt_token_ids, 3), req("b2", a2.prompt_token_ids, 3)
    rig.sched.add(b1)
    rig.sched.add(b2)
    rig.drain()
    assert [len(s.token_ids) for s in (rig.seqs_of("b1")[0], rig.seqs_of("b2")[0])] == [1, 1]
    assert outputs(b1, b2) == reference([b1, b2])


def test_request_restarting_from_token_0_after_preemption_stores_its_prefix_again(rigs):
    rig = rigs()
    a = req("a", tokens(7, 3 * BS + 2), 40)
    rig.worker.fail_stores = True  # the first copies into the tier fail
    rig.sched.add(a)
    rig.run_until(lambda: a.num_registered_blocks == 3, "a's prompt blocks computed")
    rig.wait(rig.tiers.has_stores, "a's stores prepared")
    rig.step()  # copies a's prompt blocks into their slots: the worker fails
    assert rig.tiers.counters["kv_tier_store_failures"] == 3
    assert rig.probe(a.block_hashes[:3])[0] == [] and a.status is RequestStatus.RUNNING
    rig.worker.fail_stores = False
    rig.tiers.service()  # (the loop services the tiers before it plans: newest blocks pinned)
    rig.sched._preempt(a)  # as under memory pressure: back to WAITING, from token 0
    assert rig.bm.reset_prefix_cache()  # and its freed blocks were evicted meanwhile
    rig.step()
    assert a.status is RequestStatus.WAITING_FOR_KV and rig.tiers.queued_lookups == [(a, 0)]
    rig.drain()
    assert a.num_preemptions == 1 and [s.start_pos for s in rig.seqs_of("a")].count(0) == 2
    assert rig.probe(a.block_hashes[:3])[0] == ["cpu"] * 3
    assert outputs(a) == reference([a])


@pytest.mark.parametrize("gpu_hit,first,slots,want_loaded", [
    (2, 0, [100, 101, 102, 103, 104], [102, 103, 104]),  # the local hit grew while waiting
    (4, 0, [100, 101, 102, 103, 104], [104]),
    (2, 2, [100, 101, 102], [100, 101, 102]),            # as asked
    (0, 2, [100, 101, 102], []),                         # the local hit shrank: a gap
])
def test_reservation_is_cut_to_extend_the_current_local_hit(gpu_hit, first, slots, want_loaded):
    bm = BlockManager(64, BS)
    conn = BookConnector()
    sched = Scheduler(bm, 8, 64, 400, [EOS], connector=conn)
    prompt = tokens(8, 5 * BS + 2)
    if gpu_hit:  # another request computes (and caches) the prompt's first blocks
        q = req("q", prompt[:gpu_hit * BS] + [1], 1)
        conn.book.answer(q, None)  # (it asked the store already: a miss)
        sched.add(q)
        sched.update(sched.schedule(), [5])
    b = req("b", prompt, 2)
    sched.add(b)
    assert sched.schedule() is None and conn.queued == [(b, gpu_hit)]
    assert b.status is RequestStatus.WAITING_FOR_KV and not sched.waiting
    conn.settle(b, KVLoad(first, slots, ["cpu"] * len(slots)))
    assert list(sched.waiting) == [b] and b.status is RequestStatus.WAITING
    out = sched.schedule()
    (seq,) = out.plan.seqs
    assert out.plan.kv_loads == list(zip(want_loaded, b.block_ids[gpu_hit:]))
    assert (out.plan.kv_pool, out.plan.kv_pool_pid) == (("test-pool", 1) if want_loaded else ("", 0))
    assert sorted(conn.book.to_release) == sorted(set(slots) - set(want_loaded))
    assert not conn.book.answered("b") and conn.book.hit_tokens["cpu"] == len(want_loaded) * BS
    assert seq.start_pos == (gpu_hit + len(want_loaded)) * BS


def test_blocks_renamed_before_their_store_is_prepared_are_neither_pinned_nor_stored(rigs):
    rig = rigs(num_blocks=8, budget=64)
    a = req("a", tokens(21, 3 * BS + 1), 1)  # finishes in the step that names its 3 blocks
    rig.sched.add(a)
    rig.run_until(lambda: a.is_finished, "a to finish")
    named = list(rig.tiers.stores.queued_blocks)
    assert len(named) == 3 and not rig.bm.store_pins
    assert rig.bm.reset_prefix_cache()  # the names go before the engine asks to store them
    rig.tiers.service()  # pump: nothing to store, nothing pinned (a pin would keep a free block)
    assert not rig.bm.store_pins and not rig.tiers.stores.queued_blocks
    rig.drain()
    check_blocks(rig.bm, rig.sched)
    assert rig.probe([h for _, h in named])[0] == []  # the store never got them
    b = req("b", a.prompt_token_ids, 2)  # the same prompt recomputes, with the right output
    rig.sched.add(b)
    rig.drain()
    assert outputs(b) == reference([b])
