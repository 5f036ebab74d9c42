"""Helpers of the fault tests: find Kestrel processes by title, run streaming requests in
threads and record how each ended, poll with deadlines."""

from __future__ import annotations

import functools
import json
import threading
import time

import httpx
import psutil

from shared.shm_tool import list_segments

MODEL = "SmolLM2-135M-Instruct"


def find_pid(srv, title: str, exclude: tuple[int, ...] = (), timeout: float = 30.0) -> int:
    """Pid of the live child of `srv` whose process title is `title` (e.g. "kestrel:engine").
    Raises TimeoutError if none appears within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in srv.children():
            try:
                cmd = p.cmdline()
                if cmd and cmd[0].strip() == title and p.pid not in exclude and \
                        p.status() != psutil.STATUS_ZOMBIE:
                    return p.pid
            except psutil.Error:
                continue
        time.sleep(0.05)
    raise TimeoutError(f"no {title} child within {timeout} s")


def _running(pid: int) -> bool:
    """Whether pid is a live process (not gone, not a zombie); a process that exits while
    it is looked at is gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone(pids, timeout: float) -> list[int]:
    """Wait up to `timeout` s for every pid to exit; returns those still alive."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while time.monotonic() < deadline:
        alive = [p for p in pids if _running(p)]
        if not alive:
            break
        time.sleep(0.1)
    return alive


def wait_for(pred, timeout: float, step: float = 0.1):
    """Poll `pred()` until truthy; returns its value or None after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            v = pred()
        except (httpx.HTTPError, OSError):
            v = None
        if v:
            return v
        time.sleep(step)
    return None


def chat_ok(base_url: str, timeout: float = 10.0) -> bool:
    """True when one short chat completion succeeds (HTTP 200 with content)."""
    r = httpx.post(base_url + "/v1/chat/completions", timeout=timeout, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 2, "temperature": 0})
    return r.status_code == 200 and bool(r.json()["choices"][0]["message"]["content"])


def engine_stats(base_url: str) -> dict:
    """The engine's `stats` utility result through the frontend's loopback-only route."""
    r = httpx.get(base_url + "/internal/stats", timeout=5)
    r.raise_for_status()
    return r.json()


def stale_or_foreign_segments(instance_id: str) -> list[str]:
    """Segments of the instance whose owner is not alive (should be none)."""
    return [s.name for s in list_segments(instance_id) if s.owner_alive is not True]


class Stream(threading.Thread):
    """One streaming chat completion in a thread.

    outcome: "done" (saw a finish_reason and [DONE]), "error" (an SSE error event or a
    non-200 status), "dropped" (the connection broke). first: set at the first content
    chunk. client_port: the local TCP port (to tell which frontend served it)."""

    def __init__(self, base_url: str, max_tokens: int = 400,
                 prompt: str = "Count from 1 to 1000, separated by commas."):
        super().__init__(daemon=True)
        self.base_url, self.max_tokens, self.prompt = base_url, max_tokens, prompt
        self.first = threading.Event()
        self.outcome: str | None = None
        self.detail = ""
        self.ended_at: float | None = None
        self.client_port: int | None = None
        self.finish_reason: str | None = None
        self.tokens = 0

    def run(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": self.prompt}],
                "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", self.base_url + "/v1/chat/completions", json=body,
                              timeout=httpx.Timeout(60, connect=10)) as r:
                ns = r.extensions.get("network_stream")
                if ns is not None:
                    addr = ns.get_extra_info("client_addr")
                    self.client_port = addr[1] if addr else None
                if r.status_code != 200:
                    self.outcome, self.detail = "error", f"status {r.status_code}"
                    return
                done = False
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        self.outcome, self.detail = "error", obj["error"].get("message", "")
                        return
                    for c in obj.get("choices", []):
                        if c.get("delta", {}).get("content"):
                            self.tokens += 1
                            self.first.set()
                        if c.get("finish_reason"):
                            self.finish_reason = c["finish_reason"]
                self.outcome = "done" if done and self.finish_reason else "dropped"
        except (httpx.HTTPError, OSError) as e:
            self.outcome, self.detail = "dropped", repr(e)
        finally:
            self.ended_at = time.monotonic()
            self.first.set()


def start_streams(base_url: str, n: int, timeout: float = 60.0, **kw) -> list[Stream]:
    """Start `n` streams and wait until each produced its first chunk (or ended)."""
    streams = [Stream(base_url, **kw) for _ in range(n)]
    for s in streams:
        s.start()
    deadline = time.monotonic() + timeout
    for s in streams:
        assert s.first.wait(max(deadline - time.monotonic(), 0)), "a stream never started"
    assert all(s.outcome is None for s in streams), [(s.outcome, s.detail) for s in streams]
    return streams


def join_all(streams: list[Stream], timeout: float) -> list[Stream]:
    """Join the streams within `timeout` seconds in all; returns those still running."""
    deadline = time.monotonic() + timeout
    for s in streams:
        s.join(max(deadline - time.monotonic(), 0))
    return [s for s in streams if s.is_alive()]


@functools.cache
def py_spy_skip_reason() -> str | None:
    """Why the watchdog's py-spy cannot dump a process here (None when it can): not
    installed, or no ptrace permission over a sibling process (the supervisor's py-spy and
    a worker are siblings; root, CAP_SYS_PTRACE or kernel.yama.ptrace_scope 0 allow it)."""
    import subprocess
    import sys

    from services.supervisor.stack_dump import find_py_spy, py_spy_stacks

    binary = find_py_spy("auto")
    if binary is None:
        return "py-spy is not installed (pip install py-spy)"
    target = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"])
    try:
        text, _, err = py_spy_stacks(binary, target.pid, stopped=False)
    finally:
        target.kill()
        target.wait(30)
    return None if text is not None else f"py-spy cannot trace a sibling process here: {err}"
