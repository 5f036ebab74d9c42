"""The CPU tier's segment as its creator holds it: the kvstore creates, fills in the
counters of and unlinks the pool (docs/ARCHITECTURE.md §4 "Tiers").

The byte layout, and the mapping that workers and the engine's client use, are in
`shared.kv_pool`; `OwnedPool` is that mapping plus what only the creating process does.
Exit paths: the creator unlinks the segment in close(), atexit, and on SIGTERM (the server's
handler calls close()). A stale pool (creator dead) is replaced at creation.
"""

from __future__ import annotations

import atexit
import mmap
import os
import struct
import time

from shared.kv_pool import (HEADER_SIZE, KIND, MAGIC, OFF_USED, POOL, POOL_OFF, STATE_CLOSED,
                            STATE_OPEN, VERSION, KVPool, pool_name, read_pool_header, slot_stride)
from shared.shm_layout import PREAMBLE, _pack_text, _pidns, owner_alive, shm_path

_U64 = struct.Struct("<Q")


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


class OwnedPool(KVPool):
    """The pool as the kvstore holds it: `create` makes the segment; `close` marks it closed
    and unlinks it (only in the creating process, not in a fork of it)."""

    def __init__(self, path: str, fd: int):
        super().__init__(path, fd)
        self._pid = os.getpid()
        atexit.register(self.close)

    @classmethod
    def create(cls, instance_id: str, n_slots: int, slot_bytes: int,
               model_identity: bytes, name: str | None = None) -> OwnedPool:
        """Create and map the pool of an instance (name: its /dev/shm name, default
        `pool_name(instance_id)`; the state checkpoints' pool passes `state_pool_name`).
        Raises FileExistsError if a live pool of that name exists, ValueError for a bad
        shape, OSError if /dev/shm refuses."""
        if n_slots < 1 or slot_bytes < 1 or len(model_identity) != 32:
            raise ValueError(f"bad kvpool: {n_slots} slots of {slot_bytes} bytes")
        path = shm_path(name or pool_name(instance_id))
        stride = slot_stride(slot_bytes)
        inst = _pack_text(instance_id, 32, "instance id")
        fd = _create(path, HEADER_SIZE + n_slots * stride)
        # The header is written through a temporary map before KVPool reads it back.
        with mmap.mmap(fd, HEADER_SIZE) as mm:
            PREAMBLE.pack_into(mm, 0, MAGIC, VERSION, HEADER_SIZE, os.getpid(), _pidns(),
                               time.time(), KIND, inst)
            POOL.pack_into(mm, POOL_OFF, n_slots, STATE_OPEN, slot_bytes, stride, 0, n_slots,
                           model_identity)
        return cls(path, fd)

    def set_counters(self, used: int) -> None:
        """Publish slots used / free in the header (for `kestrel shm ls`)."""
        _U64.pack_into(self.mm, OFF_USED, used)
        _U64.pack_into(self.mm, OFF_USED + 8, self.n_slots - used)

    def close(self) -> None:
        """Mark the pool closed, unlink it (the creating process only) and unmap. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self._pid:
            try:
                struct.pack_into("<I", self.mm, POOL_OFF + 4, STATE_CLOSED)
            except (ValueError, TypeError):
                pass
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self._unmap()
