"""Pure helpers of the speculative-decoding benchmarks (benchmarks/spec_decode.py,
spec_serve.py, spec_verify_cost.py): the spec_decode counters from a server's /metrics text
or its engine stats, acceptance length, the per-set speed summary of batch-1 requests, the
comparison of outputs with and without speculation, and the plain-against-spec rows and
verdict of concurrent serving (spec_serve.py).

Definitions (docs/ARCHITECTURE.md §5.5, vLLM's names):
- drafts (`spec_decode_num_drafts`): verify seqs that carried at least one draft token;
  draft tokens (`..._num_draft_tokens`): drafts verified; accepted (`..._num_accepted_tokens`):
  drafts accepted.
- mean acceptance length L = 1 + accepted / drafts: tokens emitted per verify step (the
  accepted drafts plus the recovered or bonus token).
- per-draft acceptance rate = accepted / draft tokens.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
PER_POS = "spec_decode_num_accepted_tokens_per_pos"

# one sample line of the Prometheus text format: name{labels} value [timestamp]
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _base_name(name: str) -> str:
    """A sample's metric name without the `kestrel:` prefix and the counter's `_total`."""
    if name.startswith("kestrel:"):
        name = name[len("kestrel:"):]
    return name[:-len("_total")] if name.endswith("_total") else name


def parse_spec_metrics(text: str) -> dict | None:
    """The spec_decode counters of a Prometheus text exposition (a server's /metrics):
    {num_drafts, num_draft_tokens, num_accepted_tokens: float, per_pos: list[float]}, each
    summed over its labels (model_name) and read with or without the `kestrel:` prefix and
    the `_total` suffix; per_pos from the samples of `spec_decode_num_accepted_tokens_per_pos`
    by their `position` label (0-based; [] when absent). None when the text has no
    `spec_decode_num_drafts` sample (the server exports no spec metrics)."""
    found: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name = _base_name(m.group(1))
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if name in COUNTERS:
            found[name] = found.get(name, 0.0) + value
        elif name == PER_POS:
            labels = dict(_LABEL.findall(m.group(2) or ""))
            if "position" in labels:
                pos = int(labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + value
    if COUNTERS[0] not in found:
        return None
    return {"num_drafts": found.get(COUNTERS[0], 0.0), "num_draft_tokens": found.get(COUNTERS[1], 0.0),
            "num_accepted_tokens": found.get(COUNTERS[2], 0.0),
            "per_pos": [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)] if per_pos else []}


def spec_counters_from_stats(stats: dict) -> dict | None:
    """The same counters from the engine's stats utility (GET /internal/stats, keys
    `spec_decode_num_drafts` ... as `SpecPolicy.stats` names them); None without them."""
    if COUNTERS[0] not in stats:
        return None
    return {"num_drafts": float(stats[COUNTERS[0]]), "num_draft_tokens": float(stats.get(COUNTERS[1], 0)),
            "num_accepted_tokens": float(stats.get(COUNTERS[2], 0)),
            "per_pos": [float(v) for v in stats.get(PER_POS, [])]}


def counters_delta(after: dict, before: dict) -> dict:
    """after - before of two counter snapshots (per_pos position by position, the shorter
    one padded with zeros)."""
    n = max(len(after["per_pos"]), len(before["per_pos"]))
    pa = after["per_pos"] + [0.0] * (n - len(after["per_pos"]))
    pb = before["per_pos"] + [0.0] * (n - len(before["per_pos"]))
    return {**{k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
            "per_pos": [a - b for a, b in zip(pa, pb)]}


def counters_sum(parts: list[dict]) -> dict:
    """The sum of counter deltas, per_pos position by position (an empty list: all zero)."""
    n = max((len(p["per_pos"]) for p in parts), default=0)
    return {**{k: sum(p[k] for p in parts) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
            "per_pos": [sum(p["per_pos"][i] for p in parts if i < len(p["per_pos"])) for i in range(n)]}


def acceptance_length(num_drafts: float, num_accepted: float) -> float | None:
    """Mean acceptance length 1 + accepted / drafts; None when nothing was drafted."""
    return 1.0 + num_accepted / num_drafts if num_drafts > 0 else None


def acceptance_summary(c: dict) -> dict:
    """A counter delta with its mean acceptance length and per-draft acceptance rate."""
    rate = c["num_accepted_tokens"] / c["num_draft_tokens"] if c["num_draft_tokens"] > 0 else None
    length = acceptance_length(c["num_drafts"], c["num_accepted_tokens"])
    return {**{k: int(v) for k, v in c.items() if k != "per_pos"}, "per_pos": [int(v) for v in c["per_pos"]],
            "mean_acceptance_length": round(length, 3) if length is not None else None,
            "draft_acceptance_rate": round(rate, 3) if rate is not None else None}


@dataclass
class Timed:
    """One batch-1 request as the client saw it (seconds of one monotonic clock): sent,
    first content chunk, end of the stream; tokens: usage.completion_tokens; text: the
    output; finish_reason."""

    sent: float
    first: float
    end: float
    tokens: int
    text: str = ""
    finish_reason: str | None = None


def speed(records: list[Timed]) -> dict:
    """Speed of requests run one at a time: tokens, seconds (sum of send -> end),
    output_tok_per_s = tokens / seconds (prefill included), decode_tok_per_s = (tokens -
    1) / (end - first chunk) summed over requests of 2+ tokens (prefill excluded), and the
    mean TTFT in ms. Raises ValueError for no records."""
    if not records:
        raise ValueError("no requests")
    tokens = sum(r.tokens for r in records)
    seconds = sum(r.end - r.sent for r in records)
    dec = [r for r in records if r.tokens >= 2]
    dec_s = sum(r.end - r.first for r in dec)
    return {"requests": len(records), "tokens": tokens, "seconds": round(seconds, 3),
            "output_tok_per_s": round(tokens / seconds, 2) if seconds > 0 else None,
            "decode_tok_per_s": round(sum(r.tokens - 1 for r in dec) / dec_s, 2) if dec_s > 0 else None,
            "ttft_ms_mean": round(1e3 * statistics.fmean(r.first - r.sent for r in records), 1)}


def ratio(on: float | None, off: float | None) -> float | None:
    """on / off rounded to 3 places; None when either is missing or off is 0."""
    return round(on / off, 3) if on is not None and off else None


def pair_ratios(off: list[Timed], on: list[Timed]) -> dict:
    """Per pair (the same prompt and repeat, off then on or on then off) the speedup
    duration_off / duration_on: its median, min and max (None for no pairs)."""
    rs = [(a.end - a.sent) / (b.end - b.sent) for a, b in zip(off, on) if b.end > b.sent]
    if not rs:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(rs), 3), "min": round(min(rs), 3), "max": round(max(rs), 3)}


def first_mismatch(a: str, b: str) -> int | None:
    """Index of the first character where a and b differ (len of the shorter one when one
    is a prefix of the other); None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# Concurrent serving, plain against speculative (benchmarks/spec_serve.py): one level and
# prompt kind ran `repeats` times on each server; each run summarised by
# benchmarks/serve_stats.py `summarize`.

def _median(values: list, digits: int = 3) -> float | None:
    """The median of the values that are not None, rounded to `digits` places; None when
    there are none."""
    vs = [v for v in values if v is not None]
    return round(statistics.median(vs), digits) if vs else None


def side_summary(runs: list[dict]) -> dict:
    """The repeats of one side (serve_stats `summarize` results): requests and errors
    (summed), up to 3 error examples, and the median over repeats of output tok/s, of the
    TTFT p50 and of the TPOT p50 (ms); output tok/s of every repeat in run order."""
    errors = [e for r in runs for e in r["error_examples"]]
    return {"requests": sum(r["requests"] for r in runs), "errors": sum(r["errors"] for r in runs),
            "error_examples": list(dict.fromkeys(errors))[:3],
            "output_tok_per_s": _median([r["output_tok_per_s"] for r in runs], 1),
            "ttft_p50_ms": _median([r["ttft_ms"]["p50"] for r in runs]),
            "tpot_p50_ms": _median([r["tpot_ms"]["p50"] for r in runs]),
            "output_tok_per_s_all": [r["output_tok_per_s"] for r in runs]}


def stats_delta(after: dict, before: dict, keys: tuple[str, ...]) -> dict:
    """after - before of the engine stats `keys` present in after: numbers subtracted, lists
    position by position (the shorter padded with zeros)."""
    out: dict = {}
    for k in keys:
        if k not in after:
            continue
        a, b = after[k], before.get(k, 0 if not isinstance(after[k], list) else [])
        if isinstance(a, list):
            n = max(len(a), len(b))
            out[k] = [(a[i] if i < len(a) else 0) - (b[i] if i < len(b) else 0) for i in range(n)]
        else:
            out[k] = a - b
    return out


def stats_sum(deltas: list[dict]) -> dict:
    """The sum of `stats_delta` results (lists position by position), with tokens_per_step
    = num_generated_tokens / num_steps where both are present and steps > 0."""
    out: dict = {}
    for d in deltas:
        for k, v in d.items():
            if isinstance(v, list):
                acc = out.get(k, [])
                n = max(len(acc), len(v))
                out[k] = [(acc[i] if i < len(acc) else 0) + (v[i] if i < len(v) else 0) for i in range(n)]
            else:
                out[k] = out.get(k, 0) + v
    if out.get("num_steps") and "num_generated_tokens" in out:
        out["tokens_per_step"] = round(out["num_generated_tokens"] / out["num_steps"], 2)
    return out


def serve_row(plain: list[dict], spec: list[dict], counters: list[dict], threshold: float) -> dict:
    """One level and prompt kind: plain and spec `side_summary`, the ratio spec / plain of
    output tok/s (the median of the per-repeat ratios: each repeat ran the two sides back to
    back, so that slow drift of a shared machine cancels within a pair), the per-repeat
    ratios, the ratio of the two medians, meets (ratio >= threshold; False without a ratio)
    and the acceptance of the spec runs' counter deltas (`acceptance_summary`; None without
    counters). plain[i] and spec[i] are the i-th repeat of each side."""
    pairs = [ratio(s["output_tok_per_s"], p["output_tok_per_s"]) for p, s in zip(plain, spec)]
    r = _median(pairs)
    sp, ss = side_summary(plain), side_summary(spec)
    return {"plain": sp, "spec": ss, "ratio": r,
            "pair_ratios": pairs, "ratio_of_medians": ratio(ss["output_tok_per_s"], sp["output_tok_per_s"]),
            "threshold": threshold, f"meets_{threshold}": r is not None and r >= threshold,
            "acceptance": acceptance_summary(counters_sum(counters)) if counters else None}


def verdict(rows: dict, levels: list[int], threshold: float) -> dict:
    """Whether every row (rows[level][kind] from `serve_row`) of the given levels meets the
    threshold: {levels: those checked that ran, meets: True / False (None when no level
    ran), failing: ["<level>/<kind>", ...]}."""
    checked = [c for c in levels if c in rows]
    failing = [f"{c}/{k}" for c in checked for k, row in rows[c].items() if not row[f"meets_{threshold}"]]
    return {"levels": checked, "threshold": threshold, "meets": not failing if checked else None,
            "failing": failing}
