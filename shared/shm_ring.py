"""Shared-memory ring: one writer broadcasts messages to N readers (docs/ARCHITECTURE.md §3).

The engine writes each step plan once; every worker reads every message, in order, once.
One segment, ``/dev/shm/kestrel-<instance>-<ring>``, created by the writer with mode 0600.
All integers are little-endian; strings are UTF-8, NUL-padded. Sizes are in bytes.

Common preamble (every Kestrel segment whose magic starts with b"KSTR"; 72 bytes)::

    off  size  field
      0     8  magic            b"KSTRRING" for a ring
      8     4  u32 version      layout version (1)
     12     4  u32 header_size  offset of chunk 0 (640)
     16     4  u32 writer_pid   pid of the creator, as seen in its pid namespace
     20     4  u32 writer_pidns inode of the creator's /proc/self/ns/pid (0: unknown)
     24     8  f64 created      time.time() when the segment was created (seconds)
     32     8  kind             b"ring"
     40    32  instance_id

Ring header (continues the preamble)::

     72     4  u32 n_chunks
     76     4  u32 chunk_size   payload capacity of one chunk
     80     4  u32 chunk_stride bytes from one chunk to the next (64-aligned)
     84     4  u32 n_readers    1..16
     88     8  u64 write_seq    sequence number of the last message written (0: none yet)
     96    16  last_msg_type    type tag of the last message written, e.g. "step"
    112     4  u32 writer_state 1 open, 2 closed by the writer
    116    12  reserved
    128   512  16 reader slots of 32 bytes, slot i at 128 + 32*i:
                 +0 u64 read_seq   last sequence number this reader took (0: none)
                 +8 f64 last_seen  time.time() of its last read or idle wake-up (seconds)
                +16 u32 pid        pid of the reader that attached last (0: never)
                +20 12  reserved

Chunk k starts at header_size + k * chunk_stride; message seq (from 1) lives in chunk
(seq - 1) % n_chunks::

      0     4  u32 flags        bit 0 written, bit 1 overflow (payload is on the side channel)
      4     4  reserved
      8     8  u64 seq
     16     8  u64 length       payload length (for overflow: length of the side-channel payload)
     24    16  read flags       one byte per reader slot, 1 once that reader took this seq
     40    24  reserved
     64     -  payload          chunk_size bytes

Ordering: the writer stores flags=0, payload, length, read flags=0, seq, then flags=written;
a reader loads seq, then flags, then the payload, and sets its read flag last. This relies on
the total store order of x86-64; weakly ordered CPUs (aarch64) would need fences.

Sockets, in ``runtime_dir``: ``<name>-notify.sock`` (writer PUB -> reader SUB: one frame, the
seq, after every write and on close) and ``<name>-side.sock`` (writer ROUTER <- reader DEALER:
request [seq u64], reply [seq u64, status u8 (1 found), payload]) for payloads larger than a
chunk. The writer keeps an overflow payload until its chunk is reused. A wake-up can be lost
only while a reader's SUB connection forms; readers re-check every 0.1 s (0.01 s during the
first 0.5 s after attaching), so a loss costs latency, never a message.

Exit paths: the creator unlinks the segment and sockets in close(), the context manager,
atexit, and on SIGTERM (see close_all_writers). Readers never unlink.
"""

from __future__ import annotations

import atexit
import mmap
import os
import signal
import struct
import threading
import time

import zmq

from shared.shm_layout import (CHUNK, CHUNK_HDR, HEADER_SIZE, MAGIC, MAX_READERS, OFF_LAST_TYPE,
                               OFF_READ_FLAGS, OFF_STATE, OFF_WRITE_SEQ, OVERFLOW, PREAMBLE, RING,
                               SLOT, SLOTS_OFF, STATE_CLOSED, STATE_OPEN, VERSION, WRITTEN, _U32,
                               _U64, _pack_text, _pidns, owner_alive, read_header, shm_path)
from shared.runtime_dir import private_dir
from shared.zmq_utils import restrict_ipc_file

_IDLE_SLICE_S = 0.1     # a blocked reader re-checks the chunk and the writer this often
_WARMUP_S, _WARMUP_SLICE_S = 0.5, 0.01  # shorter slices while the SUB connection forms (a
                                        # wake-up sent before it is up is lost)
_SPIN_CHECKS = 200      # chunk checks before a reader blocks (tens of microseconds)


class RingClosed(EOFError):
    """The writer closed the ring or died, and no message is left for this reader."""


def _ipc(runtime_dir: str, name: str, what: str) -> str:
    path = os.path.join(runtime_dir, f"{name}-{what}.sock")
    if len(path.encode()) > 100:
        raise ValueError(f"ipc socket path too long for AF_UNIX ({len(path)} > 100): {path}")
    return path


# ---- exit paths of the creator -------------------------------------------------------------
_live_writers: set["ShmRingWriter"] = set()
_hooks_installed = False


def close_all_writers() -> None:
    """Close (and unlink) every ring this process created and has not closed yet.

    Registered with atexit. A process that sets its own SIGTERM handler calls this from it;
    otherwise the first writer installs a SIGTERM handler (only when the handler is SIG_DFL,
    from the main thread) that calls this and then dies of SIGTERM as before.
    """
    for w in list(_live_writers):
        try:
            w.close()
        except Exception:  # best effort on the way out; the supervisor sweeps what is left
            pass


def _on_sigterm(signum, frame) -> None:
    close_all_writers()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(close_all_writers)
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _create_segment(path: str, size: int) -> int:
    """O_EXCL-create `path`; replace it only if it is a ring whose creator is dead."""
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        try:
            h = read_header(path)
        except (ValueError, FileNotFoundError):
            raise FileExistsError(f"{path} exists and is not a stale ring") from None
        if owner_alive(h.writer_pid, h.writer_pidns, h.created) is not False:
            raise FileExistsError(f"{path} exists and its writer (pid {h.writer_pid}) may be alive") from None
        os.unlink(path)
        fd = os.open(path, flags, 0o600)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


class ShmRingWriter:
    """The single writer of a ring. Creates the segment and the sockets; see module docstring.

    n_readers: 1..16 reader slots, every one of which must read every message.
    n_chunks, chunk_size: ring capacity in messages and bytes per message; larger payloads go
    over the side channel. runtime_dir: folder for the ipc sockets (`shared.runtime_dir.private_dir`:
    created 0700, or checked to be private; UnsafeFolderError otherwise).
    Raises FileExistsError if a live ring of that name exists, ValueError on bad arguments.
    The segment is unlinked by close(), the context manager, atexit, and SIGTERM (see
    close_all_writers); a forked child never unlinks its parent's ring.
    """

    def __init__(self, name: str, n_readers: int, n_chunks: int, chunk_size: int,
                 runtime_dir: str, instance_id: str):
        if not 1 <= n_readers <= MAX_READERS or n_chunks < 1 or chunk_size < 1 or "/" in name:
            raise ValueError(f"bad ring {name!r}: readers {n_readers} (1..{MAX_READERS}), "
                             f"chunks {n_chunks}, chunk_size {chunk_size}")
        self.name, self.n_readers, self.n_chunks, self.chunk_size = name, n_readers, n_chunks, chunk_size
        self.path = shm_path(name)
        self.stride = (CHUNK_HDR + chunk_size + 63) // 64 * 64
        inst = _pack_text(instance_id, 32, "instance id")
        private_dir(runtime_dir)
        self._ipc = [_ipc(runtime_dir, name, "notify"), _ipc(runtime_dir, name, "side")]
        self._pid, self._seq, self._closed = os.getpid(), 0, False
        self._overflow: dict[int, tuple[int, bytes]] = {}   # chunk index -> (seq, payload)
        self._all_read = b"\x01" * n_readers
        self._fd = _create_segment(self.path, HEADER_SIZE + n_chunks * self.stride)
        self._ctx: zmq.Context | None = None
        try:
            self._mm = mmap.mmap(self._fd, HEADER_SIZE + n_chunks * self.stride)
            PREAMBLE.pack_into(self._mm, 0, MAGIC, VERSION, HEADER_SIZE, self._pid, _pidns(),
                               time.time(), b"ring", inst)
            RING.pack_into(self._mm, 72, n_chunks, chunk_size, self.stride, n_readers, 0, b"", STATE_OPEN)
            self._ctx = ctx = zmq.Context()
            self._pub = ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind("ipc://" + self._ipc[0])
            restrict_ipc_file("ipc://" + self._ipc[0])  # mode 0600 (the folder is 0700)
            side = ctx.socket(zmq.ROUTER)
            side.setsockopt(zmq.LINGER, 0)
            side.bind("ipc://" + self._ipc[1])
            restrict_ipc_file("ipc://" + self._ipc[1])
            self._stop = ctx.socket(zmq.PAIR)
            self._stop.bind(f"inproc://stop-{id(self)}")
            self._thread = threading.Thread(target=self._serve_side, args=(ctx, side),
                                            name=f"ring-side-{name}", daemon=True)
            self._thread.start()
        except BaseException:
            self._teardown()
            raise
        _live_writers.add(self)
        _install_hooks()

    def __enter__(self) -> "ShmRingWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def write(self, payload: bytes, msg_type: str = "", timeout: float | None = 10.0) -> int:
        """Publish `payload` (bytes) to every reader; returns its sequence number (1, 2, ...).

        msg_type: a tag of at most 16 UTF-8 bytes shown by `kestrel shm inspect`.
        Waits (sleep-polling, backoff up to 5 ms) while the next chunk is unread by some
        reader; raises TimeoutError after `timeout` seconds (None: forever), ValueError if
        the ring is closed or msg_type is too long.
        """
        if self._closed:
            raise ValueError(f"ring {self.name} is closed")
        mtype = _pack_text(msg_type, 16, "message type")
        seq = self._seq + 1
        idx = (seq - 1) % self.n_chunks
        off = HEADER_SIZE + idx * self.stride
        self._wait_free(off, idx, timeout)
        mm, n = self._mm, len(payload)
        _U32.pack_into(mm, off, 0)
        if n > self.chunk_size:
            self._overflow[idx] = (seq, bytes(payload))
            flags = WRITTEN | OVERFLOW
        else:
            self._overflow.pop(idx, None)
            mm[off + CHUNK_HDR:off + CHUNK_HDR + n] = payload
            flags = WRITTEN
        _U64.pack_into(mm, off + 16, n)
        mm[off + OFF_READ_FLAGS:off + OFF_READ_FLAGS + MAX_READERS] = bytes(MAX_READERS)
        _U64.pack_into(mm, off + 8, seq)
        _U32.pack_into(mm, off, flags)
        _U64.pack_into(mm, OFF_WRITE_SEQ, seq)
        mm[OFF_LAST_TYPE:OFF_LAST_TYPE + 16] = mtype.ljust(16, b"\0")
        self._seq = seq
        self._notify(seq)
        return seq

    def _wait_free(self, off: int, idx: int, timeout: float | None) -> None:
        mm, rf = self._mm, off + OFF_READ_FLAGS
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 50e-6
        while _U32.unpack_from(mm, off)[0] & WRITTEN and mm[rf:rf + self.n_readers] != self._all_read:
            if deadline is not None and time.monotonic() >= deadline:
                behind = [i for i in range(self.n_readers) if mm[rf + i] != 1]
                raise TimeoutError(f"ring {self.name}: chunk {idx} (seq {self._seq + 1 - self.n_chunks})"
                                   f" still unread by readers {behind} after {timeout} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def _notify(self, seq: int) -> None:
        try:
            self._pub.send(_U64.pack(seq), zmq.NOBLOCK)
        except zmq.Again:   # a full pipe means that reader has wake-ups queued already
            pass

    def _serve_side(self, ctx: zmq.Context, side: zmq.Socket) -> None:
        stop = ctx.socket(zmq.PAIR)
        stop.connect(f"inproc://stop-{id(self)}")
        poller = zmq.Poller()
        poller.register(side, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if stop in ready:
                    return
                frames = side.recv_multipart()
                if len(frames) != 2 or len(frames[1]) != 8:
                    continue   # malformed request: drop it
                seq = _U64.unpack(frames[1])[0]
                entry = self._overflow.get((seq - 1) % self.n_chunks)
                if entry is not None and entry[0] == seq:
                    side.send_multipart([frames[0], frames[1], b"\x01", entry[1]], copy=False)
                else:
                    side.send_multipart([frames[0], frames[1], b"\x00", b""])
        finally:
            side.close(0)
            stop.close(0)

    def close(self) -> None:
        """Mark the ring closed, wake the readers, unlink the segment and the socket files.

        Idempotent. In a forked child of the creator it only forgets the ring.
        """
        if self._closed:
            return
        self._closed = True
        _live_writers.discard(self)
        if os.getpid() != self._pid:
            return
        try:
            _U32.pack_into(self._mm, OFF_STATE, STATE_CLOSED)
            self._notify(self._seq)
        except (ValueError, zmq.ZMQError):
            pass
        self._teardown()

    def _teardown(self) -> None:
        if self._ctx is not None:
            if getattr(self, "_thread", None) is not None:
                self._stop.send(b"")
                self._thread.join(2.0)
            self._ctx.destroy(linger=0)
            self._ctx = None
        for p in [self.path] + self._ipc:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        mm = getattr(self, "_mm", None)   # absent when __init__ failed before mapping
        if mm is not None and not mm.closed:
            mm.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ShmRingReader:
    """Reader slot `reader_index` of an existing ring; takes every message once, in order.

    Attaches by mapping the segment read-write (it writes only its own slot and read flags)
    and subscribing to the writer's notifications. It resumes after the slot's read_seq, so
    messages written before it attached wait in the ring. Never unlinks anything.
    Raises FileNotFoundError if the segment is missing, ValueError if it is not a ring of
    this version or reader_index is out of range.
    """

    def __init__(self, name: str, reader_index: int, runtime_dir: str):
        self.name, self.index = name, reader_index
        self._fd = os.open(shm_path(name), os.O_RDWR)
        self._ctx: zmq.Context | None = None
        self._side: zmq.Socket | None = None
        try:
            h = read_header(f"/proc/self/fd/{self._fd}")   # the very file we opened
            if not 0 <= reader_index < h.n_readers:
                raise ValueError(f"ring {name}: reader index {reader_index} not in 0..{h.n_readers - 1}")
            self._h = h
            self._mm = mmap.mmap(self._fd, h.segment_bytes)
            self._slot = SLOTS_OFF + reader_index * SLOT.size
            self._next = h.readers[reader_index].read_seq + 1
            self._side_addr = "ipc://" + _ipc(runtime_dir, name, "side")
            self._pending = 0
            self._warm_until = time.monotonic() + _WARMUP_S
            self._ctx = zmq.Context()
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
            self._sub.connect("ipc://" + _ipc(runtime_dir, name, "notify"))
            SLOT.pack_into(self._mm, self._slot, self._next - 1, time.time(), os.getpid())
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "ShmRingReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _offset(self) -> int:
        return self._h.header_size + ((self._next - 1) % self._h.n_chunks) * self._h.chunk_stride

    def _ready(self, off: int) -> bool:
        # seq before flags: see the ordering note in the module docstring
        return _U64.unpack_from(self._mm, off + 8)[0] == self._next and \
            _U32.unpack_from(self._mm, off)[0] & WRITTEN != 0

    def read(self, timeout: float | None = None) -> bytes | None:
        """The next message's payload (bytes), or None after `timeout` seconds (None: no limit).

        Spins briefly, then blocks on the notification socket (re-checking every 0.1 s, when it
        also refreshes its last-seen time), so an idle reader uses ~0 CPU.
        Raises RingClosed when the writer has closed the ring or died and nothing is left.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        off = self._offset()
        for _ in range(_SPIN_CHECKS):
            if self._ready(off):
                return self._take(off, deadline)
        while True:
            if self._ready(off):
                return self._take(off, deadline)
            if self._writer_gone(check_pid=False):
                raise RingClosed(f"ring {self.name} closed by its writer")
            now = time.monotonic()
            wait = _IDLE_SLICE_S if now > self._warm_until else _WARMUP_SLICE_S
            if deadline is not None:
                wait = min(wait, deadline - now)
                if wait <= 0:
                    self._touch()
                    return None
            if self._sub.poll(int(wait * 1000)):   # what pyzmq does with a float
                self._drain()
            else:
                self._touch()
                if self._writer_gone(check_pid=True) and not self._ready(off):
                    raise RingClosed(f"ring {self.name}: writer pid {self._h.writer_pid} is gone")

    def _drain(self) -> None:
        while int(self._sub.get(zmq.EVENTS)) & zmq.POLLIN:   # an int for EVENTS
            self._sub.recv(zmq.NOBLOCK)

    def _touch(self) -> None:
        struct.pack_into("<d", self._mm, self._slot + 8, time.time())

    def _writer_gone(self, check_pid: bool) -> bool:
        """Closed by the writer; with check_pid, also when the writer process is dead."""
        if _U32.unpack_from(self._mm, OFF_STATE)[0] == STATE_CLOSED:
            return True
        h = self._h
        return check_pid and owner_alive(h.writer_pid, h.writer_pidns, h.created) is False

    def _take(self, off: int, deadline: float | None) -> bytes | None:
        flags, seq, length = CHUNK.unpack_from(self._mm, off)
        if flags & OVERFLOW:
            payload = self._fetch(seq, length, deadline)
            if payload is None:
                return None
        else:
            payload = self._mm[off + CHUNK_HDR:off + CHUNK_HDR + length]
        self._mm[off + OFF_READ_FLAGS + self.index] = 1
        self._drain()   # keep the wake-up queue short, or a full one could drop the next wake-up
        SLOT.pack_into(self._mm, self._slot, seq, time.time(), os.getpid())
        self._next += 1
        return payload

    def _fetch(self, seq: int, length: int, deadline: float | None) -> bytes | None:
        """Ask the writer's side channel for overflow message `seq`; None on timeout."""
        side = self._side
        if side is None:
            assert self._ctx is not None, "an open reader has its context"
            side = self._side = self._ctx.socket(zmq.DEALER)
            side.setsockopt(zmq.LINGER, 0)
            side.connect(self._side_addr)
        if self._pending != seq:
            side.send(_U64.pack(seq))
            self._pending = seq
        while True:
            wait = _IDLE_SLICE_S
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    return None
            if not side.poll(int(wait * 1000)):
                if self._writer_gone(check_pid=True):
                    raise RingClosed(f"ring {self.name}: writer gone before message {seq} was fetched")
                continue
            frames = side.recv_multipart()
            if len(frames) != 3 or frames[0] != _U64.pack(seq):
                continue   # a late reply to an earlier request
            self._pending = 0
            if frames[1] != b"\x01" or len(frames[2]) != length:
                raise RuntimeError(f"ring {self.name}: side channel has no payload of {length} "
                                   f"bytes for seq {seq}")
            return frames[2]

    def close(self) -> None:
        """Detach: close the sockets and the mapping. Never unlinks. Idempotent."""
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        mm = getattr(self, "_mm", None)   # absent when __init__ failed before mapping
        if mm is not None and not mm.closed:
            mm.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
