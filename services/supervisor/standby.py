"""Standby processes of the engine group: a restart without the imports.

Most of an engine-group restart on a small CPU host is Python importing torch (and
xgrammar in the engine): 4-5 s of each process on the idle 2-core dev VM, 10-20 s when it
is busy, before the worker even starts loading weights. With cfg.engine_standby the
supervisor keeps, for the engine and for each worker, one spare process that ran the same
command with `--standby`: it parsed its config and imported its role's modules, and then
waits on its stdin (`shared.procutil.await_activation`). A restart activates the spare
(writes "go") instead of starting a fresh process, and it goes on exactly as a fresh one
would; a new spare is made once the group serves again (healthy for STANDBY_DELAY_S), so
spares never compete with a starting server for the cores. Nor with a serving one: past
STANDBY_DELAY_S the spares wait for the group to be idle (`IdleGate`: its processes used
under IDLE_CPU of a core over IDLE_WINDOW_S), at most cfg.standby_idle_wait_s more seconds
(then they are made anyway). Two spares importing took both cores of the 2-core dev VM for
seconds: a batch-1 stream that ran into it decoded at 62 tok/s instead of 87-91. A spare holds no socket, ring,
beacon or GPU context; it costs the memory of its imports (about 270-300 MB RSS each,
shared library pages included). It exits when its stdin closes, on SIGTERM (the
supervisor's stop) and when the supervisor dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

import psutil

from shared.procutil import spawn_supervised

log = logging.getLogger("kestrel.supervisor")

STANDBY_DELAY_S = 10.0  # the group serves this long before its spares are made
IDLE_CPU = 0.25         # cores: the engine group's CPU use under which it counts as idle
IDLE_WINDOW_S = 1.0     # seconds of CPU use that one idle reading covers
ACTIVATE = b"go\n"


def cpu_seconds(pids: Sequence[int]) -> float | None:
    """User + system CPU seconds used so far by the processes `pids` together (all their
    threads; psutil, /proc on Linux), or None when one of them is gone."""
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            return None
        total += t.user + t.system
    return total


class IdleGate:
    """When the spares of a serving engine group may be made (module doc).

    max_wait_s: seconds after `since` (the time STANDBY_DELAY_S passed) after which `open`
    is True whatever the load; 0: always True. cpu: CPU seconds of a pid list (default
    `cpu_seconds`; tests pass fakes). clock: monotonic seconds.
    """

    def __init__(self, max_wait_s: float, cpu: Callable[[Sequence[int]], float | None] = cpu_seconds,
                 clock: Callable[[], float] = time.monotonic):
        self.max_wait_s = max_wait_s
        self.cpu, self.clock = cpu, clock
        self._sample: tuple[tuple[int, ...], float, float] | None = None  # (pids, time, cpu s)

    def open(self, pids: Sequence[int], since: float) -> bool:
        """Whether the processes `pids` used under IDLE_CPU cores over the last reading of
        at least IDLE_WINDOW_S (one reading is kept between calls; a new pid set starts a
        new one), or max_wait_s has passed since `since` (clock seconds)."""
        now = self.clock()
        if self.max_wait_s <= 0 or now - since >= self.max_wait_s:
            return True
        key, last = tuple(pids), self._sample
        if last is not None and last[0] == key and now - last[1] < IDLE_WINDOW_S:
            return False  # the reading is still short of a window
        used = self.cpu(pids)
        self._sample = None if used is None else (key, now, used)
        if used is None or last is None or last[0] != key:
            return False
        return (used - last[2]) / (now - last[1]) < IDLE_CPU


class Standby:
    """The spare process of one engine-group role. argv: that role's command line (without
    `--standby`); env: its environment."""

    def __init__(self, role: str, argv: list[str], env: dict[str, str]):
        self.role = role
        self.argv = argv + ["--standby"]
        self.env = env
        self.proc: subprocess.Popen | None = None

    def alive(self) -> bool:
        """Spawned and not exited."""
        return self.proc is not None and self.proc.poll() is None

    def spawn(self) -> None:
        """Start the spare (it imports, then waits for activation)."""
        self.proc = spawn_supervised(self.argv, env=self.env, stdin=subprocess.PIPE)
        log.info("standby for %s started (pid %d)", self.role, self.proc.pid)

    def take(self) -> subprocess.Popen | None:
        """Activate the spare and hand it over (it is no longer this Standby's), or None when
        there is no live spare (or it could not be told)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None or proc.stdin is None:
            return None
        try:
            proc.stdin.write(ACTIVATE)
            proc.stdin.close()
        except OSError:  # it died meanwhile
            _end(proc)
            return None
        return proc

    def stop(self) -> None:
        """End the spare if there is one: close its stdin and SIGTERM it (it holds nothing
        to clean up), SIGKILL after 5 s."""
        proc, self.proc = self.proc, None
        if proc is not None:
            _end(proc)


def _end(proc: subprocess.Popen) -> None:
    try:
        if proc.stdin is not None:
            proc.stdin.close()
    except OSError:
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass
        try:
            proc.wait(5.0)
            return
        except subprocess.TimeoutExpired:
            continue
