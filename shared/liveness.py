"""Per-process progress beacons and stack-dump hooks, read by the supervisor's watchdog.

Every Kestrel child process (engine, worker, frontend) creates one `Beacon` at startup.
It makes two files in `<runtime_dir>/watchdog/`:

- `<role>-<pid>.beat`: 16 bytes, little-endian: u64 progress counter, f64 time.time() of
  the last beat (seconds). The process's main loop calls `beat()` (a struct pack into a
  shared mapping: cheap enough for every loop iteration).
- `<role>-<pid>.stacks`: a file opened once at startup and handed to
  `faulthandler.register(SIGUSR1, all_threads=True)`. On SIGUSR1 the interpreter appends the
  Python stacks of every thread to it, even when the main thread is stuck in C code or
  sleeping; the watchdog copies the new bytes into a timestamped dump file.

`role` uses only [a-z0-9-] (e.g. `engine`, `worker-0`, `frontend-1`), so the file names
parse back as `<role>-<pid>`.

Dumps on request (the engine, before it gives up on a stuck worker: dump, then kill):
- `<role>-<pid>.dump-request`: one line, the reason; written by `request_dump`.
- `<role>-<pid>.dump-done`: the path of the dump file; written (atomically) by the watchdog
  when the dump is on disk, read and removed by `take_dump_answer`.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import struct
import time

from shared.runtime_dir import open_private, private_dir

BEAT = struct.Struct("<Qd")
DUMP_SIGNAL = signal.SIGUSR1
DUMP_REQUEST = ".dump-request"
DUMP_DONE = ".dump-done"


def watchdog_dir(runtime_dir: str) -> str:
    """The folder of beacon and stack files of an instance."""
    return os.path.join(runtime_dir, "watchdog")


def read_beat(path: str) -> tuple[int, float] | None:
    """(counter, last beat time.time() seconds) of a `.beat` file; None if unreadable."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(BEAT.size)
    except OSError:
        return None
    return BEAT.unpack(raw) if len(raw) == BEAT.size else None


def request_dump(runtime_dir: str, role: str, pid: int, reason: str) -> None:
    """Ask the watchdog for the stacks of process `pid` (named `role`, e.g. "worker-0") now,
    whatever its progress counter says. `reason` (one line) heads the dump. The answer comes
    by `take_dump_answer`. Raises OSError if the request cannot be written."""
    path = os.path.join(watchdog_dir(runtime_dir), f"{role}-{pid}{DUMP_REQUEST}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(reason.replace("\n", " ") + "\n")


def take_dump_answer(runtime_dir: str, role: str, pid: int) -> str | None:
    """The dump file's path once the watchdog answered a `request_dump` of (`role`, `pid`)
    (the answer is removed), or None while it has not."""
    path = os.path.join(watchdog_dir(runtime_dir), f"{role}-{pid}{DUMP_DONE}")
    try:
        with open(path) as fh:
            out = fh.read().strip()
        os.unlink(path)
    except OSError:
        return None
    return out


class Beacon:
    """The progress counter and SIGUSR1 stack-dump hook of this process.

    runtime_dir: the instance's runtime folder; it and its `watchdog/` are made private
    (`shared.runtime_dir.private_dir`: created 0700, or checked). role: the process's name
    in dump file names. Both files are opened with O_NOFOLLOW, mode 0600.
    Raises UnsafeFolderError for a folder that is not private, OSError if the files cannot
    be created (ELOOP for a planted symlink).
    """

    def __init__(self, runtime_dir: str, role: str):
        folder = watchdog_dir(runtime_dir)
        private_dir(runtime_dir)
        private_dir(folder)
        base = os.path.join(folder, f"{role}-{os.getpid()}")
        self.path = base + ".beat"
        fd = open_private(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        try:
            os.ftruncate(fd, BEAT.size)
            self._mm = mmap.mmap(fd, BEAT.size)
        finally:
            os.close(fd)
        self.count = 0
        # Kept open for the life of the process: faulthandler writes to its fd from a
        # signal handler, where nothing can be opened.
        self._stacks = os.fdopen(open_private(base + ".stacks",
                                              os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w")
        faulthandler.register(DUMP_SIGNAL, file=self._stacks, all_threads=True, chain=False)
        self.beat()

    def beat(self) -> None:
        """Record one unit of progress (the counter goes up, the time is now)."""
        self.count += 1
        BEAT.pack_into(self._mm, 0, self.count, time.time())
