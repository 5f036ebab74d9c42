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
from services.engine.kv_connector import KVConnector, KVLoad, KVTransfers, StorePins
from services.engine.kv_loads import LoadBook
from services.engine.kv_session import StoreSession
from services.engine.request import Request
from shared.protocol import (KVAck, KVCompleteLoad, KVCompleteStore, KVError, KVInfo,
                             KVLoadReady, KVLoadReserved, KVLookup, KVLookupResult,
                             KVPrepareStore, KVReserveLoad, KVStats, KVStorePrepared, StepPlan)


class KVStoreConnector(KVConnector):
    """One engine's connector to the kvstore.

    address: the kvstore's ZMQ address. model_identity: 32 bytes (the prefix cache root).
    block_bytes: bytes of one block as the workers lay it out in a slot. ctx: the engine's
    zmq context. Times in seconds. Attach it with `Scheduler.attach_connector`.
    Attributes read by tests and stats: session (the `StoreSession`), connected, pending
    (req_id -> TierCall), queued_lookups, queued_stores, ready_stores, book, counters.
    """

    def __init__(self, address: str, model_identity: bytes, block_bytes: int, ctx: zmq.Context,
                 reply_timeout_s: float = 3.0, load_timeout_s: float = 15.0,
                 ping_s: float = 1.0, retry_s: float = 2.0):
        super().__init__()
        self.reply_timeout_s, self.load_timeout_s, self.ping_s = (reply_timeout_s,
                                                                  load_timeout_s, ping_s)
        self.book = LoadBook(0)  # its block size is set by `bind`
        self.pending: dict[int, TierCall] = {}      # req_id -> the call waiting for a reply
        self.queued_lookups: list[tuple[Request, int]] = []  # (request, first block) to ask
        self.queued_stores: list[tuple[int, bytes]] = []     # (block, name) to prepare
        self.ready_stores: list[tuple[int, int]] = []        # (block, slot) for the next plan
        self.num_pinned = 0  # blocks this connector holds store-pinned
        self.last_ping = 0.0
        self.counters = {"kv_tier_lookups": 0, "kv_tier_loads": 0, "kv_tier_load_blocks": 0,
                         "kv_tier_store_blocks": 0, "kv_tier_store_failures": 0}
        self.session = StoreSession(address, model_identity, block_bytes, ctx, retry_s)

    def bind(self, pins: StorePins, on_lookup_done: Callable[[Request], None]) -> None:
        super().bind(pins, on_lookup_done)
        self.book.block_size = pins.block_size

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
                for blk, _ in call.blocks:
                    self._unpin(blk)
        self.pending.clear()
        asked.extend(req for req, _ in self.queued_lookups)
        self.queued_lookups.clear()
        for blk, _ in self.ready_stores:
            self._unpin(blk)
        self.ready_stores.clear()
        self.queued_stores.clear()
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

    def on_allocated(self, request: Request, block_ids: Sequence[int]) -> None:
        self.book.admit(request, block_ids)

    def on_cached(self, blocks: list[tuple[int, bytes]]) -> None:
        if self.connected:
            self.queued_stores.extend(blocks)

    def release(self, request: Request) -> None:
        self.book.release(request)

    def take_transfers(self) -> KVTransfers | None:
        """The loads booked since the last plan and the prepared stores."""
        if not self.book.step_loads and not self.ready_stores:
            return None
        stores, self.ready_stores = self.ready_stores, []
        info = self.session.info
        return KVTransfers(self.book.take_loads(), stores, info.pool_name if info else "",
                           info.store_pid if info else 0)

    def step_done(self, plan: StepPlan, store_ok: bool) -> None:
        """The step of `plan` came back: complete its loads and stores, unpin its blocks.
        store_ok: the workers copied the stores (False: they are dropped)."""
        info = self.session.info
        same = self.connected and info is not None and plan.kv_pool_pid == info.store_pid
        if plan.kv_loads and same:
            self._submit(AckCall(time.monotonic()), KVCompleteLoad,
                         slots=[s for s, _ in plan.kv_loads])
        if plan.kv_stores:
            for blk, _ in plan.kv_stores:
                self._unpin(blk)
            if same:
                self._submit(AckCall(time.monotonic()), KVCompleteStore,
                             slots=[s for _, s in plan.kv_stores], ok=store_ok)
            if store_ok:
                self.counters["kv_tier_store_blocks"] += len(plan.kv_stores)
            else:
                self.counters["kv_tier_store_failures"] += len(plan.kv_stores)

    def _settle(self, request: Request, load: KVLoad | None) -> None:
        """Book a settled lookup and take the request back into the scheduler's queue."""
        if self.book.answer(request, load):
            self._on_lookup_done(request)

    def _unpin(self, blk: int) -> None:
        self._pins.unpin_store(blk)
        self.num_pinned -= 1

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
        self.queued_stores.clear()
        for req in asked:
            self._settle(req, None)

    def _pump(self) -> None:
        """Send the queued lookups, slots to hand back and stores."""
        for req, first in self.queued_lookups:
            max_blocks = (req.num_tokens - 1) // self.book.block_size
            hashes = req.block_hashes[first:max_blocks]
            if not hashes or req.is_finished:
                self._settle(req, None)
                continue
            self.counters["kv_tier_lookups"] += 1
            self._submit(LookupCall(time.monotonic(), req, first, hashes), KVLookup, hashes=hashes)
        self.queued_lookups.clear()
        book = self.book
        if book.to_release:
            self._submit(AckCall(time.monotonic()), KVCompleteLoad, slots=book.to_release)
            book.to_release = []
        if self.queued_stores:
            # a block renamed or freed since the step named it (e.g. reset_prefix_cache in
            # between) holds other bytes now, or none: it is not stored and never pinned
            # (a pin on a free block would let it be handed out twice)
            blocks = [(blk, h) for blk, h in self.queued_stores if self._pins.is_named(blk, h)]
            self.queued_stores = []
            if not blocks:
                return
            for blk, _ in blocks:
                self._pins.pin_for_store(blk)
                self.num_pinned += 1
            self._submit(PrepareCall(time.monotonic(), blocks), KVPrepareStore,
                         hashes=[h for _, h in blocks])

    def _submit(self, call: TierCall, cls: type, **fields: Any) -> None:
        self.pending[self.session.submit(cls, **fields)] = call

    def has_stores(self) -> bool:
        """Whether stores wait for a plan (run a transfer-only step when idle)."""
        return bool(self.ready_stores)

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
            n = len(msg.tiers)
            if n == 0 or call.request.is_finished:
                self._settle(call.request, None)
                return
            self._submit(ReserveCall(time.monotonic(), call.request, call.first, msg.tiers),
                         KVReserveLoad, hashes=call.hashes[:n])
        elif isinstance(msg, KVLoadReserved) and isinstance(call, ReserveCall):
            if msg.ready:
                del self.pending[msg.req_id]
                self._load_ready(call, msg.slots)
            else:
                call.slots = msg.slots  # disk promotions run: KVLoadReady follows
        elif isinstance(msg, KVLoadReady) and isinstance(call, ReserveCall) and call.slots is not None:
            del self.pending[msg.req_id]
            self._load_ready(call, call.slots[:msg.num_ok])
        elif isinstance(msg, KVStorePrepared) and isinstance(call, PrepareCall):
            del self.pending[msg.req_id]
            for (blk, _), slot in zip(call.blocks, msg.slots):
                if slot >= 0:
                    self.ready_stores.append((blk, slot))
                else:
                    self._unpin(blk)
        elif isinstance(msg, KVAck):
            self.pending.pop(msg.req_id, None)

    def _load_ready(self, call: ReserveCall, slots: list[int]) -> None:
        if not slots:
            self._settle(call.request, None)
            return
        self.counters["kv_tier_loads"] += 1
        self.counters["kv_tier_load_blocks"] += len(slots)
        self._settle(call.request, KVLoad(call.first, list(slots), list(call.tiers[:len(slots)])))

    # ------------------------------------------------------------ stats, exit
    def stats(self) -> dict[str, Any]:
        """Counters for the engine's `stats` (hits in tokens per tier, store progress)."""
        hits = self.book.hit_tokens
        asking = len(self.queued_lookups) + sum(
            1 for c in self.pending.values()
            if isinstance(c, (LookupCall, ReserveCall)) and not c.request.is_finished)
        return {"kv_tier_connected": self.connected, "kv_tier_hits_cpu": hits.get("cpu", 0),
                "kv_tier_hits_disk": hits.get("disk", 0),
                # blocks whose store is prepared, waiting for a plan, or being copied
                "kv_tier_pending_stores": self.num_pinned,
                "kv_tier_waiting_requests": asking, **self.counters,
                "kv_tier_disconnects": self.session.disconnects,
                "kv_tier_connects": self.session.connects}

    def close(self) -> None:
        """End the session (KVBye releases the store-side pins), close the socket."""
        self.session.close()
