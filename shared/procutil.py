"""Process utilities shared by every Kestrel process: titles, parent-death signal, logging."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


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
    ppid = os.environ.get("KESTREL_SUPERVISOR_PID")
    if ppid and os.getppid() != int(ppid):
        os._exit(1)  # the supervisor died before prctl took effect


def setup_logging(process: str, level: str = "INFO") -> logging.Logger:
    """One log line per event, prefixed with the time and the process name."""
    logging.basicConfig(
        level=getattr(logging, str(level).upper(), logging.INFO),
        format=f"%(asctime)s %(levelname)s [{process}] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    return logging.getLogger("kestrel")


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (and is not a zombie)."""
    try:
        import psutil

        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except Exception:
        return False
