"""How the watchdog gets the Python stacks of another process: py-spy, else faulthandler.

py-spy (`py-spy dump --pid N`; the pip package `py-spy` ships the binary, installed next to
the interpreter) reads the target's memory from outside (process_vm_readv), so it needs no
help from the target: it works on a process stuck in C code, and on one stopped by SIGSTOP.
On a running process it first pauses it (ptrace) for a consistent snapshot. A process that
is already stopped cannot be paused again (py-spy 0.4 fails with "Failed to suspend
process"), so a stopped one is read with `--nonblocking`, which is consistent there since
nothing runs. py-spy needs ptrace permission over the target: root or CAP_SYS_PTRACE, or the
same user with kernel.yama.ptrace_scope 0 (with Yama's default 1 only an ancestor may trace,
and py-spy is the target's sibling); when it is refused py-spy fails and the fallback runs.

faulthandler (the fallback when py-spy is absent, switched off or fails): SIGUSR1 to the
target, whose handler (`shared.liveness.Beacon`) appends the stacks of all its threads to
its pre-opened `.stacks` file. It runs inside the target, so a stopped process writes
nothing until it is continued: the watchdog then says so in the dump instead of waiting.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import psutil

from shared.liveness import DUMP_SIGNAL

PY_SPY_TIMEOUT_S = 10.0   # one `py-spy dump` run
FAULTHANDLER_WAIT_S = 2.0  # how long faulthandler's output may take to appear after SIGUSR1


@dataclass
class Stacks:
    """One process's stacks. text: the dump's body. method: how they were taken ("py-spy",
    "py-spy --nonblocking", "faulthandler" or "none"). notes: why py-spy was not used or
    failed, and the process state when it matters (lines for the dump's header)."""

    text: str
    method: str
    notes: list[str]


def find_py_spy(setting: str) -> str | None:
    """The py-spy binary to use. setting: "auto" (next to sys.executable, where pip puts it
    in a virtual environment, else on PATH; None when neither has it), "off" (None) or a
    path. Raises ValueError for a path that is not an executable file."""
    if setting == "off":
        return None
    if setting == "auto":
        beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
        if os.path.isfile(beside) and os.access(beside, os.X_OK):
            return beside
        return shutil.which("py-spy")
    if not (os.path.isfile(setting) and os.access(setting, os.X_OK)):
        raise ValueError(f"watchdog py_spy: {setting!r} is not an executable file "
                         "(use auto, off or the path of the py-spy binary)")
    return setting


def is_stopped(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP/SIGTSTP, or held by a tracer); False if gone."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def _py_spy_error(proc: subprocess.CompletedProcess) -> str:
    """The first lines of py-spy's error, without its Rust backtrace."""
    lines = []
    for line in (proc.stderr or proc.stdout or "").splitlines():
        if line.startswith("Stack backtrace:"):
            break
        if line.strip():
            lines.append(line.strip())
    return " / ".join(lines[:4]) or f"exit code {proc.returncode}"


def py_spy_stacks(binary: str, pid: int, stopped: bool) -> tuple[str | None, str, str]:
    """Run `py-spy dump --pid pid` (`--nonblocking` for a stopped process, and as the second
    try when pausing a running one fails). Returns (output or None, the method that gave
    it, why it failed: "" on success). Never raises."""
    tries = [["--nonblocking"]] if stopped else [[], ["--nonblocking"]]
    errors = []
    for extra in tries:
        method = " ".join(["py-spy", *extra])
        try:
            proc = subprocess.run([binary, "dump", "--pid", str(pid), *extra], capture_output=True,
                                  text=True, timeout=PY_SPY_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(f"{method}: {e}")
            continue
        if proc.returncode == 0 and "Thread " in proc.stdout:
            return proc.stdout, method, ""
        errors.append(f"{method}: {_py_spy_error(proc)}")
    return None, "", "; ".join(errors)


def faulthandler_stacks(pid: int, stacks_path: str) -> str:
    """SIGUSR1 to `pid` and the bytes its faulthandler appends to `stacks_path` within
    FAULTHANDLER_WAIT_S (done when the size stops growing). Returns the text, or a line
    saying why there is none. Never raises."""
    try:
        start = os.path.getsize(stacks_path)  # bytes of earlier dumps are not this one's
    except OSError as e:
        return f"(no stacks: {e})\n"
    try:
        os.kill(pid, DUMP_SIGNAL)
    except OSError as e:
        return f"(no stacks: {e})\n"
    last, stable = -1, 0
    deadline = time.monotonic() + FAULTHANDLER_WAIT_S
    while time.monotonic() < deadline and stable < 3:
        time.sleep(0.03)
        try:
            size = os.path.getsize(stacks_path)
        except OSError:
            break
        stable = stable + 1 if size == last and size > start else 0
        last = size
    try:
        with open(stacks_path, "rb") as fh:
            fh.seek(start)
            raw = fh.read()
    except OSError as e:
        return f"(no stacks: {e})\n"
    if not raw:
        return f"(no stacks: nothing written within {FAULTHANDLER_WAIT_S:.0f} s of SIGUSR1)\n"
    return raw.decode("utf-8", "replace")


def collect_stacks(pid: int, stacks_path: str, py_spy: str | None) -> Stacks:
    """The Python stacks of every thread of `pid`: py-spy's when `py_spy` (the binary) is
    given and works, else faulthandler's through `stacks_path` (the process's `.stacks`
    file), else none for a stopped process. Never raises."""
    stopped = is_stopped(pid)
    notes = ["process state: stopped (SIGSTOP or a tracer)"] if stopped else []
    if py_spy is None:
        notes.append("py-spy: not used (not installed, or watchdog py_spy is off)")
    else:
        text, method, err = py_spy_stacks(py_spy, pid, stopped)
        if text is not None:
            return Stacks(text, method, notes)
        notes.append(f"py-spy failed: {err}")
    if stopped:
        notes.append("faulthandler: not signalled, it cannot run in a stopped process")
        return Stacks("(no stacks)\n", "none", notes)
    return Stacks(faulthandler_stacks(pid, stacks_path), "faulthandler", notes)
