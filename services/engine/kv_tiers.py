"""The engine's client of the kvstore (DESIGN §4 "Tiers"): tier loads and stores.

Everything is asynchronous on the engine's loop: `KVStoreClient.submit` sends, the engine
polls `socket` next to its other sockets and calls `service()`, which reads the replies,
keeps the connection and feeds the scheduler. Nothing here ever waits for the store.

Loads (the scheduler's admission parks a request in WAITING_FOR_KV, see scheduler.py):
  KVLookup(hashes after the local hit) -> hits? KVReserveLoad(the hit run) -> KVLoadReserved
  (and KVLoadReady after disk promotions) -> `scheduler.kv_ready(req, (first, slots, tiers))`
  -> the plan's kv_loads -> after that step's result: KVCompleteLoad(slots).
Stores: blocks newly registered in the GPU prefix cache (`scheduler.new_cached`) are
  store-pinned in the block manager (never evicted or reallocated) -> KVPrepareStore ->
  slots >= 0 go into the next plan's kv_stores (a transfer-only plan when nothing else
  runs), -1 are unpinned -> after that step's result: KVCompleteStore(slots, ok) and unpin.
  Order: a block's store is prepared before its pin is released, and completed only after
  the step that copied it has come back.

Failures: no reply within `reply_timeout_s` (a ping every `ping_s` keeps this honest while
idle), a KVError (e.g. a restarted store that never saw our hello), or a refused hello
makes the store "lost": logged once, tiers off (`scheduler.tiers_enabled`), requests in
WAITING_FOR_KV go back without a load (they recompute), reservations held by waiting
requests are dropped (the dead store's pins died with it), pending stores are unpinned.
A new session (new KVHello) is attempted every `retry_s` until the store answers.
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from shared.kvstore_client import KVStoreClient
from shared.protocol import (KVAck, KVCompleteLoad, KVCompleteStore, KVError, KVHello, KVInfo,
                             KVLoadReady, KVLoadReserved, KVLookup, KVLookupResult,
                             KVPrepareStore, KVReserveLoad, KVStats, KVStorePrepared, StepPlan)

log = logging.getLogger("kestrel.engine")


class KVTiers:
    """One engine's tier client.

    address: the kvstore's ZMQ address. model_identity: 32 bytes (the prefix cache root).
    block_bytes: bytes of one block as the workers lay it out in a slot. scheduler: the
    engine's Scheduler (its block manager is store-pinned). ctx: the engine's zmq context.
    Times in seconds.
    """

    def __init__(self, address: str, model_identity: bytes, block_bytes: int, scheduler,
                 ctx: zmq.Context, reply_timeout_s: float = 3.0, load_timeout_s: float = 15.0,
                 ping_s: float = 1.0, retry_s: float = 2.0):
        self.address, self.identity, self.block_bytes = address, model_identity, block_bytes
        self.sched, self.bm, self.ctx = scheduler, scheduler.bm, ctx
        self.reply_timeout_s, self.load_timeout_s = reply_timeout_s, load_timeout_s
        self.ping_s, self.retry_s = ping_s, retry_s
        self.client: KVStoreClient | None = None
        self.info: KVInfo | None = None
        self.connected = False
        self.hello_sent_at = 0.0
        self.ever_connected = False
        self.lost_logged = False
        self.pending: dict[int, tuple] = {}        # req_id -> (kind, sent time, payload...)
        self.ready_stores: list[tuple[int, int]] = []   # (block, slot) for the next plan
        self.last_ping = 0.0
        self.counters = {"kv_tier_lookups": 0, "kv_tier_loads": 0, "kv_tier_load_blocks": 0,
                         "kv_tier_store_blocks": 0, "kv_tier_store_failures": 0,
                         "kv_tier_disconnects": 0, "kv_tier_connects": 0}
        self._new_client()

    # ------------------------------------------------------------ connection
    @property
    def socket(self) -> zmq.Socket | None:
        """The socket to poll for replies (changes on reconnect)."""
        return self.client.socket if self.client is not None else None

    def _new_client(self) -> None:
        if self.client is not None:
            self.client.close(bye=False)
        self.client = KVStoreClient(self.address, "engine", self.identity, self.block_bytes,
                                    ctx=self.ctx)
        c = self.client
        c.socket.send(c.enc.encode(KVHello(c.client_id, c.session, os.getpid(), self.identity,
                                           self.block_bytes)))
        self.hello_sent_at = time.monotonic()

    def _lost(self, why: str) -> None:
        """Carry on without tiers (module doc) and start a new session."""
        if self.connected or not self.lost_logged:
            log.warning("kvstore lost (%s): carrying on without KV tiers until it is back", why)
            self.lost_logged = True
        if self.connected:
            self.counters["kv_tier_disconnects"] += 1
        self.connected = False
        self.sched.tiers_enabled = False
        for entry in self.pending.values():
            if entry[0] in ("lookup", "reserve"):
                self.sched.kv_ready(entry[2], None)
            elif entry[0] == "prepare":
                for blk, _ in entry[2]:
                    self.bm.unpin_store(blk)
        self.pending.clear()
        self.sched.kv_waiting_all_back()
        for blk, _ in self.ready_stores:
            self.bm.unpin_store(blk)
        self.ready_stores.clear()
        for req in self.sched.waiting:
            req.kv_load = None  # its slots were pinned by the lost session
        self.sched.kv_lookups.clear()
        self.sched.released_slots.clear()
        self.sched.new_cached.clear()
        self.info = None
        self._new_client()

    def _on_info(self, msg: KVInfo) -> None:
        if not msg.ok:
            if not self.lost_logged:
                log.error("kvstore refused the engine: %s; running without KV tiers", msg.error)
                self.lost_logged = True
            return
        self.info, self.connected, self.lost_logged = msg, True, False
        self.sched.tiers_enabled = True
        self.counters["kv_tier_connects"] += 1
        self.last_ping = time.monotonic()
        log.info("kvstore connected (pid %d, pool %s, %d slots, disk tier %s)", msg.store_pid,
                 msg.pool_name, msg.n_slots, "on" if msg.disk_tier else "off")

    # ------------------------------------------------------------ the loop's entry points
    def service(self) -> None:
        """Read replies, check timeouts, ping, reconnect, and send what the scheduler asks
        (lookups, released reservations, stores). Never blocks."""
        now = time.monotonic()
        try:
            replies = self.client.poll_replies()
        except zmq.ZMQError as e:
            self._lost(f"socket error {e}")
            return
        for msg in replies:
            self._on_reply(msg)
        now = time.monotonic()
        if not self.connected:
            if now - self.hello_sent_at > self.retry_s:
                self._new_client()
            self._drain_without_store()
            return
        for entry in self.pending.values():
            limit = self.load_timeout_s if entry[0] == "reserve" else self.reply_timeout_s
            if now - entry[1] > limit:
                self._lost(f"no reply to {entry[0]} in {limit:.0f} s")
                return
        if now - self.last_ping > self.ping_s:
            self.last_ping = now
            self._submit(("ping",), KVStats)
        self.pump()

    def _drain_without_store(self) -> None:
        for req, _ in self.sched.kv_lookups:
            self.sched.kv_ready(req, None)
        self.sched.kv_lookups.clear()
        self.sched.released_slots.clear()
        self.sched.new_cached.clear()

    def pump(self) -> None:
        """Send the scheduler's pending lookups, load releases and stores."""
        if not self.connected:
            self._drain_without_store()
            return
        s = self.sched
        for req, first in s.kv_lookups:
            max_blocks = (req.num_tokens - 1) // self.bm.block_size
            hashes = req.block_hashes[first:max_blocks]
            if not hashes or req.is_finished:
                s.kv_ready(req, None)
                continue
            self.counters["kv_tier_lookups"] += 1
            self._submit(("lookup", time.monotonic(), req, first, hashes), KVLookup, hashes=hashes)
        s.kv_lookups.clear()
        if s.released_slots:
            self._submit(("ack",), KVCompleteLoad, slots=s.released_slots)
            s.released_slots = []
        if s.new_cached:
            # a block renamed or freed since the step named it (e.g. reset_prefix_cache in
            # between) holds other bytes now, or none: it is not stored and never pinned
            # (a pin on a free block would let it be handed out twice)
            blocks = [(blk, h) for blk, h in s.new_cached if self.bm.block_hash[blk] == h]
            s.new_cached = []
            if not blocks:
                return
            for blk, _ in blocks:
                self.bm.pin_for_store(blk)
            self._submit(("prepare", time.monotonic(), blocks), KVPrepareStore,
                         hashes=[h for _, h in blocks])

    def _submit(self, entry: tuple, cls, **fields) -> None:
        if entry[0] in ("ping", "ack"):
            entry = (entry[0], time.monotonic())
        req_id = self.client.submit(cls, **fields)
        self.pending[req_id] = entry

    def has_stores(self) -> bool:
        """Whether stores wait for a plan (run a transfer-only step when idle)."""
        return bool(self.ready_stores)

    def attach_to_plan(self, plan: StepPlan) -> None:
        """Add the ready stores to `plan` and name the pool when it carries transfers."""
        if self.ready_stores:
            plan.kv_stores, self.ready_stores = self.ready_stores, []
        if (plan.kv_loads or plan.kv_stores) and self.info is not None:
            plan.kv_pool, plan.kv_pool_pid = self.info.pool_name, self.info.store_pid

    def after_step(self, plan: StepPlan, store_ok: bool) -> None:
        """The step of `plan` came back: complete its loads and stores, unpin its blocks.
        store_ok: the workers copied the stores (False: they are dropped)."""
        same = self.connected and self.info is not None and plan.kv_pool_pid == self.info.store_pid
        if plan.kv_loads and same:
            self._submit(("ack",), KVCompleteLoad, slots=[s for s, _ in plan.kv_loads])
        if plan.kv_stores:
            for blk, _ in plan.kv_stores:
                self.bm.unpin_store(blk)
            if same:
                self._submit(("ack",), KVCompleteStore, slots=[s for _, s in plan.kv_stores],
                             ok=store_ok)
            if store_ok:
                self.counters["kv_tier_store_blocks"] += len(plan.kv_stores)
            else:
                self.counters["kv_tier_store_failures"] += len(plan.kv_stores)

    # ------------------------------------------------------------ replies
    def _on_reply(self, msg) -> None:
        if isinstance(msg, KVInfo):
            if not self.connected:
                self._on_info(msg)
            return
        if isinstance(msg, KVError):
            if self.connected:
                self._lost(f"the store answered {msg.error!r}")
            return
        entry = self.pending.get(msg.req_id)
        if entry is None or not self.connected:
            return
        kind = entry[0]
        if isinstance(msg, KVLookupResult) and kind == "lookup":
            del self.pending[msg.req_id]
            _, _, req, first, hashes = entry
            n = len(msg.tiers)
            if n == 0 or req.is_finished:
                self.sched.kv_ready(req, None)
                return
            self._submit(("reserve", time.monotonic(), req, first, msg.tiers), KVReserveLoad,
                         hashes=hashes[:n])
        elif isinstance(msg, KVLoadReserved) and kind == "reserve":
            if msg.ready:
                del self.pending[msg.req_id]
                self._load_ready(entry, msg.slots)
            else:
                self.pending[msg.req_id] = entry + (msg.slots,)
        elif isinstance(msg, KVLoadReady) and kind == "reserve" and len(entry) == 6:
            del self.pending[msg.req_id]
            self._load_ready(entry, entry[5][:msg.num_ok])
        elif isinstance(msg, KVStorePrepared) and kind == "prepare":
            del self.pending[msg.req_id]
            for (blk, _), slot in zip(entry[2], msg.slots):
                if slot >= 0:
                    self.ready_stores.append((blk, slot))
                else:
                    self.bm.unpin_store(blk)
        elif isinstance(msg, KVAck):
            self.pending.pop(msg.req_id, None)

    def _load_ready(self, entry: tuple, slots: list[int]) -> None:
        _, _, req, first, tiers = entry[:5]
        if not slots:
            self.sched.kv_ready(req, None)
            return
        self.counters["kv_tier_loads"] += 1
        self.counters["kv_tier_load_blocks"] += len(slots)
        self.sched.kv_ready(req, (first, list(slots), list(tiers[:len(slots)])))

    # ------------------------------------------------------------ stats, exit
    def stats(self) -> dict:
        """Counters for the engine's `stats` (hits in tokens per tier, store progress)."""
        hits = self.sched.tier_hit_tokens
        return {"kv_tier_connected": self.connected, "kv_tier_hits_cpu": hits.get("cpu", 0),
                "kv_tier_hits_disk": hits.get("disk", 0),
                # blocks whose store is prepared, waiting for a plan, or being copied
                "kv_tier_pending_stores": len(self.bm.store_pins),
                "kv_tier_waiting_requests": len(self.sched.waiting_for_kv), **self.counters}

    def close(self) -> None:
        """End the session (KVBye releases the store-side pins), close the socket."""
        if self.client is not None:
            self.client.close(bye=self.connected)
            self.client = None
