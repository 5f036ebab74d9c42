"""KV tiers of a hybrid model (docs/ARCHITECTURE.md §4.5, §4.7): the real Scheduler,
BlockManager, StateSlots and KVStoreConnector against a real kvstore on a thread that keeps
the recurrent-state checkpoints beside the blocks, and a toy worker whose recurrent state
per slot must be that of exactly the tokens before each seq's start_pos
(tests/unit/kv_tier_rig.py, `HybridToyWorker`).

The truth for every output is the same request run alone with no cache anywhere
(`test_prefix_cache.reference`); a tier hit that resumed from a wrong or missing checkpoint
fails the toy's state check before it could change an output.
"""

from __future__ import annotations

import random

import pytest

from services.engine.block_manager import BlockManager
from services.engine.kv_connector import KVLoad, StateLoad
from services.engine.scheduler import Scheduler
from services.engine.state_slots import StateSlots
from shared.protocol import KVPrepareStore
from tests.unit.kv_tier_rig import BS, BookConnector, TierRig
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
        made.append(TierRig(hybrid=True, **kw))
        return made[-1]

    yield make
    for rig in made:
        rig.close()


def run(rig: TierRig, r) -> None:
    rig.sched.add(r)
    rig.drain()


def loads_of(rig: TierRig, rid: str) -> tuple[int, int]:
    """(KV blocks, state checkpoints) loaded from the tier into the first plan of `rid`."""
    for p in rig.plans:
        if any(s.request_id == rid for s in p.seqs):
            return len(p.kv_loads), len(p.state_loads)
    raise AssertionError(f"{rid} never ran")


@pytest.mark.parametrize("length", [3 * BS, 3 * BS + 1, 3 * BS + 2])  # on a boundary, one past, mid-block
@pytest.mark.parametrize("flush", ["reset", "restart"])
def test_a_tier_hit_loads_the_blocks_and_their_checkpoint_and_equals_the_cold_run(rigs, length, flush):
    """The local prefix cache is flushed (reset_prefix_cache, with the worker's checkpoint
    slots scrubbed) or the engine restarts (a new engine and worker, the store kept)."""
    rig = rigs()
    prompt = tokens(length, length)
    warm = req("warm", prompt, 6)
    run(rig, warm)
    full = (length - 1) // BS  # the blocks a hit may take; the checkpoint follows the last
    names = warm.block_hashes[:full]
    c = rig.client()
    try:
        assert c.lookup(names) == ["cpu"] * full
        assert c.lookup_states(names) == [""] * (full - 1) + ["cpu"]  # one checkpoint a prompt
    finally:
        c.close()
    if flush == "reset":  # the local blocks and checkpoints are gone, and their bytes too
        assert rig.sched.reset_prefix_cache()
        rig.worker.states = [(-1, -1)] * len(rig.worker.states)
    else:
        rig.restart_engine()
    again = req("again", prompt, 6)
    run(rig, again)
    assert outputs(again) == reference([req("again", prompt, 6)])
    assert loads_of(rig, "again") == (full, 1)
    assert again.num_cached_tokens == full * BS
    stats = rig.tiers.stats()
    assert stats["kv_tier_hits_cpu"] == full * BS and stats["kv_tier_state_hits_cpu"] == 1
    c = rig.client()
    try:
        assert c.stats()["state_stored_blocks"] == 1, "the tier's checkpoint was stored again"
    finally:
        c.close()
    assert rig.worker.restores == 1 and rig.slots.num_free == rig.slots.num_slots


def test_local_blocks_without_their_checkpoint_load_only_the_checkpoint(rigs):
    rig = rigs()
    prompt = tokens(1, 4 * BS + 2)
    run(rig, req("warm", prompt, 5))
    rig.slots.forget_checkpoints()  # the local checkpoint is gone, the blocks are still cached
    again = req("again", prompt, 5)
    run(rig, again)
    assert outputs(again) == reference([req("again", prompt, 5)])
    assert loads_of(rig, "again") == (0, 1)
    assert again.num_cached_tokens == 4 * BS and rig.bm.hit_tokens == 4 * BS


def test_a_tier_run_is_cut_at_its_last_checkpoint_and_one_without_any_loads_nothing(rigs):
    """Two prompts sharing two blocks, through a store with 2 checkpoint slots: the longer
    prompt's checkpoint is evicted (LRU) by two others. Its tier hit is cut to the shorter
    prompt's checkpoint (blocks past it are not loaded); the evicted ones' prompt without a
    shorter checkpoint loads nothing and recomputes."""
    rig = rigs(n_state_slots=2)
    long = tokens(2, 5 * BS + 1)
    short = long[:2 * BS + 1]
    other = tokens(3, 3 * BS + 1)
    warms = [req(f"warm{i}", p, 4) for i, p in enumerate((long, short, other))]
    for w in warms:  # checkpoints after blocks 4, 1, then other's 2
        run(rig, w)
    c = rig.client()
    try:  # long's checkpoint (the least recently used) made room for other's
        assert c.lookup_states([warms[0].block_hashes[4], warms[1].block_hashes[1],
                                warms[2].block_hashes[2]]) == ["", "cpu", "cpu"]
    finally:
        c.close()
    assert rig.sched.reset_prefix_cache()
    a = req("a", long, 6)
    run(rig, a)
    assert outputs(a) == reference([req("a", long, 6)])
    assert loads_of(rig, "a") == (2, 1) and a.num_cached_tokens == 2 * BS
    assert rig.sched.reset_prefix_cache()
    lone = tokens(4, 3 * BS + 2)
    run(rig, req("w", lone, 3))
    run(rig, req("w2", tokens(5, 2 * BS + 1), 3))  # evicts lone's checkpoint
    run(rig, req("w3", tokens(6, 2 * BS + 1), 3))
    assert rig.sched.reset_prefix_cache()
    b = req("b", lone, 6)
    run(rig, b)
    assert outputs(b) == reference([req("b", lone, 6)])
    assert loads_of(rig, "b") == (0, 0) and b.num_cached_tokens == 0


def test_hybrid_tier_hits_under_concurrency_equal_the_cold_runs(rigs):
    rig = rigs(num_blocks=40, budget=12)
    base = tokens(7, 6 * BS)
    prompts = [base[:n] for n in (9, 12, 14, 17, 21, 24)]
    for i, p in enumerate(prompts):
        run(rig, req(f"seed{i}", p, 3))
    assert rig.sched.reset_prefix_cache()
    reqs = [req(f"r{i}", p, 7, arrival=float(i)) for i, p in enumerate(prompts * 2)]
    for r in reqs:
        rig.sched.add(r)
    rig.drain(timeout=30)
    assert outputs(*reqs) == reference([req(r.request_id, r.prompt_token_ids, 7) for r in reqs])
    s = rig.tiers.stats()
    assert s["kv_tier_state_hits_cpu"] > 0 and s["kv_tier_hits_cpu"] > 0
    assert not rig.bm.store_pins and rig.tiers.stores.num_pinned == 0


def test_a_lost_store_unpins_the_checkpoints_being_stored_and_requests_recompute(rigs):
    rig = rigs()
    prompt = tokens(8, 3 * BS + 2)
    rig.hold(KVPrepareStore)  # the store sits on the stores: the blocks and the checkpoint stay pinned
    warm = req("warm", prompt, 4)
    rig.sched.add(warm)
    rig.run_until(lambda: warm.is_finished, "the first run")
    assert len(rig.slots._pins) == 1 and len(rig.bm.store_pins) == 4, "the blocks and the checkpoint pinned"
    assert rig.tiers.stores.num_pinned == 5
    rig.stop_store()
    rig.wait(lambda: not rig.tiers.connected, "the store to be given up", timeout=15)
    assert rig.tiers.stores.num_pinned == 0 and not rig.slots._pins and not rig.bm.store_pins
    assert rig.sched.reset_prefix_cache()
    late = req("late", prompt, 6)
    rig.sched.add(late)
    rig.run_until(lambda: late.is_finished, "the request to finish without a store", timeout=20)
    assert outputs(late) == reference([req("late", prompt, 6)])
    assert loads_of(rig, "late") == (0, 0)


def test_the_scheduler_takes_the_longest_hit_ending_at_a_local_or_tier_checkpoint():
    """Six blocks are local (an earlier prompt's), blocks 6..7 loadable from the tier;
    checkpoints: a local one after block 2, the tier's after block 6. The hit ends after
    block 6 (the tier's checkpoint goes to a fresh checkpoint slot, block 7 goes back);
    without the tier's checkpoint it ends after block 2 and the whole tier run goes back."""
    for tier_ck, want_tokens, want_loads, want_state in ((6, 7 * BS, 1, True), (None, 3 * BS, 0, False)):
        bm = BlockManager(64, BS)
        slots = StateSlots(2, 2)
        conn = BookConnector()
        sched = Scheduler(bm, 2, 64, 400, [EOS], connector=conn, state_slots=slots)
        prompt = tokens(9, 8 * BS + 1)
        warm = req("warm", prompt[:6 * BS + 1], 1)
        sched.add(warm)
        while not warm.is_finished:
            out = sched.schedule()
            if out is None:  # its lookup: nothing in the tier
                conn.settle(warm, None)
                continue
            sched.update(out, [1] * sum(s.sample for s in out.plan.seqs))
        slots.forget_checkpoints()
        ck = slots.new_checkpoint(warm.block_hashes[2])
        slots.commit(ck)
        r = req("r", prompt, 2)
        sched.add(r)
        assert sched.schedule() is None and [q for q, _ in conn.queued] == [r]  # parked
        state = StateLoad(tier_ck, 9, "cpu") if tier_ck is not None else None
        conn.settle(r, KVLoad(6, [40, 41], ["cpu", "cpu"], state))
        out = sched.schedule()
        seq = out.plan.seqs[0]
        assert seq.start_pos == want_tokens and r.num_cached_tokens == want_tokens
        assert len(out.plan.kv_loads) == want_loads
        assert (out.plan.state_loads == [(9, seq.state_restore)]) is want_state
        assert seq.state_restore == ck if not want_state else seq.state_restore not in (-1, ck)
        assert conn.book.to_release == ([41] if want_state else [40, 41])
        assert not slots.has_checkpoint(r.block_hashes[6]), "a checkpoint readable before its load ran"
        sched.update(out, [1] * sum(s.sample for s in out.plan.seqs))
        assert slots.has_checkpoint(r.block_hashes[6]) is want_state  # readable once its plan came back
