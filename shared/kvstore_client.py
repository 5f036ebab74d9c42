"""The client of the kvstore service, for the engine (and tests, benchmarks).

It lives in shared/ because it is the kvstore's API as other processes see it: the
messages (`shared.protocol`, "engine <-> kvstore") and the pool mapping (`shared.kv_pool`);
the engine never imports the kvstore's package (docs/ARCHITECTURE.md §2, §4).

Two ways to use it:
- synchronous calls (`lookup`, `reserve_load`, `complete_load`, `prepare_store`,
  `complete_store`, `stats`), each waiting at most `timeout_s` seconds for its reply;
- asynchronous: `submit(msg_class, **fields)` returns a req_id at once, `socket` can sit in
  the caller's zmq.Poller, and `poll_replies()` returns the replies that have arrived (an
  event loop such as the engine's step loop never blocks on the store).

Replies that arrive while a synchronous call waits for another req_id are kept and returned
by `poll_replies()` (or by the synchronous call that wants them). Errors: `KVStoreRefused`
(the hello was refused or a request answered with KVError), TimeoutError (no reply in time:
the store may be down; the caller decides whether to carry on without tiers).
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import Sequence

import zmq

from shared.kv_pool import KVPool
from shared.protocol import (KVAck, KVBye, KVCompleteLoad, KVCompleteStore, KVError, KVHello,
                             KVInfo, KVLoadReady, KVLoadReserved, KVLookup, KVLookupResult,
                             KVPrepareStore,
                             KVReserveLoad, KVStats, KVStorePrepared, KVStoreToEngine,
                             decoder, encoder)
from shared.zmq_utils import make_socket, safe_decode


class KVStoreRefused(RuntimeError):
    """The store refused the hello (model identity or block size differ) or a request."""


class KVStoreClient:
    """One client session. address: the store's kvstore_address. client_id: a stable name
    (e.g. "engine"): a new session under the same name releases the old one's pins.
    model_identity: 32 bytes; block_bytes: bytes per block; state_identity, state_bytes: a
    hybrid model's state checkpoints (`shared.state_layout`; b"" and 0 for a dense model);
    all must match the store's. timeout_s: seconds a synchronous call waits. Call
    `connect()` first."""

    def __init__(self, address: str, client_id: str, model_identity: bytes, block_bytes: int,
                 timeout_s: float = 5.0, ctx: zmq.Context | None = None,
                 state_identity: bytes = b"", state_bytes: int = 0):
        self.address, self.client_id = address, client_id
        self.model_identity, self.block_bytes, self.timeout_s = model_identity, block_bytes, timeout_s
        self.state_identity, self.state_bytes = state_identity, state_bytes
        self.session = f"{client_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.socket = make_socket(self.ctx, zmq.DEALER, address, bind=False,
                                  identity=self.session.encode())
        self.enc, self.dec = encoder(), decoder(KVStoreToEngine)
        self._ids = itertools.count(1)
        self._stash: dict[int, list] = {}
        self.info: KVInfo | None = None
        self.pool: KVPool | None = None
        self.state_pool: KVPool | None = None

    # ------------------------------------------------------------ async interface
    def submit(self, cls, **fields) -> int:
        """Send one request (a shared.protocol KV* class; req_id is filled in). Returns req_id."""
        req_id = next(self._ids)
        self.socket.send(self.enc.encode(cls(req_id=req_id, **fields)))
        return req_id

    def poll_replies(self, timeout_s: float = 0.0) -> list:
        """Replies received so far (stashed first), waiting up to timeout_s for the first."""
        out = [m for lst in self._stash.values() for m in lst]
        self._stash.clear()
        if not out and timeout_s > 0 and not self.socket.poll(int(timeout_s * 1000)):
            return out
        while True:
            try:
                data = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            msg = safe_decode(self.dec, data, "kvstore")
            if msg is not None:
                out.append(msg)

    def _wait(self, req_id: int, kinds: tuple, timeout_s: float | None = None):
        """The reply to req_id of one of `kinds`; stashes others. Raises TimeoutError,
        KVStoreRefused on KVError."""
        lst = self._stash.get(req_id, [])
        for m in lst:
            if isinstance(m, kinds + (KVError,)):
                lst.remove(m)
                return self._check(m)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.socket.poll(max(1, int(left * 1000))):
                raise TimeoutError(f"kvstore at {self.address}: no reply to request {req_id}")
            msg = safe_decode(self.dec, self.socket.recv(), "kvstore")
            if msg is None:
                continue
            rid = getattr(msg, "req_id", 0)
            if rid == req_id and isinstance(msg, kinds + (KVError,)):
                return self._check(msg)
            self._stash.setdefault(rid, []).append(msg)

    @staticmethod
    def _check(msg):
        if isinstance(msg, KVError):
            raise KVStoreRefused(msg.error)
        return msg

    # ------------------------------------------------------------ synchronous calls
    def hello(self) -> KVHello:
        """This session's KVHello (also what the engine's session sends)."""
        return KVHello(self.client_id, self.session, os.getpid(), self.model_identity,
                       self.block_bytes, state_identity=self.state_identity,
                       state_bytes=self.state_bytes)

    def connect(self) -> KVInfo:
        """Say hello; returns the store's KVInfo. Raises KVStoreRefused, TimeoutError."""
        self.socket.send(self.enc.encode(self.hello()))
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.socket.poll(max(1, int(left * 1000))):
                raise TimeoutError(f"kvstore at {self.address}: no answer to hello")
            msg = safe_decode(self.dec, self.socket.recv(), "kvstore")
            if isinstance(msg, KVInfo):
                break
        if not msg.ok:
            raise KVStoreRefused(msg.error)
        self.info = msg
        return msg

    def attach_pool(self) -> KVPool:
        """Map the store's pool (after connect). Raises RuntimeError before connect,
        FileNotFoundError / ValueError from `KVPool.attach`."""
        if self.info is None:
            raise RuntimeError("attach_pool() before connect()")
        if self.pool is None:
            self.pool = KVPool.attach(self.info.pool_name)
        return self.pool

    def attach_state_pool(self) -> KVPool:
        """Map the store's state checkpoints' pool (after connect). Raises RuntimeError before
        connect or for a store without one, FileNotFoundError / ValueError from `KVPool.attach`."""
        if self.info is None or not self.info.state_pool_name:
            raise RuntimeError("no state pool: attach_state_pool() before connect(), or a dense model's store")
        if self.state_pool is None:
            self.state_pool = KVPool.attach(self.info.state_pool_name)
        return self.state_pool

    def lookup(self, hashes: list[bytes]) -> list[str]:
        """Tiers of the longest run of hits from hashes[0] (see KVLookupResult)."""
        return self._wait(self.submit(KVLookup, hashes=hashes), (KVLookupResult,)).tiers

    def lookup_states(self, state_hashes: list[bytes]) -> list[str]:
        """The tier of each checkpoint named in state_hashes ("" for a miss)."""
        return self._wait(self.submit(KVLookup, hashes=[], state_hashes=state_hashes),
                          (KVLookupResult,)).state_tiers

    def reserve(self, hashes: list[bytes], state_hashes: Sequence[bytes] = (),
                timeout_s: float | None = None) -> tuple[list[int], list[int]]:
        """(pinned slots holding hashes[:len], pinned state slots holding
        state_hashes[:len]), waiting for disk promotions. Slots the store released (a
        corrupt file) are not returned and need no complete_load."""
        req = self.submit(KVReserveLoad, hashes=hashes, state_hashes=list(state_hashes))
        r = self._wait(req, (KVLoadReserved,), timeout_s)
        if r.ready:
            return r.slots, r.state_slots
        ready = self._wait(req, (KVLoadReady,), timeout_s)
        return r.slots[:ready.num_ok], r.state_slots[:ready.state_ok]

    def reserve_load(self, hashes: list[bytes], timeout_s: float | None = None) -> list[int]:
        """Pinned slots holding hashes[:len(result)] (`reserve` without checkpoints)."""
        return self.reserve(hashes, timeout_s=timeout_s)[0]

    def complete_load(self, slots: list[int], state_slots: Sequence[int] = ()) -> int:
        """Unpin slots (and state slots) returned by reserve. Returns how many the store unpinned."""
        return self._wait(self.submit(KVCompleteLoad, slots=slots, state_slots=list(state_slots)),
                          (KVAck,)).count

    def prepare_store(self, hashes: list[bytes], state_hashes: Sequence[bytes] = ()) -> KVStorePrepared:
        """Slots (and state slots) to write (-1: skip). Complete every slot >= 0 with
        complete_store."""
        return self._wait(self.submit(KVPrepareStore, hashes=hashes, state_hashes=list(state_hashes)),
                          (KVStorePrepared,))

    def complete_store(self, slots: list[int], ok: bool = True,
                       state_slots: Sequence[int] = ()) -> int:
        """Publish (ok) or drop written slots and state slots. Returns how many the store accepted."""
        return self._wait(self.submit(KVCompleteStore, slots=slots, ok=ok, state_slots=list(state_slots)),
                          (KVAck,)).count

    def stats(self) -> dict:
        return self._wait(self.submit(KVStats), (KVAck,)).stats

    def close(self, bye: bool = True) -> None:
        """End the session (KVBye releases its pins unless bye is False), unmap, close."""
        if bye and self.info is not None:
            try:
                self._wait(self.submit(KVBye), (KVAck,), timeout_s=1.0)
            except (TimeoutError, KVStoreRefused):
                pass
        for pool in (self.pool, self.state_pool):
            if pool is not None:
                pool.close()
        self.socket.close(linger=0)
        if self._own_ctx:
            self.ctx.term()

