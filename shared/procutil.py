"""Process utilities shared by every Kestrel process: titles, parent-death signal, stop
signals, logging, a fast exit."""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import subprocess
import sys
from typing import NoReturn

_PR_SET_PDEATHSIG = 1
# the exit code of a process that refuses its configuration (it would refuse it again): the
# supervisor stops the server instead of restarting it. The engine also leaves the file
# CONFIG_REFUSED in the runtime folder (its exit code can be lost to the supervisor's
# SIGTERM when its worker exits first)
EXIT_CONFIG = 2
CONFIG_REFUSED = "engine_refused_config.txt"


def set_title(title: str) -> None:
    """Set the process title (`ps`, `py-spy` and `top` show it), e.g. `kestrel:engine`."""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # pragma: no cover - setproctitle is a runtime dependency
        pass


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux prctl
    PR_SET_PDEATHSIG). Also exits at once if the parent is already gone (pid 1 adoption).

    Call it first thing in a child process. No-op on non-Linux systems.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    ppid = supervisor_pid()
    if ppid and os.getppid() != ppid:
        os._exit(1)  # the supervisor died before prctl took effect


def supervisor_pid() -> int | None:
    """The pid of the `kestrel serve` supervisor that started this process, or None when it
    runs alone. Read from the environment (KESTREL_SUPERVISOR_PID, set by the launcher for
    its children): this is how a process learns who started it, not a setting, so it is
    not in the config object."""
    pid = os.environ.get("KESTREL_SUPERVISOR_PID")
    return int(pid) if pid and pid.isdigit() else None


def ignore_sigint_if_supervised() -> None:
    """Under a supervisor, ignore SIGINT from now on (also across exec), then unblock it
    (spawn_supervised starts children with it blocked; a Ctrl-C that came meanwhile is
    pending, and an ignored pending signal is discarded).

    A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the supervisor
    alone reacts (an orderly drain: frontends, then engine, then workers, each by SIGTERM).
    A child that also stopped on SIGINT would cut requests in flight. Call it first thing in
    a child process; a process run alone keeps Ctrl-C = stop. Main thread only.
    """
    if supervisor_pid() is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def spawn_supervised(argv: list[str], **popen_kw) -> subprocess.Popen:
    """`subprocess.Popen(argv, **popen_kw)` for a child of the supervisor, started with
    SIGINT blocked: the blocked mask survives fork and exec, so a Ctrl-C to the process
    group while the child's interpreter still starts up (before its
    ignore_sigint_if_supervised) stays pending instead of raising KeyboardInterrupt in
    it. The caller's thread has SIGINT blocked only for the call; one that arrived
    meanwhile is delivered to it right after."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return subprocess.Popen(argv, **popen_kw)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def on_stop_signals(handler) -> None:
    """Install `handler(signum, frame)` for SIGTERM, and for SIGINT when the process runs
    alone; under a supervisor SIGINT is ignored (see ignore_sigint_if_supervised)."""
    signal.signal(signal.SIGTERM, handler)
    if supervisor_pid() is None:
        signal.signal(signal.SIGINT, handler)
    else:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def setup_logging(process: str, level: str = "INFO") -> logging.Logger:
    """One log line per event, prefixed with the time and the process name."""
    logging.basicConfig(
        level=getattr(logging, str(level).upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s [{process}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    return logging.getLogger("kestrel")


def await_activation(title: str) -> bool:
    """The wait of a standby process (services/supervisor/standby.py), after its imports:
    set the process title `title`, die with the parent, and block until a line arrives on
    stdin. True for "go" (carry on as the real process), False at EOF or anything else
    (exit quietly)."""
    set_title(title)
    die_with_parent()
    return sys.stdin.readline().strip() == "go"


def freeze_gc() -> None:
    """Once a process is ready to serve: collect, then move every object alive into the
    collector's permanent generation (`gc.freeze`), so that the full collections the serving
    loop's allocations trigger no longer walk the modules, the model and the startup's
    objects (a worker holds hundreds of thousands: a full pass paused a step for
    milliseconds); the young generation's threshold is raised from 700 to 10,000
    allocations, so that a step's short-lived objects are mostly freed by reference
    counting before a pass runs. Cycles made later are still collected
    (docs/ARCHITECTURE.md §2.6)."""
    import gc
    gc.collect()
    gc.freeze()
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(10_000, g1, g2)


def exit_now(code: int) -> NoReturn:
    """End this process with exit status `code` once its own cleanup is done: run the atexit
    handlers, flush the logs and stdio, then `os._exit`. It skips the interpreter's teardown
    of every loaded module (3.3 s with torch and xgrammar loaded, measured on the busy 2-core
    dev machine), time that an engine-group restart would otherwise wait for. Non-daemon
    threads are not joined: call it only where the process has stopped its own."""
    try:
        atexit._run_exitfuncs()
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing left to say
                pass
    finally:
        os._exit(code)


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (and is not a zombie)."""
    try:
        import psutil

        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except Exception:
        return False
