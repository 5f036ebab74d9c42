"""The supervisor's watchdog: explains hangs with stack dumps. It never kills.

Each child beats a progress counter (`shared.liveness.Beacon`). A thread of the supervisor
reads every `<runtime_dir>/watchdog/<role>-<pid>.beat` twice a second. When a counter has
not moved for `timeout_s`, it sends SIGUSR1 to that pid (faulthandler writes the Python
stacks of all threads to the process's pre-opened `.stacks` file) and copies the new bytes
into `<dump_dir>/<role>-<pid>-<UTC time>.txt` (e.g. `engine-4242-20250101T120000Z.txt`).
If `py-spy` is on PATH, its `dump` output is appended too. One dump per stall: a new one
only after the counter moves again.

Config (`--watchdog-config FILE`, JSON, every key optional):
  {"timeout_s": 30, "dump_dir": "/var/tmp/kestrel-dumps", "processes": ["engine", "worker"]}
`processes` are role prefixes (`worker` matches `worker-0`); default: every process. Missing
keys come from the settings watchdog_timeout_s and watchdog_dump_dir (default dump folder:
`kestrel-<instance>-dumps` beside the runtime folder, which is removed at exit). The dump
folder is private (`shared.runtime_dir.private_dir`: `kestrel serve` makes or checks it at
startup, and again before each dump); dump files are written with `write_private_file`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field

from shared.config import KestrelConfig
from shared.liveness import DUMP_SIGNAL, read_beat, watchdog_dir
from shared.procutil import pid_alive
from shared.runtime_dir import private_dir, write_private_file

log = logging.getLogger("kestrel.supervisor.watchdog")

POLL_S = 0.5
DUMP_WAIT_S = 1.0  # how long to wait for faulthandler's output after the signal


@dataclass
class WatchdogConfig:
    """timeout_s: seconds without progress before a dump. dump_dir: output folder.
    processes: role prefixes to watch (empty: all)."""

    timeout_s: float
    dump_dir: str
    processes: list[str] = field(default_factory=list)

    def watches(self, role: str) -> bool:
        """Whether the process `role` (e.g. "worker-0") is watched."""
        return not self.processes or any(role.startswith(p) for p in self.processes)


def load_watchdog_config(cfg: KestrelConfig) -> WatchdogConfig:
    """The watchdog settings: cfg.watchdog_config's JSON file over the plain settings.

    Raises ValueError for an unreadable file, unknown keys or wrong types."""
    wc = WatchdogConfig(cfg.watchdog_timeout_s, cfg.watchdog_dump_dir)
    if cfg.watchdog_config:
        try:
            with open(cfg.watchdog_config) as fh:
                data = json.load(fh)
        except (OSError, ValueError) as e:
            raise ValueError(f"watchdog config {cfg.watchdog_config}: {e}") from None
        unknown = set(data) - {"timeout_s", "dump_dir", "processes"}
        if unknown:
            raise ValueError(f"watchdog config {cfg.watchdog_config}: unknown keys {sorted(unknown)}")
        try:
            wc.timeout_s = float(data.get("timeout_s", wc.timeout_s))
            wc.dump_dir = str(data.get("dump_dir", wc.dump_dir))
            wc.processes = [str(p) for p in data.get("processes", [])]
        except (TypeError, ValueError) as e:
            raise ValueError(f"watchdog config {cfg.watchdog_config}: {e}") from None
    if wc.timeout_s <= 0:
        raise ValueError("watchdog timeout_s must be > 0")
    return wc


class _Watched:
    def __init__(self, role: str, pid: int, count: int):
        self.role, self.pid = role, pid
        self.count = count
        self.changed = time.monotonic()
        self.dumped = False
        self.stacks_offset = 0


class Watchdog:
    """Background thread; `start()` once, `stop()` at exit. See the module docstring."""

    def __init__(self, runtime_dir: str, wc: WatchdogConfig):
        self.folder = watchdog_dir(runtime_dir)
        self.wc = wc
        self.dumps: list[str] = []
        self._seen: dict[str, _Watched] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    def start(self) -> None:
        """Start the watchdog thread (once)."""
        log.info("watchdog on: timeout %.1f s, dumps to %s, processes %s", self.wc.timeout_s,
                 self.wc.dump_dir, self.wc.processes or "all")
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; waits up to 2 s for it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.check()
            except Exception:  # the watchdog must never take the supervisor down
                log.exception("watchdog check failed")

    def check(self, now: float | None = None) -> None:
        """One scan of the beacons: track counters, dump the stalled, forget the dead."""
        now = time.monotonic() if now is None else now
        try:
            names = [n for n in os.listdir(self.folder) if n.endswith(".beat")]
        except FileNotFoundError:
            return
        present = set()
        for name in names:
            stem = name[:-len(".beat")]
            role, _, pid_s = stem.rpartition("-")
            if not pid_s.isdigit() or not self.wc.watches(role):
                continue
            pid = int(pid_s)
            base = os.path.join(self.folder, stem)
            if not pid_alive(pid):
                self._seen.pop(stem, None)
                for ext in (".beat", ".stacks"):
                    try:
                        os.unlink(base + ext)
                    except FileNotFoundError:
                        pass
                continue
            beat = read_beat(base + ".beat")
            if beat is None:
                continue
            present.add(stem)
            w = self._seen.get(stem)
            if w is None:
                self._seen[stem] = _Watched(role, pid, beat[0])
                continue
            if beat[0] != w.count:
                w.count, w.changed, w.dumped = beat[0], now, False
            elif not w.dumped and now - w.changed >= self.wc.timeout_s:
                w.dumped = True
                self._dump(w, base + ".stacks", now - w.changed)
        for stem in set(self._seen) - present:
            del self._seen[stem]

    def _dump(self, w: _Watched, stacks_path: str, stalled_s: float) -> None:
        private_dir(self.wc.dump_dir)  # made at startup; refused if swapped since
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        out = os.path.join(self.wc.dump_dir, f"{w.role}-{w.pid}-{stamp}.txt")
        try:
            os.kill(w.pid, DUMP_SIGNAL)
        except ProcessLookupError:
            return
        # faulthandler writes from the signal handler; done when the size stops growing.
        last, stable = -1, 0
        deadline = time.monotonic() + DUMP_WAIT_S
        while time.monotonic() < deadline and stable < 3:
            time.sleep(0.03)
            try:
                size = os.path.getsize(stacks_path)
            except OSError:
                break
            stable = stable + 1 if size == last and size > w.stacks_offset else 0
            last = size
        try:
            with open(stacks_path, "rb") as fh:
                fh.seek(w.stacks_offset)
                raw = fh.read()
            w.stacks_offset += len(raw)
            text = raw.decode("utf-8", "replace")
        except OSError as e:
            text = f"(no stacks: {e})\n"
        header = (f"# kestrel watchdog: {w.role} (pid {w.pid}) made no progress for "
                  f"{stalled_s:.1f} s; Python stacks of all threads (faulthandler)\n")
        pyspy = shutil.which("py-spy")
        extra = ""
        if pyspy:
            try:
                extra = subprocess.run([pyspy, "dump", "--pid", str(w.pid)], capture_output=True,
                                       text=True, timeout=10).stdout
            except (OSError, subprocess.SubprocessError) as e:
                extra = f"py-spy dump failed: {e}\n"
            extra = "\n# py-spy dump\n" + extra
        write_private_file(self.wc.dump_dir, os.path.basename(out), header + text + extra)
        self.dumps.append(out)
        log.warning("%s (pid %d) made no progress for %.1f s: stacks written to %s", w.role,
                    w.pid, stalled_s, out)
