"""The engine's periodic log line (docs/ARCHITECTURE.md §8.5).

Every LOG_INTERVAL_S while steps run, one INFO line from the differences between two
`EngineCore.stats()` answers: steps and generated tokens per second, requests running and
waiting, KV cache usage, the prefix cache's hit rate over the interval and, with
speculative decoding on (docs/ARCHITECTURE.md §5.5), the mean acceptance length over the
interval (1 + accepted / drafts, vLLM's definition), the draft acceptance rate, the
acceptance rate per draft position, and how many seqs verified drafts. Nothing is logged
for an interval without steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kestrel.engine")

LOG_INTERVAL_S = 10.0


def stats_line(prev: dict[str, Any], cur: dict[str, Any], seconds: float) -> str | None:
    """The log line for the interval from stats `prev` to stats `cur`, `seconds` long, or
    None when no step ran in it."""
    steps = cur.get("num_steps", 0) - prev.get("num_steps", 0)
    if steps <= 0 or seconds <= 0:
        return None
    gen = cur.get("num_generated_tokens", 0) - prev.get("num_generated_tokens", 0)
    q = cur.get("prefix_cache_queries", 0) - prev.get("prefix_cache_queries", 0)
    h = cur.get("prefix_cache_hits", 0) - prev.get("prefix_cache_hits", 0)
    text = (f"engine: {steps / seconds:.1f} steps/s, generation {gen / seconds:.1f} tok/s, "
            f"running {cur.get('num_running', 0)}, waiting {cur.get('num_waiting', 0)}, "
            f"KV cache {100 * cur.get('kv_usage', 0.0):.1f}%, prefix cache hits "
            f"{100 * h / q if q else 0.0:.1f}%")
    if "spec_decode_num_drafts" in cur:
        drafts = cur["spec_decode_num_drafts"] - prev.get("spec_decode_num_drafts", 0)
        tokens = cur["spec_decode_num_draft_tokens"] - prev.get("spec_decode_num_draft_tokens", 0)
        acc = cur["spec_decode_num_accepted_tokens"] - prev.get("spec_decode_num_accepted_tokens", 0)
        before = prev.get("spec_decode_num_accepted_tokens_per_pos") or []
        per_pos = [n - (before[i] if i < len(before) else 0)
                   for i, n in enumerate(cur["spec_decode_num_accepted_tokens_per_pos"])]
        if drafts:
            rates = ", ".join(f"{n / drafts:.2f}" for n in per_pos)
            text += (f", spec decode: mean acceptance length {1 + acc / drafts:.2f}, acceptance rate "
                     f"{100 * acc / tokens:.1f}% ({acc}/{tokens} draft tokens in {drafts} seqs), "
                     f"per position {rates}")
        else:
            text += ", spec decode: no drafts verified"
    return text


class StatsLog:
    """Logs `stats_line` every `interval_s` (module doc).

    stats: what is logged about (the engine core's `stats`); clock: seconds, monotonic.
    """

    def __init__(self, stats: Callable[[], dict[str, Any]], clock: Callable[[], float],
                 interval_s: float = LOG_INTERVAL_S):
        self.stats = stats
        self.clock = clock
        self.interval_s = interval_s
        self._t = clock()
        self._prev = stats()

    def tick(self) -> str | None:
        """Log the line when the interval is over (and return it); None otherwise."""
        now = self.clock()
        if now - self._t < self.interval_s:
            return None
        cur = self.stats()
        text = stats_line(self._prev, cur, now - self._t)
        self._t, self._prev = now, cur
        if text is not None:
            log.info("%s", text)
        return text
