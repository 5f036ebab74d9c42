"""`kestrel serve`: start the engine, the worker and the frontend as supervised processes.

Order: sweep stale shm segments, write the resolved config (values and sources) for the
children, start engine + worker + frontend, wait until the frontend's /health says 200 and
print the URL. Every child asks the kernel for SIGTERM when the supervisor dies
(PR_SET_PDEATHSIG), so a kill -9 of the supervisor leaves no orphan.

Stop (SIGTERM or Ctrl-C): frontend first, then the engine (which tells the workers to exit
and unlinks its ring), then whatever is left; SIGKILL after a grace period. Then the
instance's runtime folder and any of its shm segments are removed.
If a child dies on its own, everything is stopped and `serve` exits 1.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from shared.config import KestrelConfig
from shared.procutil import set_title, setup_logging

log = logging.getLogger("kestrel.supervisor")

GRACE_S = 10.0


class Child:
    """One supervised process: its role name, command line and Popen handle."""

    def __init__(self, role: str, argv: list[str], env: dict[str, str]):
        self.role = role
        self.argv = argv
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env)
        log.info("started %s (pid %d)", self.role, self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=max(timeout, 0.0))
            return True
        except subprocess.TimeoutExpired:
            return False


def _health_url(cfg: KestrelConfig) -> str:
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "", "::") else cfg.host
    return f"http://{host}:{cfg.port}/health"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _sweep(instance_id: str | None) -> None:
    try:
        from shared.shm_tool import sweep_stale

        removed = sweep_stale(instance_id)
        if removed:
            log.info("removed stale shm segments: %s", ", ".join(removed))
    except Exception as e:  # never block startup on the sweep
        log.warning("stale segment sweep failed: %s", e)


def serve(cfg: KestrelConfig) -> int:
    """Run the whole server on this host until SIGTERM/SIGINT. Returns the exit code."""
    set_title("kestrel:supervisor")
    setup_logging("supervisor", cfg.log_level)
    log.info("effective settings:\n%s", cfg.table())
    if not os.path.isfile(os.path.join(cfg.model, "config.json")):
        log.error("model folder %r not found (no config.json). Run `kestrel fetch-model` for "
                  "the default model, or pass --model DIR.", cfg.model)
        return 2
    _sweep(None)
    os.makedirs(cfg.runtime_dir, mode=0o700, exist_ok=True)
    resolved = os.path.join(cfg.runtime_dir, "config.json")
    fd = os.open(resolved, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(cfg.to_json())
    env = dict(os.environ, KESTREL_SUPERVISOR_PID=str(os.getpid()))
    base = [sys.executable, "-m", "services.cli"]
    children = [
        Child("engine", base + ["engine", "--resolved-config", resolved], env),
        Child("worker:0", base + ["worker", "--rank", "0", "--resolved-config", resolved], env),
        Child("frontend", base + ["frontend", "--resolved-config", resolved], env),
    ]
    stop = {"sig": None}

    def on_signal(signum, frame):
        stop["sig"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t0 = time.monotonic()
    for c in children:
        c.start()
    code = 0
    url = _health_url(cfg)
    ready = False
    try:
        while stop["sig"] is None:
            dead = [c for c in children if not c.alive()]
            if dead:
                for c in dead:
                    log.error("%s exited with code %s", c.role, c.proc.returncode)
                code = 1
                break
            if not ready:
                if _healthy(url):
                    ready = True
                    base_url = url[: -len("/health")]
                    log.info("ready in %.1f s", time.monotonic() - t0)
                    print(f"Kestrel is serving {cfg.served_model_name} at {base_url}/v1", flush=True)
                elif time.monotonic() - t0 > cfg.startup_timeout_s:
                    log.error("not ready after %.0f s", cfg.startup_timeout_s)
                    code = 1
                    break
            time.sleep(0.1)
    finally:
        _stop_all(children)
        shutil.rmtree(cfg.runtime_dir, ignore_errors=True)
        _sweep(cfg.instance_id)
    log.info("stopped (exit code %d)", code)
    return code


def _stop_all(children: list[Child]) -> None:
    by_role = {c.role: c for c in children}
    order = [["frontend"], ["engine"], [r for r in by_role if r.startswith("worker")]]
    deadline = time.monotonic() + GRACE_S
    for group in order:
        for role in group:
            by_role[role].signal(signal.SIGTERM)
        for role in group:
            by_role[role].wait(deadline - time.monotonic())
    for c in children:
        if c.alive():
            log.warning("%s did not stop in %.0f s: killing it", c.role, GRACE_S)
            c.signal(signal.SIGKILL)
            c.wait(5.0)


def dump_config(cfg: KestrelConfig) -> str:
    """The resolved config as JSON (values with sources), for tools and tests."""
    return json.dumps(json.loads(cfg.to_json()), indent=2)
