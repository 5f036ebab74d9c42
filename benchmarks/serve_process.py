"""`kestrel serve` as a benchmark's subprocess.

Started as `<this python> -m services.cli serve` (the `kestrel` console script need not be
installed: the GPU machine runs from a checkout with PYTHONPATH=.), on a free port of
127.0.0.1, in its own session, with its output in a temp log file. Stopped with SIGTERM
(the supervisor drains and stops its children, which also die with it: PR_SET_PDEATHSIG),
then SIGKILL of its process group, so nothing it started outlives the benchmark.
tests/e2e/server.py does the same for the tests, through the console script and psutil.
A running server answers the benchmarks' reads: its model name, the engine's stats (GET
/internal/stats) and the spec_decode counters (GET /metrics, benchmarks/spec_stats.py), and
one started with --debug-utilities and a speculative config switches its speculation on or
off (POST /debug/speculation).
`serve_flags` spells a settings dict as the server's flags.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from benchmarks import spec_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(environ: dict[str, str]) -> dict[str, str]:
    """The server's environment: environ without KESTREL_* variables (the benchmark's flags
    are the only settings), PYTHONPATH with the repo root first and every entry absolute."""
    env = {k: v for k, v in environ.items() if not k.startswith("KESTREL_")}
    paths = [ROOT] + [os.path.abspath(p) for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def serve_flags(settings: dict) -> list[str]:
    """`kestrel serve` flags of a settings dict: --key-with-dashes value, booleans as
    true/false, None values left out."""
    out = []
    for k, v in settings.items():
        if v is not None:
            out += ["--" + k.replace("_", "-"), str(v).lower() if isinstance(v, bool) else str(v)]
    return out


class ServeProcess:
    """One `kestrel serve` subprocess. flags: its settings as CLI flags (without --host and
    --port). Attributes: base_url, log_path, startup_seconds (None until healthy)."""

    def __init__(self, flags: list[str]):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "services.cli", "serve", *flags,
                     "--host", "127.0.0.1", "--port", str(self.port)]
        fd, self.log_path = tempfile.mkstemp(prefix="kestrel-serve-bench-", suffix=".log")
        os.close(fd)
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    def start(self, timeout: float) -> None:
        """Start the server and wait until GET /health answers 200. Raises RuntimeError if
        it exits first, TimeoutError after `timeout` seconds (the caller then calls stop)."""
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=server_env(dict(os.environ)),
                                         start_new_session=True)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kestrel serve exited with {self.proc.returncode}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                    self.startup_seconds = round(time.monotonic() - t0, 2)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"kestrel serve not healthy after {timeout} s")

    def model_name(self) -> str:
        """The served model's name (GET /v1/models)."""
        r = httpx.get(self.base_url + "/v1/models", timeout=10.0, trust_env=False)
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def engine_stats(self) -> dict:
        """The engine's stats utility (GET /internal/stats: num_steps, num_blocks, the
        spec_decode_* counters ...), {} when it does not answer 200."""
        r = httpx.get(self.base_url + "/internal/stats", timeout=10.0, trust_env=False)
        return r.json() if r.status_code == 200 else {}

    def spec_counters(self) -> tuple[dict | None, str]:
        """The server's spec_decode counters now (benchmarks/spec_stats.py
        `parse_spec_metrics`), and where they came from ("metrics": GET /metrics,
        "engine_stats": GET /internal/stats, "none": the server does not speculate)."""
        text = httpx.get(self.base_url + "/metrics", timeout=10.0, trust_env=False).text
        c = spec_stats.parse_spec_metrics(text)
        if c is not None:
            return c, "metrics"
        c = spec_stats.spec_counters_from_stats(self.engine_stats())
        return (c, "engine_stats") if c is not None else (None, "none")

    def set_speculation(self, enabled: bool) -> None:
        """Switch the server's speculative decoding on or off (POST /debug/speculation: the
        engine's set_speculation utility; the server needs --debug-utilities and a
        speculative config). Raises RuntimeError when the server does not answer 200."""
        r = httpx.post(self.base_url + "/debug/speculation", json={"enabled": enabled}, timeout=10.0,
                       trust_env=False)
        if r.status_code != 200:
            raise RuntimeError(f"POST /debug/speculation {{enabled: {enabled}}}: {r.status_code} {r.text}")

    def log_tail(self, n: int = 40) -> str:
        """The last n lines of the server's log."""
        with open(self.log_path, errors="replace") as fh:
            return "".join(fh.readlines()[-n:])

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM, wait up to `grace` seconds, then SIGKILL whatever is left of the
        server's process group. Returns the server's exit status (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:  # the group is the server's own session (start_new_session): only its processes
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self.proc.wait()
