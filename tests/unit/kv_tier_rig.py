"""An engine with KV tiers inside one test process, for the tier unit tests.

Engine side: the real Scheduler, BlockManager and KVStoreConnector
(services/engine/kv_tiers.py), driven in the order of `EngineProcess.run` / `StepPipeline.advance`. Store side: a real
kvstore (`services.kvstore.server.serve_in_thread`: its index, its shm pool, its ZMQ socket) on a
thread. Worker side: `ToyWorker`, whose paged "KV cache" is the prefix-cache tests'
`BlockKVModel` ((block, offset) -> (position, token, digest of the context)), and whose
tier copies move those entries through the pool slots byte for byte, before the forward
(loads) and after it (stores), as services/worker/kv_transfer.py does. A block loaded with
the wrong bytes, into the wrong block or not at all fails the toy model's checks when the
request samples.

`BookConnector` is a connector without a store, for scheduler tests: the test settles its
lookups (`settle`); its policy and reservations are the real `LoadBook`'s.

`TierRig(hybrid=True)`: a hybrid model (docs/ARCHITECTURE.md §4.7): the scheduler holds
`StateSlots` and the store a state checkpoints' space; `HybridToyWorker` also keeps a
recurrent state per state slot (tokens seen, running digest of them: the digest the KV
entries carry), restores, saves and moves checkpoints through the state pool as the real
worker does, and checks before every seq that its slot holds the state of exactly the
tokens before start_pos (the KV's digest at start_pos - 1), so a wrong, stale or missing
checkpoint fails the run.
"""

from __future__ import annotations

import shutil
import struct
import tempfile
import time
import uuid
from collections import Counter
from types import SimpleNamespace
from typing import cast

import zmq

from services.engine.block_manager import BlockManager
from services.engine.kv_calls import PingCall
from services.engine.kv_connector import KVConnector, KVLoad, KVTransfers, StorePins
from services.engine.kv_loads import LoadBook
from services.engine.kv_tiers import KVStoreConnector
from services.engine.request import Request
from services.engine.scheduler import Scheduler
from shared.kvstore_client import KVStoreClient
from shared.kv_pool import KVPool
from services.kvstore.server import serve_in_thread
from services.kvstore.settings import StoreSetup
from shared.config import KestrelConfig
from shared.hashing import model_identity_hash
from shared.protocol import StepPlan
from services.engine.state_slots import StateSlots
from tests.unit.test_prefix_cache import EOS, BlockKVModel, mix

BS = 4                                  # tokens per block
ENTRY = struct.Struct("<qqqq")          # a token's KV in a slot: written?, position, token, digest
SLOT_BYTES = BS * ENTRY.size
STATE = struct.Struct("<qq")            # a toy recurrent state: tokens seen, their digest
STATE_IDENTITY = bytes(range(32))       # the toy's state identity


class ToyWorker:
    """Runs plans on a BlockKVModel and copies blocks to and from the kvstore's pool.

    fail_stores: when True the stores of a plan are not copied and reported failed, as the
    real worker reports a pool it cannot map (`StepResult.kv_store_error`).
    fail_loads: the next so many plans with tier loads fail them as a broken pool would, half
    way: the blocks (and checkpoint slots) they fill get garbage; the step runs no forward
    and reports `load_error` (`StepResult.kv_load_error`). load_error: the last plan's.
    """

    def __init__(self, bm: BlockManager):
        self.model = BlockKVModel(bm.block_size, bm)
        self.fail_stores = False
        self.fail_loads = 0
        self.load_error = ""

    def failed_loads(self, plan: StepPlan) -> bool:
        """Whether this plan's loads fail (`fail_loads`); if so its blocks get garbage."""
        self.load_error = ""
        if not (plan.kv_loads or plan.state_loads) or self.fail_loads <= 0:
            return False
        self.fail_loads -= 1
        self.load_error = "OSError: the pool is unavailable (test)"
        for _, blk in plan.kv_loads:  # a copy cut short: wrong entries in every block
            for off in range(BS):
                self.model.kv[(blk, off)] = (off, 1, 12345)
        return True

    @staticmethod
    def dropped_stores(plan: StepPlan) -> str:
        """The store error of a plan whose loads failed: its stores are not copied here."""
        return "OSError: stores skipped after the failed loads (test)" if plan.kv_stores or plan.state_stores else ""

    def execute(self, plan: StepPlan) -> tuple[list[int], str]:
        """Loads, forward, stores. Returns (sampled tokens, store error or "")."""
        if self.failed_loads(plan):
            return [], self.dropped_stores(plan)
        self.load(plan)
        return self.forward_and_store(plan)

    def load(self, plan: StepPlan) -> None:
        """The plan's KV loads (before its forward)."""
        if plan.kv_loads:
            pool = KVPool.attach(plan.kv_pool)
            for slot, blk in plan.kv_loads:
                raw = bytes(pool.slot(slot))
                for off in range(BS):
                    written, pos, tok, digest = ENTRY.unpack_from(raw, off * ENTRY.size)
                    if written:
                        self.model.kv[(blk, off)] = (pos, tok, digest)
                    else:
                        self.model.kv.pop((blk, off), None)
            pool.close()

    def forward_and_store(self, plan: StepPlan) -> tuple[list[int], str]:
        """The forward, then the plan's KV stores. Returns (sampled tokens, store error or "")."""
        sampled = self.model.execute(plan)
        if not plan.kv_stores:
            return sampled, ""
        if self.fail_stores:
            return sampled, "OSError: the pool is unavailable (test)"
        pool = KVPool.attach(plan.kv_pool)
        for blk, slot in plan.kv_stores:
            out = bytearray(SLOT_BYTES)
            for off in range(BS):
                entry = self.model.kv.get((blk, off))
                if entry is not None:
                    ENTRY.pack_into(out, off * ENTRY.size, 1, *entry)
            pool.slot(slot)[:] = out
        pool.close()
        return sampled, ""


class HybridToyWorker(ToyWorker):
    """A ToyWorker with a recurrent state per state slot (module doc). Attributes: states
    ((tokens, digest) per slot: num_slots request slots, then the checkpoint slots),
    restores (seqs that resumed from a checkpoint)."""

    def __init__(self, bm: BlockManager, num_slots: int):
        super().__init__(bm)
        self.states: list[tuple[int, int]] = [(0, 0)] * num_slots
        self.restores = 0

    def execute(self, plan: StepPlan) -> tuple[list[int], str]:
        if self.failed_loads(plan):
            for _, ck in plan.state_loads:
                self.states[ck] = (1, 12345)
            return [], self.dropped_stores(plan)
        self.load(plan)
        if plan.state_loads:  # before the step, before any restore reads them
            pool = KVPool.attach(plan.state_pool)
            for slot, ck in plan.state_loads:
                self.states[ck] = STATE.unpack(bytes(pool.slot(slot)))
            pool.close()
        for s in plan.seqs:
            if s.state_restore >= 0:
                self.states[s.state_slot] = self.states[s.state_restore]
                self.restores += 1
        self.model.state.resolve(plan)
        for s in plan.seqs:  # the state each seq continues from is that of its first start_pos tokens
            n, h = self.states[s.state_slot] if s.start_pos else (0, 0)
            want = self.model.read(s.block_table, s.start_pos - 1)[2] if s.start_pos else 0
            assert (n, h) == (s.start_pos, want), f"{s.request_id}: state of {n} tokens, start_pos {s.start_pos}"
            for t in s.token_ids:
                n, h = n + 1, mix(h, t)
            self.states[s.state_slot] = (n, h)
        sampled, err = self.forward_and_store(plan)
        for s in plan.seqs:
            if s.state_save >= 0:
                self.states[s.state_save] = self.states[s.state_slot]
        if plan.state_stores and not err:
            if self.fail_stores:
                return sampled, "OSError: the pool is unavailable (test)"
            pool = KVPool.attach(plan.state_pool)
            for ck, slot in plan.state_stores:
                pool.slot(slot)[:] = STATE.pack(*self.states[ck])
            pool.close()
        return sampled, err


def check_blocks(bm: BlockManager, sched: Scheduler) -> None:
    """Ref counts match the tables; free, evictable and held/pinned blocks are disjoint and
    cover the cache; a store-pinned block is neither free nor evictable."""
    holders = Counter(b for r in sched.requests.values() for b in r.block_ids)
    assert all(bm.ref_cnt[b] == holders[b] for b in range(bm.num_blocks)), "ref counts"
    free, evict, pinned = set(bm.free_blocks), set(bm.evictable), set(bm.store_pins)
    assert len(free) == len(bm.free_blocks), "a block twice in the free list"
    assert free.isdisjoint(evict) and free.isdisjoint(holders) and evict.isdisjoint(holders)
    assert pinned.isdisjoint(free | evict), "a store-pinned block is allocatable"
    assert len(free | evict | set(holders) | pinned) == bm.num_blocks, "blocks leaked"


class TierRig:
    """One engine + kvstore + toy worker. Times in seconds; see the module doc.

    Attributes: bm, sched, tiers, worker, plans (every plan run, in order), held (store
    requests held back by `hold`).
    """

    def __init__(self, num_blocks: int = 64, n_slots: int = 64, budget: int = 16,
                 max_num_seqs: int = 8, reply_timeout_s: float = 2.0, hybrid: bool = False,
                 n_state_slots: int = 16):
        self.runtime = tempfile.mkdtemp(prefix="kvu-")
        self.instance = "kvu" + uuid.uuid4().hex[:8]
        self.address = f"ipc://{self.runtime}/kvstore.sock"
        self.root = model_identity_hash("toy-model", "float32", "float32", BS)
        self.n_slots, self.n_state_slots = n_slots, n_state_slots
        self.state_identity, self.state_bytes = (STATE_IDENTITY, STATE.size) if hybrid else (b"", 0)
        self._engine_args = (num_blocks, budget, max_num_seqs, reply_timeout_s, hybrid)
        self.plans: list[StepPlan] = []
        self.load_failures: list[list[Request]] = []  # per step whose loads failed: the requests sent back
        self.held: list = []
        self._hold_kinds: tuple = ()
        self.start_store()
        self.ctx = zmq.Context()
        self.start_engine()

    def start_engine(self) -> None:
        """A new engine and worker (nothing cached, fresh state slots) with a new session
        of the store, as after an engine restart."""
        num_blocks, budget, max_num_seqs, reply_timeout_s, hybrid = self._engine_args
        self.bm = BlockManager(num_blocks, BS, root_hash=self.root)
        self.slots = StateSlots(max_num_seqs, max_num_seqs) if hybrid else None
        self.sched = Scheduler(self.bm, max_num_seqs, budget, 400, [EOS], state_slots=self.slots)
        self.worker = HybridToyWorker(self.bm, 2 * max_num_seqs) if hybrid else ToyWorker(self.bm)
        self.tiers = KVStoreConnector(self.address, self.root, SLOT_BYTES, self.ctx,
                                      reply_timeout_s=reply_timeout_s,
                                      load_timeout_s=reply_timeout_s, ping_s=0.05, retry_s=0.2,
                                      state_identity=self.state_identity, state_bytes=self.state_bytes)
        self.sched.attach_connector(self.tiers)
        self.wait(lambda: self.tiers.connected, "the store's answer to the engine's hello")

    def restart_engine(self) -> None:
        """The engine dies (its session is not closed) and a new one starts (`start_engine`)."""
        self.tiers.session.client.close(bye=False)
        self.start_engine()

    # ------------------------------------------------------------ the store
    def start_store(self) -> None:
        """Start a kvstore on a thread at this rig's address (empty pool)."""
        # the two settings the server reads
        cfg = cast(KestrelConfig, SimpleNamespace(instance_id=self.instance,
                                                  kvstore_address=self.address))
        setup = StoreSetup(self.root, SLOT_BYTES, self.n_slots, None, 0, self.state_identity,
                           self.state_bytes, self.n_state_slots if self.state_bytes else 0)
        self.server, self.thread = serve_in_thread(cfg, setup)
        real = self.server._handle

        def handle(rid, msg):  # the store's thread: hold back, or answer held ones first
            if self._hold_kinds and isinstance(msg, self._hold_kinds):
                self.held.append((rid, msg))
                return
            while self.held and not self._hold_kinds:
                real(*self.held.pop(0))
            real(rid, msg)

        self.server._handle = handle  # type: ignore[method-assign]  # the rig wraps the handler

    def stop_store(self) -> None:
        """Stop the kvstore as a dying process would: its socket and pool go away."""
        self.server.stopping = True
        self.thread.join(5)
        self.server.close()
        self.held.clear()

    def hold(self, *kinds) -> None:
        """Make the store sit on requests of these shared.protocol classes (a slow store)
        until `release`; they are answered when its next message arrives (a ping)."""
        self._hold_kinds = kinds

    def release(self) -> None:
        self._hold_kinds = ()

    def probe(self, hashes: list[bytes]) -> tuple[list[str], dict]:
        """(tiers of the longest stored run of `hashes`, the store's counters), asked over
        a session of its own."""
        c = self.client()
        try:
            return c.lookup(hashes), c.stats()
        finally:
            c.close()

    def client(self) -> KVStoreClient:
        """A connected session of the test's own with the store."""
        c = KVStoreClient(self.address, "probe", self.root, SLOT_BYTES, timeout_s=5.0, ctx=self.ctx,
                          state_identity=self.state_identity, state_bytes=self.state_bytes)
        c.connect()
        return c

    # ------------------------------------------------------------ the engine loop
    def step(self) -> StepPlan | None:
        """One turn of the engine loop: service the tiers, plan, run the plan on the toy
        worker, complete its transfers, apply its tokens; a transfer-only plan when nothing
        else runs and stores are ready. Returns the plan run, or None."""
        self.tiers.service()
        out = self.sched.schedule()
        plan = out.plan if out is not None else self.sched.transfer_plan()
        if plan is None:
            return None
        self.worker.model.state.resolve(plan)  # whole tables (execute resolves again: a no-op)
        written = {s.block_table[i] for s in plan.seqs  # blocks the forward writes into
                   for i in range(s.start_pos // BS, -(-(s.start_pos + len(s.token_ids)) // BS))}
        assert written.isdisjoint(b for b, _ in plan.kv_stores), "a step writes a block it stores"
        sampled, store_error = self.worker.execute(plan)
        self.sched.transfers_done(plan, not store_error)
        if out is not None and self.worker.load_error:  # as EngineCore.finish_step: recompute
            self.load_failures.append(self.sched.loads_failed(out))
        elif out is not None:
            self.sched.update(out, sampled)
        check_blocks(self.bm, self.sched)
        self.plans.append(plan)
        return plan

    def _idle(self) -> None:
        sock = self.tiers.socket
        if sock is not None:
            sock.poll(10)  # wakes on the store's reply

    def wait(self, pred, what: str, timeout: float = 10.0) -> None:
        """Service the tiers (no steps) until pred() holds. Raises AssertionError."""
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            self.tiers.service()
            self._idle()

    def run_until(self, pred, what: str, timeout: float = 10.0) -> None:
        """Run engine steps until pred() holds. Raises AssertionError."""
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            if self.step() is None:
                self._idle()

    def quiet(self) -> bool:
        """Nothing left: no request, no store or load in flight."""
        return (not self.sched.requests and not self.sched.waiting_for_kv
                and not self.tiers.stores.queued_blocks and not self.tiers.stores.queued_states
                and not self.tiers.has_stores()
                and not self.bm.store_pins
                and not any(not isinstance(c, PingCall) for c in self.tiers.pending.values()))

    def drain(self, timeout: float = 10.0) -> None:
        """Run until every request finished and every transfer is complete."""
        self.run_until(self.quiet, "the requests and transfers to finish", timeout)

    def seqs_of(self, rid: str) -> list:
        """The ScheduledSeq of request `rid` in every plan run so far, in order."""
        return [s for p in self.plans for s in p.seqs if s.request_id == rid]

    def close(self) -> None:
        """Close the engine's session, stop the store, remove the runtime folder."""
        self.tiers.close()
        if not self.server._closed:
            self.stop_store()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.runtime, ignore_errors=True)


class BookConnector(KVConnector):
    """A KV connector whose store is the test (module doc). Attributes: book (the real
    LoadBook), queued ((request, first block) asked and not yet settled), cached (blocks
    handed to `on_cached`), done ((plan, store_ok) of `step_done`)."""

    def __init__(self) -> None:
        super().__init__()
        self.book = LoadBook(0)
        self.queued: list[tuple[Request, int]] = []
        self.cached: list[tuple[int, bytes]] = []
        self.done: list[tuple[StepPlan, bool]] = []

    def bind(self, pins: StorePins, on_lookup_done, checkpoints=None) -> None:
        super().bind(pins, on_lookup_done, checkpoints)
        self.book.block_size = pins.block_size
        self.book.checkpoints = checkpoints

    def settle(self, request: Request, load: KVLoad | None) -> None:
        """The store's answer to the queued lookup of `request`."""
        self.queued = [(r, f) for r, f in self.queued if r is not request]
        if self.book.answer(request, load):
            self._on_lookup_done(request)

    def lookup(self, request: Request, num_local_blocks: int) -> int | None:
        n = self.book.lookup(request, num_local_blocks, True)
        if n is None:
            self.queued.append((request, num_local_blocks))
        return n

    def tier_checkpoint(self, request: Request) -> int | None:
        return self.book.checkpoint_index(request)

    def on_allocated(self, request: Request, block_ids, state_slot: int = -1) -> None:
        self.book.admit(request, block_ids, state_slot)

    def on_cached(self, blocks: list[tuple[int, bytes]]) -> None:
        self.cached.extend(blocks)

    def release(self, request: Request) -> None:
        self.book.release(request)

    def take_transfers(self) -> KVTransfers | None:
        loads, state_loads = self.book.take_loads(), self.book.take_state_loads()
        return KVTransfers(loads, [], "test-pool", 1, state_loads, [], "test-state-pool") \
            if loads or state_loads else None

    def step_done(self, plan: StepPlan, store_ok: bool) -> None:
        self.done.append((plan, store_ok))

    @property
    def socket(self) -> None:
        return None

    def service(self) -> None:
        pass

    def has_stores(self) -> bool:
        return False

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass
