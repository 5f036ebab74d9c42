"""The kvstore behind the KV connector seam (docs/ARCHITECTURE.md §4 "Tiers"): tier loads
and stores for the scheduler (`services.engine.kv_connector` says who calls what).

Everything is asynchronous on the engine's loop: `KVStoreClient.submit` sends, the engine
polls `socket` next to its other sockets and calls `service()`, which reads the replies,
keeps the connection and sends what the scheduler's calls queued. Nothing here ever waits
for the store, and nothing here edits the scheduler's queues or requests: the answers go
back through `kv_lookup_done` and the return values, the reservations stay in the
connector's `LoadBook`.

Loads: `lookup` queues KVLookup(hashes after the local hit) -> hits? KVReserveLoad(the hit
  run) -> KVLoadReserved (and KVLoadReady after disk promotions) -> the reservation is
  booked and the scheduler told -> at admission it is cut to the local hit
  (`LoadBook.usable`) -> the plan's kv_loads -> after that step's result:
  KVCompleteLoad(slots). Slots nobody needs go back in a KVCompleteLoad too.
Stores: blocks newly registered in the GPU prefix cache (`on_cached`) are store-pinned in
  the block manager (never evicted or reallocated) -> KVPrepareStore -> slots >= 0 go into
  the next plan's kv_stores (a transfer-only plan when nothing else runs), -1 are unpinned
  -> after that step's result: KVCompleteStore(slots, ok) and unpin. Order: a block's store
  is prepared before its pin is released, and completed only after the step that copied it
  has come back.

Checkpoints (a hybrid model, docs/ARCHITECTURE.md §4.7; the scheduler's `StateSlots` bound as
  `CheckpointPins`): a lookup also asks which checkpoints the store holds after the blocks
  from the end of the locally checkpointed hit on (`state_hashes`); the run is reserved up to
  the last block with a checkpoint, local or in the store (`hit_end`), with that checkpoint
  when it is the store's -> it joins the plan's state_loads into the checkpoint slot the
  scheduler gives (`on_allocated`). Checkpoints saved by a step (`on_checkpoints`) are
  stored like blocks: pinned in the state slots while KVPrepareStore, the plan's
  state_stores and KVCompleteStore run.
Failures: no reply within `reply_timeout_s` (a ping every `ping_s` keeps this honest while
idle), a KVError (e.g. a restarted store that never saw our hello), or a refused hello
makes the store "lost": logged once, tiers off (`lookup` answers 0, `on_cached` ignores),
requests whose lookup is in flight are answered "nothing to load" (they recompute),
reservations are dropped without handing their slots back (the dead store's pins died with
it), pending stores are unpinned. A new session (new KVHello) is attempted every `retry_s`
until the store answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from services.engine.kv_calls import (AckCall, LookupCall, PingCall, PrepareCall, ReserveCall,
                                      TierCall)
from services.engine.kv_connector import (CheckpointPins, KVConnector, KVLoad, KVTransfers, StateLoad,
                                          StorePins)
from services.engine.kv_loads import LoadBook, hit_end
from services.engine.kv_stores import StoreBook
from services.engine.kv_session import StoreSession
from services.engine.request import Request
from shared.protocol import (KVAck, KVCompleteLoad, KVCompleteStore, KVError, KVInfo,
                             KVLoadReady, KVLoadReserved, KVLookup, KVLookupResult,
                             KVPrepareStore, KVReserveLoad, KVStats, KVStorePrepared, StepPlan)


class KVStoreConnector(KVConnector):
    """One engine's connector to the kvstore.

    address: the kvstore's ZMQ address. model_identity: 32 bytes (the prefix cache root).
    block_bytes: bytes of one block as the workers lay it out in a slot. ctx: the engine's
    zmq context. state_identity, state_bytes: a hybrid model's state checkpoints
    (`shared.state_layout.StateLayout`; b"" and 0 for a dense model). Times in seconds.
    Attach it with `Scheduler.attach_connector`. Attributes read by tests and stats:
    session (the `StoreSession`), connected, pending (req_id -> TierCall), queued_lookups,
    book (the loads' `LoadBook`), stores (the stores' `StoreBook`), counters.
    """

    def __init__(self, address: str, model_identity: bytes, block_bytes: int, ctx: zmq.Context,
                 reply_timeout_s: float = 3.0, load_timeout_s: float = 15.0,
                 ping_s: float = 1.0, retry_s: float = 2.0, state_identity: bytes = b"",
                 state_bytes: int = 0):
        super().__init__()
        self.reply_timeout_s, self.load_timeout_s, self.ping_s = (reply_timeout_s,
                                                                  load_timeout_s, ping_s)
        self.book = LoadBook(0)  # its block size is set by `bind`
        self.pending: dict[int, TierCall] = {}      # req_id -> the call waiting for a reply
        self.queued_lookups: list[tuple[Request, int]] = []  # (request, first block) to ask
        self.stores = StoreBook(self._pins)  # bound to the block manager by `bind`
        self.last_ping = 0.0
        self.counters = {"kv_tier_lookups": 0, "kv_tier_loads": 0, "kv_tier_load_blocks": 0,
                         "kv_tier_store_blocks": 0, "kv_tier_store_failures": 0,
                         "kv_tier_state_stores": 0}
        self.session = StoreSession(address, model_identity, block_bytes, ctx, retry_s,
                                    state_identity, state_bytes)

    def bind(self, pins: StorePins, on_lookup_done: Callable[[Request], None],
             checkpoints: CheckpointPins | None = None) -> None:
        super().bind(pins, on_lookup_done, checkpoints)
        self.book.block_size = pins.block_size
        self.book.checkpoints = checkpoints
        self.stores = StoreBook(pins, checkpoints)

    @property
    def connected(self) -> bool:
        """Whether the store took this session's hello (tiers on)."""
        return self.session.connected

    @property
    def socket(self) -> zmq.Socket | None:
        """The socket to poll for replies (changes on reconnect; None once closed)."""
        return self.session.socket

    def _lost(self, why: str) -> None:
        """Carry on without tiers (module doc); the session starts a new one."""
        self.session.lost(why)
        asked: list[Request] = []
        for call in self.pending.values():
            if isinstance(call, (LookupCall, ReserveCall)):
                asked.append(call.request)
            elif isinstance(call, PrepareCall):
                self.stores.unpin_prepared(call.blocks, call.states)
        self.pending.clear()
        asked.extend(req for req, _ in self.queued_lookups)
        self.queued_lookups.clear()
        self.stores.lost()
        self.book.store_lost()
        for req in asked:
            self._settle(req, None)

    # ------------------------------------------------------------ scheduler role
    def lookup(self, request: Request, num_local_blocks: int) -> int | None:
        """See `KVConnector.lookup` and `LoadBook.lookup` (asks only while connected)."""
        n = self.book.lookup(request, num_local_blocks, self.connected)
        if n is None:  # sent by the next `service`
            self.queued_lookups.append((request, num_local_blocks))
        return n

    def tier_checkpoint(self, request: Request) -> int | None:
        return self.book.checkpoint_index(request)

    def on_allocated(self, request: Request, block_ids: Sequence[int], state_slot: int = -1) -> None:
        self.book.admit(request, block_ids, state_slot)

    def on_cached(self, blocks: list[tuple[int, bytes]]) -> None:
        if self.connected:
            self.stores.queue_blocks(blocks)

    def on_checkpoints(self, saved: list[tuple[bytes, int]]) -> None:
        if self.connected:
            self.stores.queue_states(saved)

    def release(self, request: Request) -> None:
        self.book.release(request)

    def take_transfers(self) -> KVTransfers | None:
        """The loads booked since the last plan and the prepared stores."""
        book = self.book
        if not (book.step_loads or book.step_state_loads or self.stores.has_ready()):
            return None
        stores, state_stores = self.stores.take_ready()
        info = self.session.info
        return KVTransfers(book.take_loads(), stores, info.pool_name if info else "",
                           info.store_pid if info else 0, book.take_state_loads(), state_stores,
                           info.state_pool_name if info else "")

    def step_done(self, plan: StepPlan, store_ok: bool) -> None:
        """The step of `plan` came back: complete its loads and stores, unpin its blocks and
        checkpoint slots. store_ok: the workers copied the stores (False: they are dropped)."""
        info = self.session.info
        same = self.connected and info is not None and plan.kv_pool_pid == info.store_pid
        if (plan.kv_loads or plan.state_loads) and same:
            self._submit(AckCall(time.monotonic()), KVCompleteLoad,
                         slots=[s for s, _ in plan.kv_loads], state_slots=[s for s, _ in plan.state_loads])
        if plan.kv_stores or plan.state_stores:
            self.stores.done(plan.kv_stores, plan.state_stores)
            if same:
                self._submit(AckCall(time.monotonic()), KVCompleteStore,
                             slots=[s for _, s in plan.kv_stores], ok=store_ok,
                             state_slots=[s for _, s in plan.state_stores])
            if store_ok:
                self.counters["kv_tier_store_blocks"] += len(plan.kv_stores)
                self.counters["kv_tier_state_stores"] += len(plan.state_stores)
            else:
                self.counters["kv_tier_store_failures"] += len(plan.kv_stores) + len(plan.state_stores)

    def _settle(self, request: Request, load: KVLoad | None) -> None:
        """Book a settled lookup and take the request back into the scheduler's queue."""
        if self.book.answer(request, load):
            self._on_lookup_done(request)

    # ------------------------------------------------------------ the loop's entry points
    def service(self) -> None:
        """Read replies, check timeouts, ping, reconnect, and send what the scheduler's
        calls queued (lookups, released reservations, stores). Never blocks."""
        try:
            replies = self.session.replies()
        except zmq.ZMQError as e:
            self._lost(f"socket error {e}")
            return
        for msg in replies:
            self._on_reply(msg)
        now = time.monotonic()
        if not self.connected:
            self.session.retry(now)
            self._drain_without_store()
            return
        for call in self.pending.values():
            limit = self.load_timeout_s if isinstance(call, ReserveCall) else self.reply_timeout_s
            if now - call.sent > limit:
                self._lost(f"no reply to {call.kind} in {limit:.0f} s")
                return
        if now - self.last_ping > self.ping_s:
            self.last_ping = now
            self._submit(PingCall(now), KVStats)
        self._pump()

    def _drain_without_store(self) -> None:
        asked = [req for req, _ in self.queued_lookups]
        self.queued_lookups.clear()
        self.book.to_release.clear()
        self.book.to_release_states.clear()
        self.stores.clear_queued()
        for req in asked:
            self._settle(req, None)

    def _pump(self) -> None:
        """Send the queued lookups, slots to hand back and stores."""
        book = self.book
        for req, first in self.queued_lookups:
            max_blocks = (req.num_tokens - 1) // book.block_size
            hashes = req.block_hashes[first:max_blocks]
            # a hybrid: the checkpoints that would extend its locally checkpointed hit
            state_first = book.local_checkpoint_end(req, first)
            state_hashes = req.block_hashes[state_first:max_blocks] if self._checkpoints is not None else []
            if not (hashes or state_hashes) or req.is_finished:
                self._settle(req, None)
                continue
            self.counters["kv_tier_lookups"] += 1
            self._submit(LookupCall(time.monotonic(), req, first, hashes, state_first), KVLookup,
                         hashes=hashes, state_hashes=state_hashes)
        self.queued_lookups.clear()
        if book.to_release or book.to_release_states:
            self._submit(AckCall(time.monotonic()), KVCompleteLoad, slots=book.to_release,
                         state_slots=book.to_release_states)
            book.to_release, book.to_release_states = [], []
        blocks, states = self.stores.take_prepare()  # pinned until their store is done
        if not blocks and not states:
            return
        self._submit(PrepareCall(time.monotonic(), blocks, states), KVPrepareStore,
                     hashes=[h for _, h in blocks], state_hashes=[h for h, _ in states])

    def _submit(self, call: TierCall, cls: type, **fields: Any) -> None:
        self.pending[self.session.submit(cls, **fields)] = call

    def has_stores(self) -> bool:
        """Whether stores wait for a plan (run a transfer-only step when idle)."""
        return self.stores.has_ready()

    # ------------------------------------------------------------ replies
    def _on_reply(self, msg: Any) -> None:
        if isinstance(msg, KVInfo):
            if not self.connected:
                self.session.on_info(msg)
                if self.connected:
                    self.last_ping = time.monotonic()
            return
        if isinstance(msg, KVError):
            if self.connected:
                self._lost(f"the store answered {msg.error!r}")
            return
        call = self.pending.get(msg.req_id)
        if call is None or not self.connected:
            return
        if isinstance(msg, KVLookupResult) and isinstance(call, LookupCall):
            del self.pending[msg.req_id]
            self._reserve(call, msg)
        elif isinstance(msg, KVLoadReserved) and isinstance(call, ReserveCall):
            if msg.ready:
                del self.pending[msg.req_id]
                self._load_ready(call, msg.slots, msg.state_slots)
            else:  # disk promotions run: KVLoadReady follows
                call.slots, call.state_slots = msg.slots, msg.state_slots
        elif isinstance(msg, KVLoadReady) and isinstance(call, ReserveCall) and call.slots is not None:
            del self.pending[msg.req_id]
            self._load_ready(call, call.slots[:msg.num_ok], (call.state_slots or [])[:msg.state_ok])
        elif isinstance(msg, KVStorePrepared) and isinstance(call, PrepareCall):
            del self.pending[msg.req_id]
            self.stores.prepared(call.blocks, msg.slots, call.states, msg.state_slots)
        elif isinstance(msg, KVAck):
            self.pending.pop(msg.req_id, None)

    def _reserve(self, call: LookupCall, msg: KVLookupResult) -> None:
        """A lookup's answer: reserve the run that extends the hit (for a hybrid, up to the
        last block with a checkpoint, local or the store's, with the store's checkpoint),
        or settle the request with nothing to load."""
        req = call.request
        n = len(msg.tiers)
        if req.is_finished:
            self._settle(req, None)
            return
        state_index = -1
        if self._checkpoints is not None:
            end, state_index = hit_end(req, self._checkpoints, call.first + n, call.state_first,
                                       msg.state_tiers)
            n = max(0, end - call.first)
        if n == 0 and state_index < 0:
            self._settle(req, None)
            return
        tier = msg.state_tiers[state_index - call.state_first] if state_index >= 0 else ""
        self._submit(ReserveCall(time.monotonic(), req, call.first, msg.tiers[:n], state_index=state_index,
                                 state_tier=tier), KVReserveLoad, hashes=call.hashes[:n],
                     state_hashes=[req.block_hashes[state_index]] if state_index >= 0 else [])

    def _load_ready(self, call: ReserveCall, slots: list[int], state_slots: list[int]) -> None:
        state = (StateLoad(call.state_index, state_slots[0], call.state_tier)
                 if state_slots and call.state_index >= 0 else None)
        if state is None and state_slots:  # a checkpoint nobody asked for goes back
            self.book.to_release_states.extend(state_slots)
        if not slots and state is None:
            self._settle(call.request, None)
            return
        self.counters["kv_tier_loads"] += 1
        self.counters["kv_tier_load_blocks"] += len(slots)
        self._settle(call.request, KVLoad(call.first, list(slots), list(call.tiers[:len(slots)]), state))

    # ------------------------------------------------------------ stats, exit
    def stats(self) -> dict[str, Any]:
        """Counters for the engine's `stats` (hits in tokens per tier, store progress)."""
        hits = self.book.hit_tokens
        asking = len(self.queued_lookups) + sum(
            1 for c in self.pending.values()
            if isinstance(c, (LookupCall, ReserveCall)) and not c.request.is_finished)
        states = self.book.state_hits
        # a hybrid model's state checkpoints loaded from each tier and stored
        extra = {"kv_tier_state_hits_cpu": states.get("cpu", 0), "kv_tier_state_hits_disk": states.get("disk", 0),
                 "kv_tier_state_stores": self.counters["kv_tier_state_stores"]} if self._checkpoints is not None else {}
        counters = {k: v for k, v in self.counters.items() if k != "kv_tier_state_stores"}
        return {"kv_tier_connected": self.connected, "kv_tier_hits_cpu": hits.get("cpu", 0),
                "kv_tier_hits_disk": hits.get("disk", 0), **extra,
                # blocks and checkpoints whose store is prepared, waiting for a plan, or being copied
                "kv_tier_pending_stores": self.stores.num_pinned,
                "kv_tier_waiting_requests": asking, **counters,
                "kv_tier_disconnects": self.session.disconnects,
                "kv_tier_connects": self.session.connects}

    def close(self) -> None:
        """End the session (KVBye releases the store-side pins), close the socket."""
        self.session.close()
