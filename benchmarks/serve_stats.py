"""Latency statistics of streamed requests (benchmarks/serve_bench.py), pure Python.

A request's record is what the client saw: when it was sent, when each content chunk (an
SSE event with non-empty text) arrived, and how many output tokens the server counted
(`usage.completion_tokens` of the stream's final usage chunk). Times are seconds of one
monotonic clock (`time.monotonic()`, CLOCK_MONOTONIC on Linux: comparable across the
client processes of one host).

Definitions (as vLLM's benchmark_serving):
- TTFT: request sent -> first content chunk arrived.
- TPOT: (last content chunk - first content chunk) / (output tokens - 1); undefined for a
  request of one output token.
- ITL: the gaps between consecutive content chunks of a request, pooled over requests. A
  chunk may carry several tokens (the server coalesces tokens that arrive while it is
  busy), so an ITL is a gap between chunks, not always between tokens; the token count
  comes from usage, never from counting chunks.
- Output tok/s of a level: output tokens of its successful requests / (last response
  end - first request sent), over all requests of the level.
Percentiles interpolate linearly between closest ranks (numpy's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class RequestRecord:
    """One streamed request as the client saw it. Times in seconds (monotonic clock).

    sent: before the request was written; chunks: arrival of each content chunk; end: after
    the stream ended (or failed); output_tokens: usage.completion_tokens (None if the
    stream had no usage); error: why the request failed, None if it succeeded.
    """

    sent: float
    end: float = 0.0
    chunks: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) of values, interpolating linearly between the
    closest ranks: rank r = q/100 * (n - 1), result = v[floor r] + (r - floor r) *
    (v[floor r + 1] - v[floor r]) of the sorted values. Raises ValueError for no values or
    q outside [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} outside [0, 100]")
    v = sorted(values)
    r = q / 100 * (len(v) - 1)
    lo = math.floor(r)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (r - lo) * (v[hi] - v[lo])


def ttft(rec: RequestRecord) -> float:
    """Seconds from sending the request to its first content chunk. Raises ValueError if
    there was no content chunk."""
    if not rec.chunks:
        raise ValueError("no content chunk")
    return rec.chunks[0] - rec.sent


def tpot(rec: RequestRecord) -> float | None:
    """Seconds per output token after the first: (last chunk - first chunk) /
    (output_tokens - 1); None when output_tokens is below 2 or unknown."""
    if not rec.chunks or rec.output_tokens is None or rec.output_tokens < 2:
        return None
    return (rec.chunks[-1] - rec.chunks[0]) / (rec.output_tokens - 1)


def itl(rec: RequestRecord) -> list[float]:
    """Seconds between consecutive content chunks of one request (len(chunks) - 1 gaps)."""
    return [b - a for a, b in zip(rec.chunks, rec.chunks[1:])]


def _ms(values: list[float]) -> dict:
    """p50, p99 and mean of seconds, in milliseconds (None for no values)."""
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    return {"p50": round(percentile(values, 50) * 1e3, 3),
            "p99": round(percentile(values, 99) * 1e3, 3),
            "mean": round(sum(values) / len(values) * 1e3, 3)}


def summarize(records: Sequence[RequestRecord]) -> dict:
    """One level's results: requests, errors (count and up to 3 distinct messages),
    output_tokens (successful requests), seconds (last end - first sent, all requests),
    output_tok_per_s, and ttft_ms / tpot_ms / itl_ms each {p50, p99, mean} in milliseconds
    over the successful requests (ITL pooled over their gaps)."""
    ok = [r for r in records if r.error is None]
    errors = [r.error for r in records if r.error is not None]
    seconds = (max(r.end for r in records) - min(r.sent for r in records)) if records else 0.0
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    return {
        "requests": len(records), "errors": len(errors),
        "error_examples": list(dict.fromkeys(errors))[:3],
        "output_tokens": out_tokens, "seconds": round(seconds, 3),
        "output_tok_per_s": round(out_tokens / seconds, 1) if seconds > 0 else None,
        "ttft_ms": _ms([ttft(r) for r in ok]),
        "tpot_ms": _ms([t for t in map(tpot, ok) if t is not None]),
        "itl_ms": _ms([g for r in ok for g in itl(r)]),
    }
