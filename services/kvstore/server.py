"""The kvstore service: a ZMQ ROUTER at `kvstore_address` over the index, the pool and the
disk tier (`kestrel kvstore`; docs/ARCHITECTURE.md §2, §4).

One main thread owns the index (`store.BlockStore`) and the socket; disk reads and writes
run on a small thread pool and report back through a queue plus a wake-up pipe that the
main loop polls next to the socket. Messages are `shared.protocol`'s "engine <-> kvstore"
section; an undecodable message is logged and dropped, a valid one from a peer without a
hello gets a KVError. Clients may come and go: the contents stay, and a client's pins are
released when it says KVBye or comes back with a new session.

A hybrid model's store keeps two namespaces, each a `Space` (an index, a pool, a disk
folder): the KV blocks, and the recurrent-state checkpoints (docs/ARCHITECTURE.md §4.7:
named by the block they follow, slots of one request's state, files under the state
identity's folder). One message may carry both parts (`state_*` fields); a reservation that
waits for promotions in both is ready (KVLoadReady) when both are.

Exit paths: SIGTERM / SIGINT stop the loop; `close()` then waits for queued disk writes,
unlinks the pool segments and closes the socket (also on an error, and at exit).
"""

from __future__ import annotations

import logging
import os
import queue
import time
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from services.kvstore.cpu_tier import OwnedPool
from services.kvstore.disk_tier import CorruptBlock, DiskTier
from services.kvstore.settings import ConfigError, StoreSetup, resolve_setup
from services.kvstore.store import Actions, BlockStore, Reservation
from shared.config import KestrelConfig
from shared.kv_pool import HEADER_SIZE, state_pool_name
from shared.liveness import Beacon
from shared.hashing import HASH_BYTES
from shared.procutil import die_with_parent, on_stop_signals, set_title, setup_logging
from shared.protocol import (PROTOCOL_VERSION, EngineToKVStore, KVAck, KVBye, KVCompleteLoad,
                             KVCompleteStore, KVError, KVHello, KVInfo, KVLoadReady,
                             KVLoadReserved, KVLookup, KVLookupResult, KVPrepareStore,
                             KVReserveLoad, KVStats, KVStorePrepared, decoder, encoder)
from shared.zmq_utils import make_socket, safe_decode

log = logging.getLogger("kestrel.kvstore")
# reader threads (file read + crc32 into the pool; the GIL is released for both): a 16-core
# H200 host read 1.8 MB block files at 12.5 GB/s with 8 threads and 16 GB/s with 16
DISK_THREADS = max(2, min(16, os.cpu_count() or 2))
# Demotion copies go through STAGING_KEEP reused buffers of block_bytes, made at startup. A
# new 1.8 MB buffer per block page-faults, and promotion threads that did so together read
# at 1.2 GB/s against 12 without (H200 host, 16 threads, a probe of this code path). A
# promotion that finds no free buffer drops the block it evicts instead of demoting it.
STAGING_KEEP = 64
STAGING_BYTES = 256 << 20  # at most this much in staging buffers per space (state slots are big)
PENDING_WRITE_BYTES = 1 << 30  # RAM for slot copies waiting to be written to the disk tier
KV, STATE = 0, 1  # the spaces: KV blocks, a hybrid model's state checkpoints


@dataclass
class Space:
    """One namespace of the store: its index, its pool, its disk folder (None: no disk tier),
    the bytes of one entry and its reused copy-out buffers (see STAGING_KEEP)."""

    name: str
    store: BlockStore
    pool: OwnedPool
    disk: DiskTier | None
    slot_bytes: int
    staging: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    staging_keep: int = 0


@dataclass
class LoadWait:
    """A reservation waiting for promotions in one or both spaces: the spaces still reading,
    and the entries of each that hold their block (the KVLoadReady to send)."""

    waiting: set[int]
    num_ok: int
    state_ok: int
    started: float


class KVStoreServer:
    """The service. cfg: the config (instance_id, kvstore_address); setup: from
    `settings.resolve_setup(cfg)`. Creates the pool, rebuilds the disk index and binds.
    Raises FileExistsError (a live pool of this instance exists), zmq.ZMQError (address in
    use), OSError (disk folder unreadable)."""

    def __init__(self, cfg: KestrelConfig, setup: StoreSetup):
        self.cfg, self.setup = cfg, setup
        self.stopping = False
        self._closed = False
        self.spaces: list[Space] = []
        self.pool = OwnedPool.create(cfg.instance_id, setup.n_slots, setup.block_bytes,
                                     setup.model_identity)
        self._pools = [self.pool]  # every segment made, closed (unlinked) by close()
        self.ctx = zmq.Context()
        # promotions never queue behind demotion writes: a hit being served waits on reads
        self._reads = ThreadPoolExecutor(DISK_THREADS, thread_name_prefix="kvstore-read")
        self._writes = ThreadPoolExecutor(max(1, DISK_THREADS // 4), thread_name_prefix="kvstore-write")
        try:
            self.spaces.append(self._space("KV block", self.pool, setup.model_identity, setup.block_bytes,
                                           setup.n_slots, setup.disk_capacity))
            if setup.state_bytes:  # a hybrid model's state checkpoints: a second pool
                spool = OwnedPool.create(cfg.instance_id, setup.state_n_slots, setup.state_bytes,
                                         setup.state_identity, name=state_pool_name(cfg.instance_id))
                self._pools.append(spool)
                self.spaces.append(self._space("state checkpoint", spool, setup.state_identity,
                                               setup.state_bytes, setup.state_n_slots,
                                               setup.state_disk_capacity))
            self.store = self.spaces[KV].store
            self.disk: DiskTier | None = self.spaces[KV].disk
            self._done: queue.SimpleQueue = queue.SimpleQueue()
            self._waits: dict[tuple[str, int], LoadWait] = {}  # reservations being promoted
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            self.router = make_socket(self.ctx, zmq.ROUTER, cfg.kvstore_address, bind=True)
            self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        except BaseException:
            self.close()
            raise
        self.enc, self.dec = encoder(), decoder(EngineToKVStore)
        self.peer_session: dict[bytes, str] = {}      # routing id -> session
        self.session_peer: dict[str, bytes] = {}      # session -> routing id (latest)
        self.client_session: dict[str, str] = {}      # client_id -> its current session
        for sp in self.spaces:
            sp.pool.set_counters(0)
            log.info("kvstore ready at %s: pool %s, %d %s slots of %d bytes", cfg.kvstore_address,
                     sp.pool.name, sp.pool.n_slots, sp.name, sp.slot_bytes)

    def _space(self, name: str, pool: OwnedPool, identity: bytes, slot_bytes: int, n_slots: int,
               disk_capacity: int) -> Space:
        """A namespace over `pool`, with its disk folder (<disk dir>/<identity hex>/) indexed
        when the disk tier is on."""
        # demotions queued at once: copies of their slots wait in RAM for the disk
        least = 64 if not self.spaces else 8  # a state checkpoint can be tens of MB
        store = BlockStore(n_slots, disk_capacity, max(least, PENDING_WRITE_BYTES // max(slot_bytes, 1)))
        sp = Space(name, store, pool, None, slot_bytes)
        if self.setup.disk_dir:
            sp.disk = DiskTier(self.setup.disk_dir, identity, slot_bytes)
            found = sp.disk.scan()
            self._unlink(sp, store.add_disk_blocks([h for h, _ in found]))
            log.info("disk tier %s: %d %s files indexed (capacity %d)", sp.disk.folder,
                     len(store.disk), name, disk_capacity)
            sp.staging_keep = max(2, min(STAGING_KEEP, STAGING_BYTES // max(slot_bytes, 1)))
            for _ in range(sp.staging_keep):
                sp.staging.put(bytearray(slot_bytes))  # zero-filled: faulted now
        return sp

    # ------------------------------------------------------------ main loop
    def serve_forever(self, beat: Callable[[], None] | None = None) -> None:
        """Serve until `stopping` is set (signal handler or another thread). beat: called at
        every turn of the loop (at least 5 times a second; the watchdog beacon's `beat`)."""
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        used = [-1] * len(self.spaces)
        while not self.stopping:
            if beat is not None:
                beat()
            events = dict(poller.poll(200))
            if self.router in events:
                for _ in range(256):
                    try:
                        frames = self.router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_frames(frames)
            if self._wake_r in events or not self._done.empty():
                self._drain_done()
            for i, sp in enumerate(self.spaces):
                if sp.store.slots_used != used[i]:
                    used[i] = sp.store.slots_used
                    sp.pool.set_counters(used[i])

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            log.warning("dropped a message of %d frames from %r", len(frames), frames[0])
            return
        rid, data = frames
        msg = safe_decode(self.dec, data, rid)
        if msg is None:
            return
        try:
            self._handle(rid, msg)
        except (ValueError, IndexError, TypeError) as e:   # bad arguments inside a valid message
            log.warning("refused %s from %r: %s", type(msg).__name__, rid, e)
            self._send(rid, KVError(getattr(msg, "req_id", 0), str(e)))

    def _send(self, rid: bytes, msg) -> None:
        try:
            self.router.send_multipart([rid, self.enc.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:   # peer gone or its queue full: it will ask again
            log.warning("could not answer %r: %s", rid, e)

    def _handle(self, rid: bytes, msg) -> None:
        if isinstance(msg, KVHello):
            self._hello(rid, msg)
            return
        session = self.peer_session.get(rid)
        if session is None:
            self._send(rid, KVError(msg.req_id, "send KVHello first"))
            return
        st, states = self.store, self._states()
        if isinstance(msg, KVLookup):
            state_tiers = ([states.tier(h) or "" for h in _hashes(msg.state_hashes)] if states is not None
                           else [""] * len(msg.state_hashes))  # a dense store holds none
            self._send(rid, KVLookupResult(msg.req_id, st.lookup(_hashes(msg.hashes)), state_tiers))
        elif isinstance(msg, KVReserveLoad):
            self._reserve(rid, session, msg)
        elif isinstance(msg, KVCompleteLoad):
            n = st.complete_load(session, msg.slots)
            if states is not None:
                n += states.complete_load(session, msg.state_slots)
            self._send(rid, KVAck(msg.req_id, n))
        elif isinstance(msg, KVPrepareStore):
            slots, evicted, acts = st.prepare_store(session, _hashes(msg.hashes))
            self._run(self.spaces[KV], acts)
            state_slots = [-1] * len(msg.state_hashes)
            if states is not None and msg.state_hashes:
                state_slots, _, sacts = states.prepare_store(session, _hashes(msg.state_hashes))
                self._run(self.spaces[STATE], sacts)
            self._send(rid, KVStorePrepared(msg.req_id, slots, evicted, state_slots))
        elif isinstance(msg, KVCompleteStore):
            n = st.complete_store(session, msg.slots, msg.ok)
            if states is not None:
                n += states.complete_store(session, msg.state_slots, msg.ok)
            self._send(rid, KVAck(msg.req_id, n))
        elif isinstance(msg, KVStats):
            stats = st.stats()
            if states is not None:
                stats.update({f"state_{k}": v for k, v in states.stats().items()})
            self._send(rid, KVAck(msg.req_id, 0, stats))
        elif isinstance(msg, KVBye):
            n = self._drop_session(session)
            self.peer_session.pop(rid, None)
            self.session_peer.pop(session, None)
            self._send(rid, KVAck(msg.req_id, n))

    def _states(self) -> BlockStore | None:
        """The state checkpoints' index (None: a dense model's store)."""
        return self.spaces[STATE].store if len(self.spaces) > STATE else None

    def _drop_session(self, session: str) -> int:
        """Release a session's pins and slots being written in every space."""
        for key in [k for k in self._waits if k[0] == session]:
            del self._waits[key]
        return sum(sp.store.drop_session(session) for sp in self.spaces)

    def _reserve(self, rid: bytes, session: str, msg: KVReserveLoad) -> None:
        """KVReserveLoad: pin the block run and the checkpoint run; when either waits for
        promotions, KVLoadReady follows once both are in their slots."""
        slots, resv, acts = self.store.reserve_load(session, msg.req_id, _hashes(msg.hashes))
        self._run(self.spaces[KV], acts)
        state_slots: list[int] = []
        sresv: Reservation | None = None
        states = self._states()
        if states is not None and msg.state_hashes:
            state_slots, sresv, sacts = states.reserve_load(session, msg.req_id, _hashes(msg.state_hashes))
            self._run(self.spaces[STATE], sacts)
        waiting = {i for i, r in ((KV, resv), (STATE, sresv)) if r is not None}
        if waiting:
            self._waits[(session, msg.req_id)] = LoadWait(waiting, len(slots), len(state_slots),
                                                          time.monotonic())
        self._send(rid, KVLoadReserved(msg.req_id, slots, not waiting, state_slots))

    def _hello(self, rid: bytes, msg: KVHello) -> None:
        s = self.setup
        err = ""
        if msg.protocol_version != PROTOCOL_VERSION:
            err = f"protocol version {msg.protocol_version}, the store speaks {PROTOCOL_VERSION}"
        elif msg.model_identity != s.model_identity:
            err = (f"model identity {msg.model_identity.hex()[:16]}.. differs from the store's "
                   f"{s.model_identity.hex()[:16]}.. (model, dtype, KV dtype, block size or "
                   "parallel layout differ)")
        elif msg.block_bytes != s.block_bytes:
            err = f"block_bytes {msg.block_bytes}, the store's blocks are {s.block_bytes} bytes"
        elif msg.state_bytes != s.state_bytes or msg.state_identity != s.state_identity:
            err = (f"state checkpoints of {msg.state_bytes} bytes (state identity "
                   f"{msg.state_identity.hex()[:16] or 'none'}), the store's are {s.state_bytes} bytes "
                   f"({s.state_identity.hex()[:16] or 'none'}): the recurrent-state layout differs")
        if err:
            log.warning("refused client %s (pid %d): %s", msg.client_id, msg.pid, err)
            self._send(rid, KVInfo(False, err))
            return
        old = self.client_session.get(msg.client_id)
        if old is not None and old != msg.session:
            n = self._drop_session(old)
            log.info("client %s restarted: released %d slots of its old session", msg.client_id, n)
            self.peer_session.pop(self.session_peer.pop(old, b""), None)
        self.client_session[msg.client_id] = msg.session
        self.peer_session[rid] = msg.session
        self.session_peer[msg.session] = rid
        log.info("client %s (pid %d) connected", msg.client_id, msg.pid)
        spool = self.spaces[STATE].pool if len(self.spaces) > STATE else None
        self._send(rid, KVInfo(True, "", os.getpid(), self.pool.name, s.n_slots, s.block_bytes,
                               self.pool.stride, HEADER_SIZE, self.disk is not None,
                               spool.name if spool else "", s.state_n_slots, s.state_bytes))

    # ------------------------------------------------------------ disk I/O
    def _run(self, sp: Space, acts: Actions) -> None:
        """Carry out a store call's I/O in space `sp`: copy demoted slots, delete evicted
        files, then queue the writes and reads. A demoted slot that a promotion reads into
        is copied by that read's job (on the reader threads, before its read); the others
        are copied now, before the reply lets a client write into them."""
        reading = {slot for _, slot in acts.read}
        copy_first = {slot: h for h, slot in acts.demote if slot in reading}
        demoted = [(h, self._copy_out(sp, slot, self._free_staging(sp))) for h, slot in acts.demote
                   if slot not in reading]
        self._unlink(sp, acts)
        for h, data in demoted:
            self._writes.submit(self._write_job, sp, h, data)
        for h, slot in acts.read:
            self._reads.submit(self._read_job, sp, h, slot, copy_first.get(slot))

    def _unlink(self, sp: Space, acts: Actions) -> None:
        if not acts.unlink:
            return
        assert sp.disk is not None, "only the disk tier has files to unlink"
        for h in acts.unlink:
            sp.disk.remove(h)

    def _post(self, item) -> None:
        self._done.put(item)
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    @staticmethod
    def _free_staging(sp: Space) -> bytearray | None:
        """A reused staging buffer of the space's slot bytes (see STAGING_KEEP), or None when
        none is free."""
        try:
            buf: bytearray = sp.staging.get_nowait()
            return buf
        except queue.Empty:
            return None

    @staticmethod
    def _copy_out(sp: Space, slot: int, buf: bytearray | None) -> bytearray:
        """A copy of a slot's bytes for its demotion write, in `buf` (from `_free_staging`),
        or in a new buffer when that is None."""
        if buf is None:
            buf = bytearray(len(sp.pool.slot(slot)))
        buf[:] = sp.pool.slot(slot)
        return buf

    def _write_job(self, sp: Space, h: bytes, data: bytearray) -> None:
        try:
            assert sp.disk is not None, "demotions are written only with a disk tier"
            sp.disk.write(h, data)
            ok = True
        except Exception as e:
            log.warning("demotion of %s %s failed: %s", sp.name, h.hex()[:16], e)
            ok = False
        if sp.staging.qsize() < sp.staging_keep:
            sp.staging.put(data)
        self._post(("w", sp, h, ok, 0.0))

    def _read_job(self, sp: Space, h: bytes, slot: int, demote: bytes | None = None) -> None:
        """Promote entry h into slot; first, when `demote` names the entry the slot held,
        copy it out and queue its disk write."""
        ok, t0 = False, time.perf_counter()
        try:
            if demote is not None:  # the entry the slot held: written out, or dropped
                buf = self._free_staging(sp)
                if buf is None:
                    self._post(("s", sp, demote, False, 0.0))
                else:
                    self._writes.submit(self._write_job, sp, demote, self._copy_out(sp, slot, buf))
            t0 = time.perf_counter()
            assert sp.disk is not None, "promotions read only from a disk tier"
            sp.disk.read_into(h, sp.pool.slot(slot))
            ok = True
        except CorruptBlock as e:
            log.warning("disk %s is corrupt, removed (a miss): %s", sp.name, e)
        except Exception as e:
            log.warning("promotion of %s %s failed: %s", sp.name, h.hex()[:16], e)
        self._post(("r", sp, h, ok, time.perf_counter() - t0))

    def _drain_done(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                kind, sp, h, ok, secs = self._done.get_nowait()
            except queue.Empty:
                return
            if kind in ("w", "s"):  # s: a demotion skipped for want of a staging buffer
                sp.store.write_done(h, ok, skipped=kind == "s")
                continue
            self.store.counters["disk_read_us"] += round(1e6 * secs)  # summed over threads
            space = self.spaces.index(sp)
            for r in sp.store.read_done(h, ok):
                self._promoted(space, r)

    def _promoted(self, space: int, r: Reservation) -> None:
        """A reservation's promotions in `space` are done: KVLoadReady once the other space
        is done too."""
        w = self._waits.get((r.session, r.req_id))
        if w is None or space not in w.waiting:
            return
        w.waiting.discard(space)
        if space == KV:
            w.num_ok = r.num_ok
        else:
            w.state_ok = r.num_ok
        if w.waiting:
            return
        del self._waits[(r.session, r.req_id)]
        # wall time of the reservation's promotions, milliseconds
        self.store.counters["promotion_wait_ms"] += round(1e3 * (time.monotonic() - w.started))
        rid = self.session_peer.get(r.session)
        if rid is not None:
            self._send(rid, KVLoadReady(r.req_id, w.num_ok, w.state_ok))

    # ------------------------------------------------------------ exit
    def close(self) -> None:
        """Wait for queued disk I/O, unlink the pool, close the socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._reads.shutdown(wait=True)  # first: a read job may queue a write
            self._writes.shutdown(wait=True)
        finally:
            for pool in self._pools:
                pool.close()
            router = getattr(self, "router", None)   # absent when __init__ failed before it
            if router is not None:
                router.close(linger=0)
            self.ctx.destroy(linger=0)


def _hashes(hashes: list[bytes]) -> list[bytes]:
    for h in hashes:
        if len(h) != HASH_BYTES:
            raise ValueError(f"a block hash has {len(h)} bytes, expected {HASH_BYTES}")
    return hashes


def run_kvstore(cfg: KestrelConfig) -> int:
    """Entry point of `kestrel kvstore`. Returns the exit code: 0 after SIGTERM / SIGINT,
    2 for a configuration that cannot work (message on stderr), 1 for any other failure."""
    set_title("kestrel:kvstore")
    die_with_parent()
    setup_logging("kvstore", cfg.log_level)
    try:
        setup = resolve_setup(cfg)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    try:
        beacon = Beacon(cfg.runtime_dir, "kvstore")  # watchdog progress + stack dumps
        server = KVStoreServer(cfg, setup)
    except (FileExistsError, zmq.ZMQError, OSError, ValueError) as e:
        log.error("cannot start the kvstore: %s", e)
        return 1

    def on_term(signum, frame):
        server.stopping = True

    on_stop_signals(on_term)  # SIGTERM; SIGINT too unless supervised
    code = 0
    try:
        server.serve_forever(beacon.beat)
    except Exception:
        log.exception("kvstore failed")
        code = 1
    finally:
        server.close()
    log.info("kvstore stopped (exit code %d)", code)
    return code


def serve_in_thread(cfg: KestrelConfig, setup: StoreSetup) -> tuple[KVStoreServer, threading.Thread]:
    """Start a server on a thread (tests, embedding). Stop with `server.stopping = True`,
    join the thread, then `server.close()`."""
    server = KVStoreServer(cfg, setup)
    t = threading.Thread(target=server.serve_forever, name="kvstore", daemon=True)
    t.start()
    return server, t
