"""Byte layout of a Kestrel shm ring segment, and reading it without attaching.

The layout itself (offsets, sizes, ordering rules) is documented in `shared.shm_ring`.
This module holds the constants, the header dataclasses, `read_header` (plain file reads,
never mapping or writing) and the owner-liveness check used by `kestrel shm`.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

import psutil

MAGIC = b"KSTRRING"
VERSION = 1
MAX_READERS = 16
SHM_DIR = "/dev/shm"
PREAMBLE = struct.Struct("<8sIIIId8s32s")      # 72 bytes at offset 0
RING = struct.Struct("<IIIIQ16sI12x")          # 56 bytes at offset 72
SLOT = struct.Struct("<QdI12x")                # 32 bytes per reader slot
CHUNK = struct.Struct("<I4xQQ")                # flags, seq, length
SLOTS_OFF = 128
HEADER_SIZE = SLOTS_OFF + MAX_READERS * SLOT.size   # 640
OFF_WRITE_SEQ, OFF_LAST_TYPE, OFF_STATE = 88, 96, 112
CHUNK_HDR, OFF_READ_FLAGS = 64, 24
WRITTEN, OVERFLOW = 1, 2
STATE_OPEN, STATE_CLOSED = 1, 2
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


def shm_path(path_or_name: str) -> str:
    """``/dev/shm/<name>`` for a bare segment name; a path containing '/' is returned as is."""
    return path_or_name if "/" in path_or_name else os.path.join(SHM_DIR, path_or_name)


def _pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino & 0xFFFFFFFF
    except OSError:
        return 0


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def _pack_text(s: str, size: int, what: str) -> bytes:
    b = s.encode("utf-8")
    if len(b) > size:
        raise ValueError(f"{what} {s!r} is longer than {size} bytes")
    return b


# A pid counts as reused when its process started this long after the segment was made. The
# two times come from different clocks: `created` is the writer's time.time(), a process's
# start is psutil's boot time (whole seconds, read once per process, moved by clock steps)
# plus its start ticks. With a 1 s margin a live engine was once judged dead on the 2-core CI
# VM (its worker exited "writer pid ... is gone" mid-request); a false "dead" fails requests,
# a false "alive" only leaves the supervisor's own liveness checks to act, so the margin is
# wide. A pid reused within it is caught by those checks.
REUSE_MARGIN_S = 30.0


def owner_alive(pid: int, pidns: int, created: float) -> bool | None:
    """Whether the segment's creator still runs: True, False (dead, zombie, or its pid reused
    by a process started more than REUSE_MARGIN_S after `created`), or None when it lives in
    another pid namespace (a container) and cannot be judged from here."""
    mine = _pidns()
    if pidns and mine and pidns != mine:
        return None
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE or p.create_time() > created + REUSE_MARGIN_S:
            return False
        return True
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


@dataclass
class ReaderState:
    """One reader slot: last seq taken, last-seen time (time.time() seconds, 0 never), pid."""
    index: int
    read_seq: int
    last_seen: float
    pid: int


@dataclass
class ChunkState:
    """One chunk's header: flags, the seq it holds, payload length (bytes), read flags."""
    index: int
    written: bool
    overflow: bool
    seq: int
    length: int
    read: tuple[bool, ...]


@dataclass
class RingHeader:
    """A snapshot of a ring's header and chunk headers (not atomic: a live ring moves on)."""
    path: str
    version: int
    header_size: int
    writer_pid: int
    writer_pidns: int
    created: float
    kind: str
    instance_id: str
    n_chunks: int
    chunk_size: int
    chunk_stride: int
    n_readers: int
    write_seq: int
    last_msg_type: str
    writer_state: str
    segment_bytes: int
    readers: list[ReaderState] = field(default_factory=list)
    chunks: list[ChunkState] = field(default_factory=list)

    @property
    def chunks_in_use(self) -> int:
        """Chunks written and not yet read by every reader."""
        return sum(1 for c in self.chunks if c.written and not all(c.read))

    def lag(self, reader: int) -> int:
        """Messages written that reader `reader` has not taken yet."""
        return self.write_seq - self.readers[reader].read_seq


def read_header(path_or_name: str) -> RingHeader:
    """Parse a ring's header and chunk headers with plain reads: never maps, attaches or writes.

    Raises FileNotFoundError if the segment is missing, ValueError if it is not a ring of this
    layout version (magic, version or size wrong).
    """
    path = shm_path(path_or_name)
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(HEADER_SIZE)
        if len(head) < HEADER_SIZE:
            raise ValueError(f"{path}: {len(head)} bytes, shorter than a ring header")
        magic, ver, hsize, pid, pidns, created, kind, inst = PREAMBLE.unpack_from(head, 0)
        if magic != MAGIC or ver != VERSION:
            raise ValueError(f"{path}: not a version-{VERSION} ring (magic {magic!r}, version {ver})")
        n_chunks, chunk_size, stride, n_readers, wseq, mtype, state = RING.unpack_from(head, 72)
        h = RingHeader(path, ver, hsize, pid, pidns, created, _text(kind), _text(inst), n_chunks,
                       chunk_size, stride, n_readers, wseq, _text(mtype),
                       "closed" if state == STATE_CLOSED else "open", size)
        for i in range(n_readers):
            rseq, seen, rpid = SLOT.unpack_from(head, SLOTS_OFF + i * SLOT.size)
            h.readers.append(ReaderState(i, rseq, seen, rpid))
        for k in range(n_chunks):
            raw = os.pread(fh.fileno(), CHUNK_HDR, hsize + k * stride)
            if len(raw) < CHUNK_HDR:
                raise ValueError(f"{path}: truncated at chunk {k}")
            flags, seq, length = CHUNK.unpack_from(raw, 0)
            reads = tuple(b == 1 for b in raw[OFF_READ_FLAGS:OFF_READ_FLAGS + n_readers])
            h.chunks.append(ChunkState(k, bool(flags & WRITTEN), bool(flags & OVERFLOW), seq, length, reads))
    return h
