"""What a step costs: step durations against the tokens in the step, learnt online.

The speculation policy (services/engine/spec_policy.py, docs/ARCHITECTURE.md §5.5) weighs
the tokens a verify step gains against what it costs, and that cost differs by orders of
magnitude between devices: on the CPU a step's time grows with nearly every token, on a GPU
a decode of a few sequences costs about the same at 1 or 8 tokens each. So nothing is
assumed: the engine measures each step's duration (`EngineCore.finish_step`) and feeds it
here with the step's token count.

Three curves are kept, because the kinds of step differ by more than their tokens:
- "plain" steps (no seq verifies or proposes drafts) of decodes only: with async scheduling
  their measured duration is the pipeline's cycle (the engine's own work overlaps the
  device's);
- "mixed" plain steps, with a prefill chunk: on a GPU they run eagerly where a decode-only
  step replays a CUDA graph (H200, Qwen3-0.6B: ~15 ms against 3.2 ms at 256 seqs,
  benchmarks/results/2026-12-03_h200_spec_serve_engine_ngram.json), so one curve of both
  put a 256-decode step at 9-12 ms as soon as a few prefill tokens were expected, and
  speculation and probes looked cheap at 256 seqs;
- "spec" steps (a seq verifies or proposes): the device's time for the step, proposer
  included (verify steps may run eagerly where a plain decode replays a CUDA graph).
Each curve is a set of buckets over the token count (exact up to 16 tokens, then 25% wide).
A bucket's point is, over its first WARM (3) samples, their smallest duration and from then
on exponential moving averages of the token counts and durations that fell in it (a sample
far from its bucket's mean is clipped to half or twice it). Stalls (a Triton compile or a
graph capture, 0.1-0.5 s among 2-20 ms steps on the H200; a page fault; the host
descheduled) are kept out three ways: a step in which the worker compiled or captured
never gets here (`EngineCore.finish_step` skips a result with `jit_compiles`); a sample
more than SPIKE (4) times the curve's current estimate at its tokens is dropped (`dropped`
counts them), so a stall on the first step of a new size does not become that size's point;
and a stall on a curve's very first step is forgotten at the next sample of its bucket (the
minimum). The SPIKE_RUN-th (3rd) spike in a row in one bucket is taken and restarts its bucket: the cost
really changed (longer contexts, a new load). A median of the last samples was tried in
place of the moving averages: it followed the simulated loads of tests/unit/test_spec_policy.py
more slowly (fewer k = 4 steps at full acceptance). An estimate interpolates linearly between
bucket points, made non-decreasing in tokens (a running maximum), and extrapolates past the
ends with the slope of the nearest segment; with one bucket only, in proportion to the
tokens (the pessimistic guess: speculation then waits for a second measured size rather
than assuming drafts are free), except that a spec curve of one bucket follows the plain
curve's growth from it where that has two (`spec_cost`). Units: seconds, tokens.

The in-process executor (services/engine/executor.py) runs a plan when it is submitted, so
under async scheduling the result taken up next carries the following step's time: time
in-process engines synchronously (benchmarks/common.py `run_core` does); the ring executor
times either way.
"""

from __future__ import annotations

import bisect
import math

SMALL = 16        # token counts up to this have a bucket each
GROWTH = 1.25     # past SMALL, a bucket spans 25% more tokens than the last
ALPHA = 0.2       # weight of a new sample in its bucket's moving averages
WARM = 3          # a bucket's first samples: its point is their minimum; after, clipped EMAs
SPIKE = 4.0       # a sample over SPIKE x the curve's estimate is dropped ..
SPIKE_RUN = 3     # .. unless it is its bucket's SPIKE_RUN-th in a row (the bucket starts over)


def bucket_of(tokens: int) -> int:
    """The bucket index of a step with `tokens` tokens (>= 1)."""
    if tokens <= SMALL:
        return tokens
    return SMALL + 1 + int(math.log(tokens / SMALL) / math.log(GROWTH))


class CostCurve:
    """Duration (seconds) against tokens for one kind of step (module doc).

    tokens, seconds: bucket -> its point (moving averages; module doc); count: bucket ->
    samples taken; dropped: samples dropped as spikes."""

    __slots__ = ("tokens", "seconds", "count", "dropped", "_run", "_xs", "_ys")

    def __init__(self) -> None:
        self.tokens: dict[int, float] = {}   # bucket -> moving average of token counts
        self.seconds: dict[int, float] = {}  # bucket -> moving average of durations
        self.count: dict[int, int] = {}
        self.dropped = 0
        self._run: dict[int, int] = {}       # bucket -> spikes in a row in it
        self._xs: list[float] | None = None  # the interpolation points, built lazily
        self._ys: list[float] = []

    def __bool__(self) -> bool:
        return bool(self.seconds)

    def observe(self, tokens: int, seconds: float) -> None:
        """One step of `tokens` tokens took `seconds` (a spike may be dropped: module doc)."""
        if tokens <= 0 or not seconds >= 0.0:
            return
        b = bucket_of(tokens)
        est = self.estimate(tokens)
        n = self.count.get(b, 0)
        if est is not None and est > 0.0 and seconds > SPIKE * est:
            self._run[b] = self._run.get(b, 0) + 1
            if self._run[b] < SPIKE_RUN:
                self.dropped += 1
                return
            n = 0  # the cost changed: the bucket starts over from this sample
        self._run[b] = 0
        if n == 0:
            self.tokens[b], self.seconds[b] = float(tokens), seconds
        else:
            mean = self.seconds[b]
            self.tokens[b] += ALPHA * (tokens - self.tokens[b])
            if n < WARM:  # the smallest so far: one stall among the first samples is forgotten
                self.seconds[b] = min(mean, seconds)
            else:
                seconds = min(max(seconds, 0.5 * mean), 2.0 * mean)
                self.seconds[b] = mean + ALPHA * (seconds - mean)
        self.count[b] = n + 1
        self._xs = None

    def _points(self) -> tuple[list[float], list[float]]:
        if self._xs is None:
            pts = sorted((self.tokens[b], self.seconds[b]) for b in self.seconds)
            xs, ys, top = [], [], 0.0
            for x, y in pts:
                top = max(top, y)
                xs.append(x)
                ys.append(top)
            self._xs, self._ys = xs, ys
        return self._xs, self._ys

    def estimate(self, tokens: float) -> float | None:
        """The expected duration of a step of `tokens` tokens, seconds; None before any
        sample."""
        if not self.seconds:
            return None
        xs, ys = self._points()
        if len(xs) == 1:
            return ys[0] * tokens / xs[0]
        i = bisect.bisect_left(xs, tokens)
        i = min(max(i, 1), len(xs) - 1)  # the segment [i-1, i]; past the ends, the nearest
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
        return max(0.0, y0 + slope * (tokens - x0))

    def points(self) -> list[list[float]]:
        """[[mean tokens, mean seconds], ...] by tokens (for stats)."""
        return [[round(self.tokens[b], 2), self.seconds[b]] for b in sorted(self.seconds)]


class StepCostModel:
    """The plain, mixed and spec curves (module doc) and the engine's own time per step.

    overhead: moving average of the engine's work between a result and the next plan
    (apply the result, send the outputs, plan), seconds; a step that verifies or proposes
    waits for it (it cannot be planned ahead), a plain step under async scheduling hides it.
    """

    def __init__(self) -> None:
        self.plain = CostCurve()
        self.mixed = CostCurve()
        self.spec = CostCurve()
        self.overhead = 0.0
        self._overhead_n = 0

    def observe(self, tokens: int, seconds: float, spec: bool, mixed: bool = False) -> None:
        """A step of `tokens` tokens took `seconds`; spec: it verified or proposed drafts;
        mixed: it ran a prefill chunk (a plain one goes to the mixed curve)."""
        (self.spec if spec else self.mixed if mixed else self.plain).observe(tokens, seconds)

    def observe_overhead(self, seconds: float) -> None:
        """The engine spent `seconds` between a step's result and the next plan."""
        if not seconds >= 0.0:
            return
        self._overhead_n += 1
        if self._overhead_n > WARM and self.overhead > 0:  # one slow turn does not swing it
            seconds = min(seconds, 2.0 * self.overhead)
        a = max(ALPHA / 2, 1.0 / self._overhead_n)
        self.overhead += a * (seconds - self.overhead)

    def plain_cost(self, tokens: float, mixed: bool = False) -> float | None:
        """Expected duration of a plain step, decodes only or (mixed) with a prefill chunk;
        None when nothing was measured. Stand-ins while its curve is empty: for a mixed
        step the decode-only curve (cheaper: speculation looks dearer), for a decode-only
        step the mixed curve, then the spec curve."""
        if mixed and self.mixed:
            return self.mixed.estimate(tokens)
        t = self.plain.estimate(tokens)
        if t is None:
            t = self.mixed.estimate(tokens)
        return self.spec.estimate(tokens) if t is None else t

    def spec_cost(self, tokens: float) -> float | None:
        """Expected device time of a spec step (the plain curve stands in before any spec
        sample); None when nothing was measured. While the spec curve has one measured size
        x0 and the plain curve two or more, the estimate is spec(x0) + the plain curve's
        growth from x0 to `tokens` (a verify's tokens cost what any step's tokens cost, its
        extra is the offset); with one plain size below x0, the slope from that point to
        spec(x0) (which counts the extra as growth: pessimistic) above x0 and spec(x0) below
        it: n-gram drafts verify with no proposal step of another size
        (docs/ARCHITECTURE.md §5.5), so a first probe's k = 1 would otherwise be
        extrapolated in proportion and k would never grow past it."""
        t = self.spec.estimate(tokens)
        if t is None:
            return self.plain_cost(tokens)
        if len(self.spec.seconds) == 1 and self.plain.seconds:
            (x0,), (y0,) = self.spec._points()
            if len(self.plain.seconds) >= 2:
                p_t, p_0 = self.plain.estimate(tokens), self.plain.estimate(x0)
                assert p_t is not None and p_0 is not None
                return max(0.0, y0 + p_t - p_0)
            (xp,), (yp,) = self.plain._points()
            if xp < x0:  # the slope from the plain point, which holds the spec step's extra too
                # (above x0 only: below it, that steep slope fell to 0 s within a few tokens
                # and made every draft look free; a smaller spec step is taken at spec(x0))
                return y0 + max(0.0, (y0 - yp) / (x0 - xp)) * max(0.0, tokens - x0)
        return t

    def stats(self) -> dict:
        """The curves' points, their dropped spikes ([plain and mixed, spec]) and the
        overhead (for the engine's stats)."""
        return {"cost_plain": self.plain.points(), "cost_plain_mixed": self.mixed.points(),
                "cost_spec": self.spec.points(),
                "cost_dropped": [self.plain.dropped + self.mixed.dropped, self.spec.dropped],
                "engine_overhead_s": self.overhead}
