"""The supervisor's watchdog: explains hangs with stack dumps. It never kills.

Each child beats a progress counter (`shared.liveness.Beacon`). A thread of the supervisor
reads every `<runtime_dir>/watchdog/<role>-<pid>.beat` twice a second. When a counter has
not moved for `timeout_s`, it writes the Python stacks of all threads of that pid
(stack_dump.py: `py-spy dump`, which works on a stopped process too, else faulthandler
through SIGUSR1 and the process's `.stacks` file) into
`<dump_dir>/<role>-<pid>-<UTC time>.txt` (e.g. `engine-4242-20250101T120000Z.txt`). One dump
per stall: a new one only after the counter moves again.

Dumps on request: a `<role>-<pid>.dump-request` file (shared.liveness.request_dump; the
engine writes one for each live worker when a step times out, before it exits and the
supervisor kills the workers) gets a dump at the next scan, whatever the counter and
`processes` say; the dump's path is then written to `<role>-<pid>.dump-done`.

Config (`--watchdog-config FILE`, JSON, every key optional):
  {"timeout_s": 30, "dump_dir": "/var/tmp/kestrel-dumps", "processes": ["engine", "worker"],
   "py_spy": "auto"}
`processes` are role prefixes (`worker` matches `worker-0`); default: every process.
`py_spy`: auto (beside the interpreter, else on PATH), off (faulthandler only) or a path.
Missing keys come from the settings watchdog_timeout_s, watchdog_dump_dir and
watchdog_py_spy (default dump folder: `kestrel-<instance>-dumps` beside the runtime folder,
which is removed at exit). The dump folder is private (`shared.runtime_dir.private_dir`:
`kestrel serve` makes or checks it at startup, and again before each dump); dump files are
written with `write_private_file`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from services.supervisor.stack_dump import collect_stacks, find_py_spy
from shared.config import KestrelConfig
from shared.liveness import DUMP_DONE, DUMP_REQUEST, read_beat, watchdog_dir
from shared.procutil import pid_alive
from shared.runtime_dir import private_dir, write_private_file

log = logging.getLogger("kestrel.supervisor.watchdog")

POLL_S = 0.5
CONFIG_KEYS = {"timeout_s", "dump_dir", "processes", "py_spy"}


@dataclass
class WatchdogConfig:
    """timeout_s: seconds without progress before a dump. dump_dir: output folder.
    processes: role prefixes to watch (empty: all). py_spy: the py-spy binary, None for
    faulthandler only."""

    timeout_s: float
    dump_dir: str
    processes: list[str] = field(default_factory=list)
    py_spy: str | None = None

    def watches(self, role: str) -> bool:
        """Whether the process `role` (e.g. "worker-0") is watched."""
        return not self.processes or any(role.startswith(p) for p in self.processes)


def load_watchdog_config(cfg: KestrelConfig) -> WatchdogConfig:
    """The watchdog settings: cfg.watchdog_config's JSON file over the plain settings.

    Raises ValueError for an unreadable file, unknown keys, wrong types or a py_spy path
    that is not an executable."""
    wc = WatchdogConfig(cfg.watchdog_timeout_s, cfg.watchdog_dump_dir)
    py_spy = cfg.watchdog_py_spy
    if cfg.watchdog_config:
        try:
            with open(cfg.watchdog_config) as fh:
                data = json.load(fh)
        except (OSError, ValueError) as e:
            raise ValueError(f"watchdog config {cfg.watchdog_config}: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"watchdog config {cfg.watchdog_config}: expected a JSON object")
        unknown = set(data) - CONFIG_KEYS
        if unknown:
            raise ValueError(f"watchdog config {cfg.watchdog_config}: unknown keys {sorted(unknown)}")
        try:
            wc.timeout_s = float(data.get("timeout_s", wc.timeout_s))
            wc.dump_dir = str(data.get("dump_dir", wc.dump_dir))
            wc.processes = [str(p) for p in data.get("processes", [])]
            py_spy = str(data.get("py_spy", py_spy))
        except (TypeError, ValueError) as e:
            raise ValueError(f"watchdog config {cfg.watchdog_config}: {e}") from None
    if wc.timeout_s <= 0:
        raise ValueError("watchdog timeout_s must be > 0")
    wc.py_spy = find_py_spy(py_spy)
    return wc


class _Watched:
    def __init__(self, role: str, pid: int, count: int):
        self.role, self.pid = role, pid
        self.count = count
        self.changed = time.monotonic()
        self.dumped = False


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
        log.info("watchdog on: timeout %.1f s, dumps to %s, processes %s, stacks by %s",
                 self.wc.timeout_s, self.wc.dump_dir, self.wc.processes or "all",
                 self.wc.py_spy or "faulthandler (no py-spy)")
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
        """One scan of the beacons: answer dump requests, track counters, dump the
        stalled, forget the dead."""
        now = time.monotonic() if now is None else now
        try:
            listing = os.listdir(self.folder)
        except FileNotFoundError:
            return
        for name in listing:
            if name.endswith(DUMP_REQUEST):
                self._answer(name[:-len(DUMP_REQUEST)])
        present = set()
        for name in listing:
            if not name.endswith(".beat"):
                continue
            stem = name[:-len(".beat")]
            role, _, pid_s = stem.rpartition("-")
            if not pid_s.isdigit() or not self.wc.watches(role):
                continue
            pid = int(pid_s)
            base = os.path.join(self.folder, stem)
            if not pid_alive(pid):
                self._seen.pop(stem, None)
                for ext in (".beat", ".stacks", DUMP_REQUEST, DUMP_DONE):
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
                self._dump(role, pid, base + ".stacks",
                           f"made no progress for {now - w.changed:.1f} s")
        for stem in set(self._seen) - present:
            del self._seen[stem]

    def _answer(self, stem: str) -> None:
        """Dump the process of the request `<stem>.dump-request` and write the dump's path
        to `<stem>.dump-done` (atomically). A request for a dead process is dropped."""
        base = os.path.join(self.folder, stem)
        role, _, pid_s = stem.rpartition("-")
        try:
            with open(base + DUMP_REQUEST) as fh:
                reason = fh.readline().strip() or "dump requested"
            os.unlink(base + DUMP_REQUEST)
        except OSError:
            return
        if not pid_s.isdigit() or not pid_alive(int(pid_s)):
            return
        out = self._dump(role, int(pid_s), base + ".stacks", reason)
        w = self._seen.get(stem)
        if w is not None:
            w.dumped = True  # this stall has its dump
        if out is None:
            return
        write_private_file(self.folder, stem + DUMP_DONE, out + "\n")

    def _dump(self, role: str, pid: int, stacks_path: str, why: str) -> str | None:
        """Write the stacks of `pid` (stack_dump.collect_stacks) to a new dump file; returns
        its path, or None when the process is gone. `why` heads the file."""
        private_dir(self.wc.dump_dir)  # made at startup; refused if swapped since
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        out = os.path.join(self.wc.dump_dir, f"{role}-{pid}-{stamp}.txt")
        n = 1
        while os.path.lexists(out):  # a second dump of this pid within the same second
            n += 1
            out = os.path.join(self.wc.dump_dir, f"{role}-{pid}-{stamp}-{n}.txt")
        if not pid_alive(pid):
            return None
        stacks = collect_stacks(pid, stacks_path, self.wc.py_spy)
        header = (f"# kestrel watchdog: {role} (pid {pid}) {why}; Python stacks of all threads "
                  f"({stacks.method})\n" + "".join(f"# {n}\n" for n in stacks.notes))
        write_private_file(self.wc.dump_dir, os.path.basename(out), header + stacks.text)
        self.dumps.append(out)
        log.warning("%s (pid %d) %s: stacks (%s) written to %s", role, pid, why, stacks.method, out)
        return out
