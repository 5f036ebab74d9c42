"""A failed KV tier load costs a recompute, never a request (docs/ARCHITECTURE.md §4.5;
vLLM's kv_load_failure_policy "recompute").

Scheduler side: the tier rig (tests/unit/kv_tier_rig.py: the real Scheduler, BlockManager
and KVStoreConnector, a real kvstore on a thread, a toy worker copying its paged KV through
the store's pool) with the worker's loads made to fail once after a prefix was stored; the
failed copy leaves garbage in the blocks (and, for a hybrid, the checkpoint slot) it was
filling, and the toy model checks every KV entry a request reads, so a garbage block that
reached the prefix cache, or a result computed on one, fails the run. The truth is each
request run alone with no cache anywhere (`test_prefix_cache.reference`).

Engine side: the engine core's step pipeline, synchronous and async (a step planned on top
of the failed one, whose results for the failed step's requests are garbage), against the
scheduler run without failures (tests/unit/test_scheduler.py's toy model); the worker's
`KVTransfer.before_step` with a pool that cannot be copied from, and `ModelRunner.execute`
(tiny Qwen3, dummy weights) skipping the forward. End to end in one process: the engine
core, a real runner (that tiny Qwen3, or the seeded tiny Qwen3-Next hybrid of
tests/hybrid_checkpoint.py: blocks or its state checkpoint) and a real kvstore, the
runner's pool copy made to fail once (monkeypatch), against a cold run of the same runner.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.engine.executor import InProcessExecutor
from services.engine.request import RequestStatus
from services.frontend.metrics import MetricsEndpoint, RequestMetrics
from services.worker.kv_cache import KVCache, PagedKVSpec
from services.worker.kv_transfer import KVTransfer
from shared.kv_layout import KVLayout
from shared import protocol as P
from tests.unit.engine_rig import Outbox, drive
from tests.unit.kv_tier_rig import BS, TierRig
from tests.unit.test_engine_async import ToyRunner, _check, _core
from tests.unit.test_kv_tiers_engine import outputs, tokens, warm_tier
from tests.unit.test_prefix_cache import reference, req
from tests.unit.test_spec_metrics import StatsEngine


@pytest.fixture
def rigs():
    made: list[TierRig] = []

    def make(**kw) -> TierRig:
        made.append(TierRig(**kw))
        return made[-1]

    yield make
    for rig in made:
        rig.close()


def park_then_fail(rig: TierRig, running, hit) -> None:
    """`running` runs; `hit` waits for its tier lookup's answer while `running` decodes;
    then the next step, which admits `hit` with its loads beside `running`, fails them."""
    rig.sched.add(running)
    rig.step()
    rig.sched.add(hit)
    rig.step()
    assert hit.status is RequestStatus.WAITING_FOR_KV
    rig.wait(lambda: hit.status is RequestStatus.WAITING, "the tier's answer")
    rig.worker.fail_loads = 1


def test_a_failed_block_load_recomputes_the_request_and_spares_the_others(rigs):
    rig = rigs()
    prompt = tokens(1, 5 * BS + 2)
    names = warm_tier(rig, prompt)
    other = req("other", tokens(2, 7), 9)
    b = req("b", prompt, 6)
    park_then_fail(rig, other, b)
    rig.drain()
    assert outputs(b, other) == reference([req("b", prompt, 6), req("other", tokens(2, 7), 9)])
    assert [{r.request_id for r in back} for back in rig.load_failures] == [{"other", "b"}]
    assert b.no_tier_loads and not other.no_tier_loads
    failed = [p for p in rig.plans if p.kv_loads]
    assert len(failed) == 1 and len(failed[0].kv_loads) == len(names), "b never loads again"
    assert b.num_preemptions == 1 and b.num_cached_tokens == len(names) * BS
    # the blocks of the failed load never entered the prefix cache: a request reading the
    # prefix now hits b's recomputed blocks locally, and the toy checks every entry
    again = req("again", prompt, 6)
    rig.sched.add(again)
    rig.drain()
    assert outputs(again) == reference([req("again", prompt, 6)])
    assert len([p for p in rig.plans if p.kv_loads]) == 1
    assert rig.bm.num_free_blocks == rig.bm.num_blocks


def test_a_failed_checkpoint_load_of_a_hybrid_recomputes_and_frees_its_slots(rigs):
    rig = rigs(hybrid=True)
    prompt = tokens(3, 3 * BS + 1)
    warm = req("warm", prompt, 6)
    rig.sched.add(warm)
    rig.drain()
    assert rig.sched.reset_prefix_cache()
    rig.worker.states = [(-1, -1)] * len(rig.worker.states)  # the local checkpoints' bytes are gone too
    b, c = req("b", prompt, 6), req("c", tokens(4, 6), 5)
    park_then_fail(rig, c, b)
    rig.drain()
    assert outputs(b, c) == reference([req("b", prompt, 6), req("c", tokens(4, 6), 5)])
    failed = [p for p in rig.plans if p.kv_loads or p.state_loads]
    assert len(failed) == 1 and failed[0].state_loads, "the checkpoint load failed once, never again"
    assert [{r.request_id for r in back} for back in rig.load_failures] == [{"c", "b"}]
    assert b.no_tier_loads and not c.no_tier_loads
    assert rig.slots.num_free == rig.slots.num_slots, "state slots all given back"
    # the failed checkpoint slot was dropped, so b's recompute saved its own checkpoint: a new
    # request resumes from it locally and loads nothing
    full = (len(prompt) - 1) // BS
    assert rig.slots.checkpoint_of(b.block_hashes[full - 1]) is not None
    again = req("again", prompt, 6)
    rig.sched.add(again)
    rig.drain()
    assert outputs(again) == reference([req("again", prompt, 6)])
    assert len([p for p in rig.plans if p.kv_loads or p.state_loads]) == 1


class LoadFailRunner(ToyRunner):
    """The toy runner whose steps in `fail` report failed tier loads as the worker does: the
    KV the step should have written is garbage, the step samples nothing, and the draw a
    later plan's pending token reads is the dummy 0 (`ModelRunner._dummy_draw`)."""

    def __init__(self, block_size: int, fail: set[int]):
        super().__init__(block_size)
        self.fail = fail

    def execute(self, plan: P.StepPlan) -> P.StepResult:
        if plan.step_id not in self.fail:
            return super().execute(plan)
        self.model.execute(plan)
        for s in plan.seqs:
            cache = self.model.kv[s.request_id]
            cache[s.start_pos:] = [0] * (len(cache) - s.start_pos)
        self.model.last = {s.request_id: 0 for s in plan.seqs if s.sample}
        return P.StepResult(plan.step_id, [], kv_load_error="OSError: the pool is unavailable (test)")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_core_recomputes_the_requests_of_steps_whose_loads_failed(async_scheduling):
    core = _core(async_scheduling)
    runner = LoadFailRunner(block_size=4, fail={3, 8})
    outbox = Outbox()
    drive(core, InProcessExecutor(runner), async_scheduling, outbox)
    _check(outbox)  # every request completes, token for token as without failures
    assert not any(o.error for outs in outbox.outputs.values() for o in outs)
    assert core.num_kv_load_failures == 2 and core.stats()["kv_load_failures"] == 2
    if async_scheduling:
        assert runner.model.pending_fed > 0
    metrics = RequestMetrics()
    metrics.set_model("toy")
    resp = asyncio.run(MetricsEndpoint(StatsEngine(core), metrics, None)(None))  # type: ignore[arg-type]
    assert "kestrel:kv_load_failures_total{model_name=\"toy\"} 2.0" in resp.body.decode()


def test_the_worker_reports_a_load_it_cannot_copy_instead_of_raising():
    """KVTransfer.before_step on a real KV cache: a pool that is gone (a kvstore that died
    and was not restarted yet) and checkpoint loads for a dense model are reported, not
    raised; a plan without loads reports nothing."""
    spec = PagedKVSpec(1, 8)
    kv = KVCache([spec, spec], 4, 2, torch.float32, "cpu")
    lay = KVLayout(block_size=2, num_layers=2, num_kv_heads=1, head_dim=8, kv_dtype="float32",
                   elem_bytes=4, model_identity=bytes(32))
    xfer = KVTransfer(kv, lay)
    try:
        gone = P.StepPlan(5, [], kv_loads=[(0, 1)], kv_pool="kestrel-gone-kvpool", kv_pool_pid=1)
        assert xfer.before_step(gone).startswith("FileNotFoundError")
        assert xfer.before_step(P.StepPlan(6, [])) == ""
        dense = P.StepPlan(7, [], state_loads=[(0, 1)], state_pool="x", kv_pool_pid=1)
        assert xfer.before_step(dense).startswith("ValueError")
    finally:
        xfer.detach()


@pytest.fixture(scope="module")
def runner():
    import shutil

    from benchmarks.common import model_dir
    from services.worker.model_runner import ModelRunner
    from shared.config import build_config

    folder = model_dir("tiny-qwen3")
    try:
        cfg = build_config(cli={"model": folder, "load_format": "dummy", "device": "cpu",
                                "dtype": "float32", "kv_cache_gib": 0.05, "max_model_len": 512}, env={})
        yield ModelRunner(cfg)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the temporary model folder (config.json only)


def test_the_runner_skips_the_forward_of_a_step_whose_loads_failed_and_a_plan_on_top_still_runs(runner):
    """ModelRunner.execute (tiny Qwen3, dummy weights): loads from a pool that is gone are
    reported in kv_load_error, nothing is sampled and no KV is written; the next plan's
    pending tokens of that step's seqs read a dummy draw instead of failing that plan."""
    sp = P.SamplingParams(temperature=0.0)
    first = runner.execute(P.StepPlan(0, [P.ScheduledSeq("a", [5, 6, 7], 0, [0], True, sp)]))
    assert len(first.sampled_token_ids) == 1 and not first.kv_load_error
    k0 = runner.kv.k[0]
    before = k0[0].clone(), k0[1].clone()
    failed = runner.execute(P.StepPlan(1, [P.ScheduledSeq("a", [first.sampled_token_ids[0]], 3, [0], True, sp, 1),
                                           P.ScheduledSeq("b", [8, 9], 0, [1], True, sp)],
                                       kv_loads=[(0, 2)], kv_pool="kestrel-gone-kvpool", kv_pool_pid=1))
    assert failed.kv_load_error.startswith("FileNotFoundError") and failed.sampled_token_ids == []
    assert torch.equal(k0[0], before[0]) and torch.equal(k0[1], before[1]), "no forward ran"
    on_top = runner.execute(P.StepPlan(2, [P.ScheduledSeq("b", [P.PENDING_TOKEN], 2, [1], True, sp, 1),
                                           P.ScheduledSeq("c", [4, 4, 4], 0, [3], True, sp)]))
    assert not on_top.error and not on_top.kv_load_error and len(on_top.sampled_token_ids) == 2


@pytest.fixture(scope="module")
def hybrid_runner(tmp_path_factory):
    from services.worker.model_runner import ModelRunner
    from shared.config import build_config
    from tests.hybrid_checkpoint import write_tiny_qwen3_next

    path = write_tiny_qwen3_next(tmp_path_factory.mktemp("loadfail_hybrid"))
    cfg = build_config(cli={"model": str(path), "device": "cpu", "dtype": "float32", "kv_cache_gib": 0.05,
                            "max_model_len": 512}, env={})
    return ModelRunner(cfg)


@pytest.mark.parametrize("model,fail", [("dense", "block"), ("hybrid", "block"), ("hybrid", "state checkpoint")])
def test_an_engine_with_a_real_runner_and_kvstore_recomputes_a_failed_pool_load(model, fail, request, tmp_path,
                                                                                 monkeypatch):
    """EngineCore + a runner in process (tiny Qwen3 with dummy weights, or the seeded tiny
    Qwen3-Next hybrid) + a real kvstore (CPU tier, and the state pool for the hybrid) on a
    thread: a prompt is stored in the tier, the GPU-local cache emptied, and the runner's
    pool copy (of blocks, or of the hybrid's state checkpoint) made to fail once. The
    request that loads, and one running beside it, give the tokens of a cold run (the same
    runner, no cache anywhere); the failure is counted once and never retried."""
    import time
    from types import SimpleNamespace
    from typing import cast

    import zmq

    from services.engine.core import EngineCore
    from services.engine.kv_calls import PingCall
    from services.engine.kv_tiers import KVStoreConnector
    from services.engine.pipeline import StepPipeline
    from services.kvstore.server import serve_in_thread
    from services.kvstore.settings import StoreSetup
    from services.worker import kv_transfer
    from shared.config import KestrelConfig
    from shared.state_layout import StateLayout
    from tests.unit.engine_rig import core_config

    runner = request.getfixturevalue("runner" if model == "dense" else "hybrid_runner")
    info = runner.spec
    bs = runner.block_size
    settings = dict(model=info.path, load_format="dummy" if model == "dense" else "auto", dtype="float32",
                    max_model_len=512, block_size=bs, max_num_batched_tokens=64)
    layout = KVLayout.for_model(info, bs)
    state = StateLayout.for_model(info, layout)
    vocab = min(info.vocab_size, 10000)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, vocab, (3 * bs + 5,), generator=g).tolist()
    other = torch.randint(3, vocab, (9,), generator=g).tolist()
    sp = P.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(core: EngineCore, conn: KVStoreConnector | None, adds: list[tuple[str, list[int]]]) -> dict:
        outbox = Outbox()
        for rid, ids in adds:
            assert core.add(b"fe", P.AddRequest(rid, ids, sp, 0.0)) is None
        pipeline = StepPipeline(core, InProcessExecutor(runner), True)

        def tier_busy() -> bool:  # stores or loads in flight with the store (kv_tier_rig.quiet)
            return conn is not None and bool(
                core.scheduler.waiting_for_kv or conn.stores.queued_blocks or conn.stores.queued_states
                or conn.has_stores() or core.scheduler.bm.store_pins
                or any(not isinstance(c, PingCall) for c in conn.pending.values()))

        deadline = time.monotonic() + 60
        while pipeline.busy() or tier_busy():
            assert time.monotonic() < deadline, "engine loop stalled"
            if conn is not None:
                conn.service()
            if pipeline.busy() or (conn is not None and conn.has_stores()):  # a store-only plan too
                outbox.take(pipeline.advance())
            else:
                time.sleep(0.002)
        assert not any(o.error for outs in outbox.outputs.values() for o in outs)
        return {rid: outbox.tokens(rid) for rid, _ in adds}

    cold = run(EngineCore(core_config(**settings, enable_prefix_caching=False), info, runner.num_blocks),
               None, [("eb", prompt), ("eo", other)])
    address = f"ipc://{tmp_path}/kvstore.sock"
    store_cfg = cast(KestrelConfig, SimpleNamespace(instance_id="klf" + tmp_path.name[-8:], kvstore_address=address))
    sid, sbytes = (state.state_identity, state.state_bytes) if state is not None else (b"", 0)
    setup = StoreSetup(layout.model_identity, layout.slot_bytes, 32, None, 0, sid, sbytes, 8 if sbytes else 0)
    server, thread = serve_in_thread(store_cfg, setup)
    ctx = zmq.Context()
    conn = KVStoreConnector(address, layout.model_identity, layout.slot_bytes, ctx, ping_s=0.05, retry_s=0.2,
                            state_identity=sid, state_bytes=sbytes)
    try:
        core = EngineCore(core_config(**settings), info, runner.num_blocks, root_hash=layout.model_identity,
                          connector=conn)
        deadline = time.monotonic() + 10
        while not conn.connected:
            assert time.monotonic() < deadline, "no answer to the hello"
            conn.service()
            time.sleep(0.002)
        run(core, conn, [("ewarm", prompt)])
        assert conn.stats()["kv_tier_store_blocks"] == 3
        assert core.reset_prefix_cache()
        real, calls = kv_transfer.PoolCopier.load, []

        def flaky(self, name, pid, pairs):
            calls.append((self.what, len(pairs)))
            if self.what == fail and sum(c[0] == fail for c in calls) == 1:
                raise OSError("the pool is unavailable (test)")
            return real(self, name, pid, pairs)

        monkeypatch.setattr(kv_transfer.PoolCopier, "load", flaky)
        got = run(core, conn, [("eo", other), ("eb", prompt)])
        assert got == cold
        want = [("block", 3)] + ([("state checkpoint", 1)] if fail != "block" else [])
        assert calls == want, "one load, failed, and none again"
        assert core.stats()["kv_load_failures"] == 1 and core.requests == {}
    finally:
        conn.close()
        server.stopping = True
        thread.join(5)
        server.close()
        ctx.destroy(linger=0)
