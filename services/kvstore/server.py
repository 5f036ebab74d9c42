"""The kvstore service: a ZMQ ROUTER at `kvstore_address` over the index, the pool and the
disk tier (`kestrel kvstore`; docs/ARCHITECTURE.md §2, §4).

One main thread owns the index (`store.BlockStore`) and the socket; disk reads and writes
run on a small thread pool and report back through a queue plus a wake-up pipe that the
main loop polls next to the socket. Messages are `shared.protocol`'s "engine <-> kvstore"
section; an undecodable message is logged and dropped, a valid one from a peer without a
hello gets a KVError. Clients may come and go: the contents stay, and a client's pins are
released when it says KVBye or comes back with a new session.

Exit paths: SIGTERM / SIGINT stop the loop; `close()` then waits for queued disk writes,
unlinks the pool segment and closes the socket (also on an error, and at exit).
"""

from __future__ import annotations

import logging
import os
import queue
import time
import threading
from concurrent.futures import ThreadPoolExecutor

import zmq

from services.kvstore.cpu_tier import OwnedPool
from services.kvstore.disk_tier import CorruptBlock, DiskTier
from services.kvstore.settings import ConfigError, StoreSetup, resolve_setup
from services.kvstore.store import Actions, BlockStore
from shared.config import KestrelConfig
from shared.kv_pool import HEADER_SIZE
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
PENDING_WRITE_BYTES = 1 << 30  # RAM for slot copies waiting to be written to the disk tier


class KVStoreServer:
    """The service. cfg: the config (instance_id, kvstore_address); setup: from
    `settings.resolve_setup(cfg)`. Creates the pool, rebuilds the disk index and binds.
    Raises FileExistsError (a live pool of this instance exists), zmq.ZMQError (address in
    use), OSError (disk folder unreadable)."""

    def __init__(self, cfg: KestrelConfig, setup: StoreSetup):
        self.cfg, self.setup = cfg, setup
        self.stopping = False
        self._closed = False
        self.pool = OwnedPool.create(cfg.instance_id, setup.n_slots, setup.block_bytes,
                                     setup.model_identity)
        self.ctx = zmq.Context()
        # promotions never queue behind demotion writes: a hit being served waits on reads
        self._reads = ThreadPoolExecutor(DISK_THREADS, thread_name_prefix="kvstore-read")
        self._writes = ThreadPoolExecutor(max(1, DISK_THREADS // 4), thread_name_prefix="kvstore-write")
        try:
            # demotions queued at once: copies of their slots wait in RAM for the disk
            self.store = BlockStore(setup.n_slots, setup.disk_capacity,
                                    max(64, PENDING_WRITE_BYTES // max(setup.block_bytes, 1)))
            self.disk: DiskTier | None = None
            if setup.disk_dir:
                self.disk = DiskTier(setup.disk_dir, setup.model_identity, setup.block_bytes)
                found = self.disk.scan()
                self._unlink(self.store.add_disk_blocks([h for h, _ in found]))
                log.info("disk tier %s: %d block files indexed (capacity %d)", self.disk.folder,
                         len(self.store.disk), setup.disk_capacity)
            self._done: queue.SimpleQueue = queue.SimpleQueue()
            self._promo_started: dict[tuple[str, int], float] = {}  # reservation -> start
            self._staging: queue.SimpleQueue = queue.SimpleQueue()  # copy-out buffers
            for _ in range(STAGING_KEEP if setup.disk_dir else 0):
                self._staging.put(bytearray(setup.block_bytes))  # zero-filled: faulted now
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
        self.pool.set_counters(0)
        log.info("kvstore ready at %s: pool %s, %d slots of %d bytes", cfg.kvstore_address,
                 self.pool.name, setup.n_slots, setup.block_bytes)

    # ------------------------------------------------------------ main loop
    def serve_forever(self) -> None:
        """Serve until `stopping` is set (signal handler or another thread)."""
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        used = -1
        while not self.stopping:
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
            if self.store.slots_used != used:
                used = self.store.slots_used
                self.pool.set_counters(used)

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
        st = self.store
        if isinstance(msg, KVLookup):
            self._send(rid, KVLookupResult(msg.req_id, st.lookup(_hashes(msg.hashes))))
        elif isinstance(msg, KVReserveLoad):
            slots, resv, acts = st.reserve_load(session, msg.req_id, _hashes(msg.hashes))
            if resv is not None:
                self._promo_started[(session, msg.req_id)] = time.monotonic()
            self._run(acts)
            self._send(rid, KVLoadReserved(msg.req_id, slots, resv is None))
        elif isinstance(msg, KVCompleteLoad):
            self._send(rid, KVAck(msg.req_id, st.complete_load(session, msg.slots)))
        elif isinstance(msg, KVPrepareStore):
            slots, evicted, acts = st.prepare_store(session, _hashes(msg.hashes))
            self._run(acts)
            self._send(rid, KVStorePrepared(msg.req_id, slots, evicted))
        elif isinstance(msg, KVCompleteStore):
            self._send(rid, KVAck(msg.req_id, st.complete_store(session, msg.slots, msg.ok)))
        elif isinstance(msg, KVStats):
            self._send(rid, KVAck(msg.req_id, 0, st.stats()))
        elif isinstance(msg, KVBye):
            n = st.drop_session(session)
            self.peer_session.pop(rid, None)
            self.session_peer.pop(session, None)
            self._send(rid, KVAck(msg.req_id, n))

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
        if err:
            log.warning("refused client %s (pid %d): %s", msg.client_id, msg.pid, err)
            self._send(rid, KVInfo(False, err))
            return
        old = self.client_session.get(msg.client_id)
        if old is not None and old != msg.session:
            n = self.store.drop_session(old)
            log.info("client %s restarted: released %d slots of its old session", msg.client_id, n)
            self.peer_session.pop(self.session_peer.pop(old, b""), None)
        self.client_session[msg.client_id] = msg.session
        self.peer_session[rid] = msg.session
        self.session_peer[msg.session] = rid
        log.info("client %s (pid %d) connected", msg.client_id, msg.pid)
        self._send(rid, KVInfo(True, "", os.getpid(), self.pool.name, s.n_slots, s.block_bytes,
                               self.pool.stride, HEADER_SIZE, self.disk is not None))

    # ------------------------------------------------------------ disk I/O
    def _run(self, acts: Actions) -> None:
        """Carry out a store call's I/O: copy demoted slots, delete evicted files, then queue
        the writes and reads. A demoted slot that a promotion reads into is copied by that
        read's job (on the reader threads, before its read); the others are copied now,
        before the reply lets a client write into them."""
        reading = {slot for _, slot in acts.read}
        copy_first = {slot: h for h, slot in acts.demote if slot in reading}
        demoted = [(h, self._copy_out(slot, self._free_staging())) for h, slot in acts.demote
                   if slot not in reading]
        self._unlink(acts)
        for h, data in demoted:
            self._writes.submit(self._write_job, h, data)
        for h, slot in acts.read:
            self._reads.submit(self._read_job, h, slot, copy_first.get(slot))

    def _unlink(self, acts: Actions) -> None:
        if not acts.unlink:
            return
        assert self.disk is not None, "only the disk tier has files to unlink"
        for h in acts.unlink:
            self.disk.remove(h)

    def _post(self, item) -> None:
        self._done.put(item)
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def _free_staging(self) -> bytearray | None:
        """A reused staging buffer of block_bytes (see STAGING_KEEP), or None when none is free."""
        try:
            buf: bytearray = self._staging.get_nowait()
            return buf
        except queue.Empty:
            return None

    def _copy_out(self, slot: int, buf: bytearray | None) -> bytearray:
        """A copy of a slot's bytes for its demotion write, in `buf` (from `_free_staging`),
        or in a new buffer when that is None."""
        if buf is None:
            buf = bytearray(len(self.pool.slot(slot)))
        buf[:] = self.pool.slot(slot)
        return buf

    def _write_job(self, h: bytes, data: bytearray) -> None:
        try:
            assert self.disk is not None, "demotions are written only with a disk tier"
            self.disk.write(h, data)
            ok = True
        except Exception as e:
            log.warning("demotion of %s failed: %s", h.hex()[:16], e)
            ok = False
        if self._staging.qsize() < STAGING_KEEP:
            self._staging.put(data)
        self._post(("w", h, ok, 0.0))

    def _read_job(self, h: bytes, slot: int, demote: bytes | None = None) -> None:
        """Promote block h into slot; first, when `demote` names the block the slot held,
        copy it out and queue its disk write."""
        ok, t0 = False, time.perf_counter()
        try:
            if demote is not None:  # the block the slot held: written out, or dropped
                buf = self._free_staging()
                if buf is None:
                    self._post(("s", demote, False, 0.0))
                else:
                    self._writes.submit(self._write_job, demote, self._copy_out(slot, buf))
            t0 = time.perf_counter()
            assert self.disk is not None, "promotions read only from a disk tier"
            self.disk.read_into(h, self.pool.slot(slot))
            ok = True
        except CorruptBlock as e:
            log.warning("disk block is corrupt, removed (a miss): %s", e)
        except Exception as e:
            log.warning("promotion of %s failed: %s", h.hex()[:16], e)
        self._post(("r", h, ok, time.perf_counter() - t0))

    def _drain_done(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                kind, h, ok, secs = self._done.get_nowait()
            except queue.Empty:
                return
            if kind in ("w", "s"):  # s: a demotion skipped for want of a staging buffer
                self.store.write_done(h, ok, skipped=kind == "s")
                continue
            self.store.counters["disk_read_us"] += round(1e6 * secs)  # summed over threads
            for r in self.store.read_done(h, ok):
                t0 = self._promo_started.pop((r.session, r.req_id), None)
                if t0 is not None:  # wall time of the reservation's promotions, seconds
                    self.store.counters["promotion_wait_ms"] += round(1e3 * (time.monotonic() - t0))
                rid = self.session_peer.get(r.session)
                if rid is not None:
                    self._send(rid, KVLoadReady(r.req_id, r.num_ok))

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
            self.pool.close()
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
        server = KVStoreServer(cfg, setup)
    except (FileExistsError, zmq.ZMQError, OSError, ValueError) as e:
        log.error("cannot start the kvstore: %s", e)
        return 1

    def on_term(signum, frame):
        server.stopping = True

    on_stop_signals(on_term)  # SIGTERM; SIGINT too unless supervised
    code = 0
    try:
        server.serve_forever()
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
