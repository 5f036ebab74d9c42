"""The soak benchmark's figures and verdict (benchmarks/soak.py), pure Python.

RSS: per process (keyed by its title, `kestrel:engine`, ...), bytes at the baseline (the
server idle right after the warm-up) and at the end (idle again after the last request),
growth % = (end - baseline) / baseline * 100, and the maximum over the samples taken from
the baseline on. Targets (issue 14): every process's growth <= 2 %, no failed request,
blocks in use at the end equal to the baseline, no process restarted (a new pid under a
title), every process of the baseline still there at the end.
"""

from __future__ import annotations

from typing import Any

MIB = 1 << 20


def rss_report(baseline: dict[str, int], end: dict[str, int], samples: list[dict[str, Any]],
               max_growth_pct: float) -> dict[str, dict[str, Any]]:
    """Per process of the baseline: baseline_mib, end_mib (None if it is gone), growth_pct,
    max_mib (over `samples` whose phase is not "warmup", the end included) and ok (growth
    <= max_growth_pct and still there). baseline, end: title -> RSS bytes; samples: dicts
    with "phase" and "rss" (title -> bytes)."""
    out: dict[str, dict[str, Any]] = {}
    for title, base in sorted(baseline.items()):
        fin = end.get(title)
        seen = [s["rss"][title] for s in samples if s["phase"] != "warmup" and title in s["rss"]]
        seen += [base] + ([fin] if fin is not None else [])
        growth = None if fin is None else round(100.0 * (fin - base) / base, 3)
        out[title] = {"baseline_mib": round(base / MIB, 2),
                      "end_mib": None if fin is None else round(fin / MIB, 2),
                      "growth_pct": growth, "max_mib": round(max(seen) / MIB, 2),
                      "ok": growth is not None and growth <= max_growth_pct}
    return out


def verdict(rss: dict[str, dict[str, Any]], counts: dict[str, int],
            blocks: dict[str, Any], restarts: list[dict[str, Any]]) -> dict[str, Any]:
    """Pass/fail of each target and overall. rss: `rss_report`'s result; counts: outcome
    -> requests (a "failed" key, 0 if absent); blocks: {"baseline_in_use", "end_in_use"}
    (None when unread); restarts: one entry per pid change of a process."""
    checks = {
        "rss_growth": bool(rss) and all(p["ok"] for p in rss.values()),
        "no_failures": counts.get("failed", 0) == 0,
        "blocks_back_to_baseline": blocks.get("end_in_use") is not None
        and blocks.get("end_in_use") == blocks.get("baseline_in_use"),
        "no_restarts": not restarts,
    }
    return {**checks, "passed": all(checks.values())}
