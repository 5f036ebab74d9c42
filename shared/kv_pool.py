"""The kvstore's CPU tier segment: one shared-memory pool of KV block slots, as every process
maps it (docs/ARCHITECTURE.md §4 "Tiers").

One segment, ``/dev/shm/kestrel-<instance>-kvpool``, mode 0600, created by the kvstore
process (`services.kvstore.cpu_tier.OwnedPool`). Workers and the engine's client map it
(`KVPool.attach`) and copy KV blocks in and out by slot index; the
kvstore's control messages (shared.protocol, "engine <-> kvstore") say which slot to use and
when it is safe. All integers are little-endian; strings are UTF-8, NUL-padded; sizes are
in bytes.

Layout::

    off   size  field
      0      8  magic             b"KSTRPOOL" (the common Kestrel preamble, see shared.shm_ring)
      8      4  u32 version       pool layout version (1)
     12      4  u32 header_size   offset of slot 0 (4096: slot 0 is page aligned)
     16      4  u32 writer_pid    pid of the kvstore that created the segment
     20      4  u32 writer_pidns  inode of its /proc/self/ns/pid (0: unknown)
     24      8  f64 created       time.time() at creation (seconds)
     32      8  kind              b"kvpool"
     40     32  instance_id
     72      4  u32 n_slots
     76      4  u32 state         1 open, 2 closed by the kvstore
     80      8  u64 slot_bytes    bytes of one KV block (all layers, K and V, every TP rank)
     88      8  u64 slot_stride   bytes from one slot to the next: slot_bytes rounded up to 64
     96      8  u64 slots_used    slots holding or reserved for a block (kept current)
    104      8  u64 slots_free    n_slots - slots_used (kept current)
    112     32  model identity    shared.hashing.model_identity_hash of the blocks held
    144   3952  reserved (zero)

A hybrid model's store has a second segment of the same layout,
``/dev/shm/kestrel-<instance>-statepool``: its slots hold recurrent-state checkpoints
(`shared.state_layout`, docs/ARCHITECTURE.md §4.7) and its identity field the state identity.

Slot i (0 <= i < n_slots) occupies bytes [4096 + i * slot_stride, 4096 + i * slot_stride +
slot_bytes). The bytes of a block are opaque to the store: the workers define their order
(`shared.kv_layout.KVLayout`: rank r of tp owns [r * slot_bytes / tp, (r + 1) * slot_bytes / tp)).

The segment is sized with ftruncate, so tmpfs pages are only committed when touched; the
kvstore checks at startup that /dev/shm and host memory can hold the whole pool.
Exit paths: the creator unlinks the segment (services/kvstore/cpu_tier.py); a mapping here
only unmaps. A stale pool (creator dead) is replaced at creation and removed by
`kestrel shm clean`.
"""

from __future__ import annotations

import mmap
import os
import struct

from shared.shm_layout import PREAMBLE, shm_path

MAGIC = b"KSTRPOOL"
VERSION = 1
HEADER_SIZE = 4096
KIND = b"kvpool"
POOL = struct.Struct("<IIQQQQ32s")    # at offset 72: n_slots, state, slot_bytes, stride, used, free, id
POOL_OFF = 72
OFF_USED = 96
STATE_OPEN, STATE_CLOSED = 1, 2
SLOT_ALIGN = 64


def pool_name(instance_id: str) -> str:
    """The /dev/shm name of an instance's pool: ``kestrel-<instance>-kvpool``."""
    return f"kestrel-{instance_id}-kvpool"


def state_pool_name(instance_id: str) -> str:
    """The /dev/shm name of an instance's second pool, a hybrid model's state checkpoints
    (same layout, slots of one request's recurrent state, `shared.state_layout`; its model
    identity field holds the state identity): ``kestrel-<instance>-statepool``."""
    return f"kestrel-{instance_id}-statepool"


def slot_stride(slot_bytes: int) -> int:
    """Bytes between consecutive slots: slot_bytes rounded up to 64."""
    return (slot_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def read_pool_header(path_or_name: str) -> dict:
    """The pool header as a dict (plain read, never maps). Raises FileNotFoundError if the
    segment is missing, ValueError if it is not a version-1 pool."""
    path = shm_path(path_or_name)
    with open(path, "rb") as fh:
        raw = fh.read(POOL_OFF + POOL.size)
    if len(raw) < POOL_OFF + POOL.size:
        raise ValueError(f"{path}: too short for a kvpool header")
    magic, ver, hsize, pid, pidns, created, kind, inst = PREAMBLE.unpack_from(raw, 0)
    if magic != MAGIC or ver != VERSION:
        raise ValueError(f"{path}: not a version-{VERSION} kvpool (magic {magic!r}, version {ver})")
    n, state, sbytes, stride, used, free, ident = POOL.unpack_from(raw, POOL_OFF)
    return {"path": path, "version": ver, "header_size": hsize, "writer_pid": pid,
            "writer_pidns": pidns, "created": created, "instance_id": inst.rstrip(b"\0").decode(),
            "n_slots": n, "state": "closed" if state == STATE_CLOSED else "open",
            "slot_bytes": sbytes, "slot_stride": stride, "slots_used": used, "slots_free": free,
            "model_identity": ident}


class KVPool:
    """A mapped pool segment. `attach` maps an existing one (a worker, the engine's client);
    the kvstore creates and owns it (services.kvstore.cpu_tier.OwnedPool, a subclass).

    Attributes: name, path, n_slots, slot_bytes, stride (bytes), model_identity (32 bytes),
    mm (the mmap). `slot(i)` is a writable memoryview of slot i's slot_bytes bytes.
    """

    def __init__(self, path: str, fd: int):
        """Map the segment open at `fd` (closed here) and read its shape from the header."""
        self.path, self.name, self._closed = path, os.path.basename(path), False
        try:
            size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._view = memoryview(self.mm)
        n, _, sbytes, stride, _, _, ident = POOL.unpack_from(self.mm, POOL_OFF)
        self.n_slots, self.slot_bytes, self.stride, self.model_identity = n, sbytes, stride, ident

    @classmethod
    def attach(cls, name: str) -> KVPool:
        """Map an existing pool by its /dev/shm name or path. Raises FileNotFoundError,
        ValueError (not a version-1 pool)."""
        path = shm_path(name)
        read_pool_header(path)
        return cls(path, os.open(path, os.O_RDWR))

    def offset(self, i: int) -> int:
        """Byte offset of slot i in the segment: 4096 + i * stride. Raises IndexError."""
        if not 0 <= i < self.n_slots:
            raise IndexError(f"slot {i} outside 0..{self.n_slots - 1}")
        return HEADER_SIZE + i * self.stride

    def slot(self, i: int) -> memoryview:
        """Writable view of slot i (slot_bytes bytes). Raises IndexError."""
        off = self.offset(i)
        return self._view[off:off + self.slot_bytes]

    def close(self) -> None:
        """Unmap. Idempotent; a view still held keeps the map until the process ends."""
        if self._closed:
            return
        self._closed = True
        self._unmap()

    def _unmap(self) -> None:
        self._view.release()
        try:
            self.mm.close()
        except BufferError:   # a caller still holds a slot view; the map goes with the process
            pass
