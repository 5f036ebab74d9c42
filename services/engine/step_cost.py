"""What a step costs: step durations against the tokens in the step, learnt online.

The speculation policy (services/engine/spec_policy.py, docs/ARCHITECTURE.md §5.5) weighs
the tokens a verify step gains against what it costs, and that cost differs by orders of
magnitude between devices: on the CPU a step's time grows with nearly every token, on a GPU
a decode of a few sequences costs about the same at 1 or 8 tokens each. So nothing is
assumed: the engine measures each step's duration (`EngineCore.finish_step`) and feeds it
here with the step's token count.

Two curves are kept, because the two kinds of step differ by more than their tokens:
- "plain" steps (no seq verifies or proposes drafts): with async scheduling their measured
  duration is the pipeline's cycle (the engine's own work overlaps the device's);
- "spec" steps (a seq verifies or proposes): the device's time for the step, proposer
  included (verify steps may run eagerly where a plain decode replays a CUDA graph).
Each curve is a set of buckets over the token count (exact up to 16 tokens, then 25% wide);
a bucket keeps exponential moving averages of the token counts and durations that fell in
it (a sample far from its bucket's mean is clipped to half or twice it, so one stall does
not swing the estimate). An estimate interpolates linearly between bucket means, made
non-decreasing in tokens (a running maximum), and extrapolates past the ends with the slope
of the nearest segment; with one bucket only, in proportion to the tokens (the pessimistic
guess: speculation then waits for a second measured size rather than assuming drafts are
free). Units: seconds, tokens.
"""

from __future__ import annotations

import bisect
import math

SMALL = 16        # token counts up to this have a bucket each
GROWTH = 1.25     # past SMALL, a bucket spans 25% more tokens than the last
ALPHA = 0.2       # weight of a new sample in its bucket's moving averages
WARM = 3          # samples before a bucket clips outliers


def bucket_of(tokens: int) -> int:
    """The bucket index of a step with `tokens` tokens (>= 1)."""
    if tokens <= SMALL:
        return tokens
    return SMALL + 1 + int(math.log(tokens / SMALL) / math.log(GROWTH))


class CostCurve:
    """Duration (seconds) against tokens for one kind of step (module doc)."""

    __slots__ = ("tokens", "seconds", "count", "_xs", "_ys")

    def __init__(self) -> None:
        self.tokens: dict[int, float] = {}   # bucket -> moving average of token counts
        self.seconds: dict[int, float] = {}  # bucket -> moving average of durations
        self.count: dict[int, int] = {}
        self._xs: list[float] | None = None  # the interpolation points, built lazily
        self._ys: list[float] = []

    def __bool__(self) -> bool:
        return bool(self.seconds)

    def observe(self, tokens: int, seconds: float) -> None:
        """One step of `tokens` tokens took `seconds`."""
        if tokens <= 0 or not seconds >= 0.0:
            return
        b = bucket_of(tokens)
        n = self.count.get(b, 0)
        if n == 0:
            self.tokens[b], self.seconds[b] = float(tokens), seconds
        else:
            mean = self.seconds[b]
            if n >= WARM:
                seconds = min(max(seconds, 0.5 * mean), 2.0 * mean)
            self.tokens[b] += ALPHA * (tokens - self.tokens[b])
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
    """The plain and spec curves (module doc) and the engine's own time per step.

    overhead: moving average of the engine's work between a result and the next plan
    (apply the result, send the outputs, plan), seconds; a step that verifies or proposes
    waits for it (it cannot be planned ahead), a plain step under async scheduling hides it.
    """

    def __init__(self) -> None:
        self.plain = CostCurve()
        self.spec = CostCurve()
        self.overhead = 0.0
        self._overhead_n = 0

    def observe(self, tokens: int, seconds: float, spec: bool) -> None:
        """A step of `tokens` tokens took `seconds`; spec: it verified or proposed drafts."""
        (self.spec if spec else self.plain).observe(tokens, seconds)

    def observe_overhead(self, seconds: float) -> None:
        """The engine spent `seconds` between a step's result and the next plan."""
        if not seconds >= 0.0:
            return
        self._overhead_n += 1
        a = max(ALPHA / 2, 1.0 / self._overhead_n)
        self.overhead += a * (seconds - self.overhead)

    def plain_cost(self, tokens: float) -> float | None:
        """Expected duration of a plain step (the spec curve stands in before any plain
        sample); None when nothing was measured."""
        t = self.plain.estimate(tokens)
        return self.spec.estimate(tokens) if t is None else t

    def spec_cost(self, tokens: float) -> float | None:
        """Expected device time of a spec step (the plain curve stands in before any spec
        sample); None when nothing was measured."""
        t = self.spec.estimate(tokens)
        return self.plain.estimate(tokens) if t is None else t

    def stats(self) -> dict:
        """The curves' points and the overhead (for the engine's stats)."""
        return {"cost_plain": self.plain.points(), "cost_spec": self.spec.points(),
                "engine_overhead_s": self.overhead}
