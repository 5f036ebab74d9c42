"""The CPU tier: one shared-memory pool of KV block slots (DESIGN §4 "Tiers").

One segment, ``/dev/shm/kestrel-<instance>-kvpool``, mode 0600, created by the kvstore
process. Workers map it (`KVPool.attach`) and copy KV blocks in and out by slot index; the
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

Slot i (0 <= i < n_slots) occupies bytes [4096 + i * slot_stride, 4096 + i * slot_stride +
slot_bytes). The bytes of a block are opaque to the store: the worker defines their order
(for tensor parallelism, rank r owns [r * slot_bytes / tp, (r + 1) * slot_bytes / tp)).

The segment is sized with ftruncate, so tmpfs pages are only committed when touched; the
kvstore checks at startup that /dev/shm and host memory can hold the whole pool.
Exit paths: the creator unlinks the segment in close(), atexit, and on SIGTERM (the server's
handler calls close()). A stale pool (creator dead) is replaced at creation and removed by
`kestrel shm clean`.
"""

from __future__ import annotations

import atexit
import mmap
import os
import struct
import time

from shared.shm_layout import PREAMBLE, _pack_text, _pidns, owner_alive, shm_path

MAGIC = b"KSTRPOOL"
VERSION = 1
HEADER_SIZE = 4096
KIND = b"kvpool"
POOL = struct.Struct("<IIQQQQ32s")    # at offset 72: n_slots, state, slot_bytes, stride, used, free, id
POOL_OFF = 72
OFF_USED = 96
STATE_OPEN, STATE_CLOSED = 1, 2
SLOT_ALIGN = 64
_U64 = struct.Struct("<Q")


def pool_name(instance_id: str) -> str:
    """The /dev/shm name of an instance's pool: ``kestrel-<instance>-kvpool``."""
    return f"kestrel-{instance_id}-kvpool"


def slot_stride(slot_bytes: int) -> int:
    """Bytes between consecutive slots: slot_bytes rounded up to 64."""
    return (slot_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def slots_for(pool_bytes: int, slot_bytes: int) -> int:
    """How many slots of `slot_bytes` fit in `pool_bytes` bytes of slots (header excluded)."""
    return pool_bytes // slot_stride(slot_bytes)


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


def _create(path: str, size: int) -> int:
    """O_EXCL-create `path` (0600); replace it only if it is a pool whose creator is dead.

    Raises FileExistsError when a live (or foreign) segment holds the name.
    """
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        try:
            h = read_pool_header(path)
        except (ValueError, FileNotFoundError):
            raise FileExistsError(f"{path} exists and is not a stale kvpool") from None
        if owner_alive(h["writer_pid"], h["writer_pidns"], h["created"]) is not False:
            raise FileExistsError(f"{path} exists and its kvstore (pid {h['writer_pid']}) "
                                  "may be alive") from None
        os.unlink(path)
        fd = os.open(path, flags, 0o600)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


class KVPool:
    """A mapped pool segment: the kvstore creates it (`create`), workers `attach` to it.

    Attributes: name, path, n_slots, slot_bytes, stride (bytes), mm (the mmap).
    `slot(i)` is a writable memoryview of slot i's slot_bytes bytes.
    """

    def __init__(self, path: str, fd: int, owner: bool):
        self.path, self.name, self._owner, self._closed = path, os.path.basename(path), owner, False
        self._pid = os.getpid()
        try:
            size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._view = memoryview(self.mm)
        n, _, sbytes, stride, _, _, ident = POOL.unpack_from(self.mm, POOL_OFF)
        self.n_slots, self.slot_bytes, self.stride, self.model_identity = n, sbytes, stride, ident
        if owner:
            atexit.register(self.close)

    @classmethod
    def create(cls, instance_id: str, n_slots: int, slot_bytes: int,
               model_identity: bytes) -> "KVPool":
        """Create and map the pool of an instance. Raises FileExistsError if a live pool of
        that name exists, ValueError for a bad shape, OSError if /dev/shm refuses."""
        if n_slots < 1 or slot_bytes < 1 or len(model_identity) != 32:
            raise ValueError(f"bad kvpool: {n_slots} slots of {slot_bytes} bytes")
        path = shm_path(pool_name(instance_id))
        stride = slot_stride(slot_bytes)
        inst = _pack_text(instance_id, 32, "instance id")
        fd = _create(path, HEADER_SIZE + n_slots * stride)
        # The header is written through a temporary map before KVPool reads it back.
        with mmap.mmap(fd, HEADER_SIZE) as mm:
            PREAMBLE.pack_into(mm, 0, MAGIC, VERSION, HEADER_SIZE, os.getpid(), _pidns(),
                               time.time(), KIND, inst)
            POOL.pack_into(mm, POOL_OFF, n_slots, STATE_OPEN, slot_bytes, stride, 0, n_slots,
                           model_identity)
        return cls(path, fd, owner=True)

    @classmethod
    def attach(cls, name: str) -> "KVPool":
        """Map an existing pool (a worker). Raises FileNotFoundError / ValueError."""
        path = shm_path(name)
        read_pool_header(path)
        return cls(path, os.open(path, os.O_RDWR), owner=False)

    def offset(self, i: int) -> int:
        """Byte offset of slot i in the segment: 4096 + i * stride. Raises IndexError."""
        if not 0 <= i < self.n_slots:
            raise IndexError(f"slot {i} outside 0..{self.n_slots - 1}")
        return HEADER_SIZE + i * self.stride

    def slot(self, i: int) -> memoryview:
        """Writable view of slot i (slot_bytes bytes)."""
        off = self.offset(i)
        return self._view[off:off + self.slot_bytes]

    def set_counters(self, used: int) -> None:
        """Publish slots used / free in the header (for `kestrel shm ls`)."""
        _U64.pack_into(self.mm, OFF_USED, used)
        _U64.pack_into(self.mm, OFF_USED + 8, self.n_slots - used)

    def close(self) -> None:
        """Unmap; the creating process (not a fork of it) also unlinks. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owner and os.getpid() == self._pid:
            try:
                struct.pack_into("<I", self.mm, POOL_OFF + 4, STATE_CLOSED)
            except (ValueError, TypeError):
                pass
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self._view.release()
        try:
            self.mm.close()
        except BufferError:   # a caller still holds a slot view; the map goes with the process
            pass
