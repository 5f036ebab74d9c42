"""Standby processes of the engine group: a restart without the imports.

Most of an engine-group restart on a small CPU host is Python importing torch (and
xgrammar in the engine): 4-5 s of each process on the idle 2-core dev VM, 10-20 s when it
is busy, before the worker even starts loading weights. With cfg.engine_standby the
supervisor keeps, for the engine and for each worker, one spare process that ran the same
command with `--standby`: it parsed its config and imported its role's modules, and then
waits on its stdin (`shared.procutil.await_activation`). A restart activates the spare
(writes "go") instead of starting a fresh process, and it goes on exactly as a fresh one
would; a new spare is made once the group serves again (healthy for STANDBY_DELAY_S), so
spares never compete with a starting server for the cores. A spare holds no socket, ring,
beacon or GPU context; it costs the memory of its imports (about 270-300 MB RSS each,
shared library pages included). It exits when its stdin closes, on SIGTERM (the
supervisor's stop) and when the supervisor dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import signal
import subprocess

from shared.procutil import spawn_supervised

log = logging.getLogger("kestrel.supervisor")

STANDBY_DELAY_S = 10.0  # the group serves this long before its spares are made
ACTIVATE = b"go\n"


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
