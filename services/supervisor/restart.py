"""Restart policy of the supervisor: exponential backoff, give up after K failures in a window.

One `RestartPolicy` per restart unit (the engine group = engine + workers, and each
frontend). The launcher writes the restart counts of every process to the instance's
restart-count file after every restart (its format: `shared.restart_counts`).
"""

from __future__ import annotations

import time
from collections import deque

BASE_DELAY_S = 0.25
MAX_DELAY_S = 10.0


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

