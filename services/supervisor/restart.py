"""Restart policy of the supervisor: exponential backoff, give up after K failures in a window.

One `RestartPolicy` per restart unit (the engine group = engine + workers, and each
frontend). Restart counts of every process go to `<runtime_dir>/restarts.json`
(`{"engine": 1, "worker-0": 1, "frontend-0": 0, ...}`), rewritten atomically after every
restart; `read_restart_counts` reads it (for /metrics).
"""

from __future__ import annotations

import json
import os
import time
from collections import deque

BASE_DELAY_S = 0.25
MAX_DELAY_S = 10.0
RESTARTS_FILE = "restarts.json"


class RestartPolicy:
    """Decides whether and when to restart after a failure.

    max_restarts: restarts allowed within window_s seconds; the failure after those gives
    up. Delays double from base_delay_s up to max_delay_s while failures keep coming within
    the window, and fall back to base_delay_s once the window holds none.
    """

    def __init__(self, max_restarts: int, window_s: float, base_delay_s: float = BASE_DELAY_S,
                 max_delay_s: float = MAX_DELAY_S):
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.base_delay_s = base_delay_s
        self.max_delay_s = max_delay_s
        self.failures: deque[float] = deque()
        self.total = 0

    def on_failure(self, now: float | None = None) -> float | None:
        """Record one failure at `now` (time.monotonic() seconds). Returns the delay in
        seconds before the restart, or None when the policy gives up."""
        now = time.monotonic() if now is None else now
        while self.failures and now - self.failures[0] > self.window_s:
            self.failures.popleft()
        self.failures.append(now)
        if len(self.failures) > self.max_restarts:
            return None
        self.total += 1
        return min(self.base_delay_s * 2 ** (len(self.failures) - 1), self.max_delay_s)


def write_restart_counts(runtime_dir: str, counts: dict[str, int]) -> None:
    """Write `counts` (process role -> restarts) to <runtime_dir>/restarts.json atomically."""
    path = os.path.join(runtime_dir, RESTARTS_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(counts, fh)
    os.replace(tmp, path)


def read_restart_counts(runtime_dir: str) -> dict[str, int]:
    """Restarts per process role of the instance at `runtime_dir` ({} before the first
    write, or when the supervisor is gone)."""
    try:
        with open(os.path.join(runtime_dir, RESTARTS_FILE)) as fh:
            return {str(k): int(v) for k, v in json.load(fh).items()}
    except (OSError, ValueError):
        return {}
