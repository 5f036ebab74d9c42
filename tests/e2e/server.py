"""Start `kestrel serve` as a user would (a subprocess on a free port) and tear it down."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

from shared.config import runtime_base
from shared.runtime_dir import DUMPS_SUFFIX, sweep_dead_runtime_dirs
from tests.runtime_guard import new_instance_id

KESTREL = os.path.join(os.path.dirname(sys.executable), "kestrel")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def segments(instance_id: str) -> list[str]:
    return glob.glob(f"/dev/shm/kestrel-{instance_id}-*")


# every server log of this session: kept for a failed session (they explain it), removed
# after one that passed (`tests/conftest.py` pytest_sessionfinish)
LOGS: list[str] = []


class KestrelServer:
    """One `kestrel serve` subprocess. Logs go to a temp file (shown on failure)."""

    def __init__(self, model_dir: str, *extra: str, port: int | None = None,
                 base: str | None = None):
        """base: the folder for the runtime and dump folders (`--runtime-dir
        <base>/kestrel-<id>`; default: the one `kestrel serve` derives, /tmp or
        $XDG_RUNTIME_DIR)."""
        self.port = port or free_port()
        self.instance_id = new_instance_id("t")
        self.base = base or runtime_base()
        self.runtime_dir = os.path.join(self.base, f"kestrel-{self.instance_id}")
        self.base_url = f"http://127.0.0.1:{self.port}"
        own = ["--runtime-dir", self.runtime_dir, "--watchdog-dump-dir",
               self.runtime_dir + DUMPS_SUFFIX] if base else []
        self.argv = [KESTREL, "serve", "--model", model_dir, "--host", "127.0.0.1",
                     "--port", str(self.port), "--instance-id", self.instance_id, *own, *extra]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kestrel-serve-", suffix=".log", delete=False)
        LOGS.append(self.log.name)  # removed after a session that passed (tests/conftest.py)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> "KestrelServer":
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kestrel serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop(signal.SIGKILL)
        raise TimeoutError(f"kestrel serve not healthy after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        with open(self.log.name) as fh:
            return "".join(fh.readlines()[-n:])

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        """Stop the server with `sig` (SIGKILL after `timeout` s) and its children; the
        runtime folder of a supervisor that could not clean up (killed) is removed."""
        if self.proc is None:
            return None
        if self.proc.poll() is not None:
            self._remove_dead_folders()
            return self.proc.returncode
        kids = self.children()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        for k in kids:  # never leave anything behind a failed test
            try:
                k.wait(10)
            except psutil.TimeoutExpired:
                k.kill()
            except psutil.NoSuchProcess:
                pass
        self._remove_dead_folders()
        return self.proc.returncode

    def _remove_dead_folders(self) -> None:
        """The runtime folder of a dead supervisor (as the next `kestrel serve` would remove
        it), and its dump folder (also when another process swept the runtime folder first).
        `kestrel serve` keeps a dump folder that holds dumps, for its operator; a test server's
        dumps (a watchdog dump of a stall no test asked for, e.g. a C++ extension built inside
        a step) go to stderr, which pytest shows with a failure, and the folder is removed."""
        sweep_dead_runtime_dirs(self.instance_id, self.base)
        if os.path.exists(self.runtime_dir):
            return
        dumps = self.runtime_dir + DUMPS_SUFFIX
        for f in sorted(glob.glob(os.path.join(dumps, "*.txt"))):
            with open(f, errors="replace") as fh:
                print(f"--- watchdog dump {os.path.basename(f)} ---\n{fh.read()[:4000]}", file=sys.stderr)
        shutil.rmtree(dumps, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
