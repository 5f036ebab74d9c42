"""The step cost curves stay true under single stalls (services/engine/step_cost.py,
docs/ARCHITECTURE.md §5.5): injected outliers against the linear cost that generated the
samples and against the same curve fed without them."""

from __future__ import annotations

import random

import pytest

from services.engine.step_cost import SPIKE_RUN, CostCurve, StepCostModel


def cost(n: int) -> float:
    """The generating cost: 2 ms + 50 us a token (a GPU-like step)."""
    return 0.002 + 0.00005 * n


SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def feed(curve: CostCurve, stalls: dict[int, int] | None = None, rounds: int = 12) -> None:
    """Each size `rounds` times in turn; stalls: size -> the round whose sample is a 0.5 s compile."""
    for r in range(rounds):
        for n in SIZES:
            curve.observe(n, 0.5 if (stalls or {}).get(n) == r else cost(n))


@pytest.mark.parametrize("when", [0, 1, 5])
def test_one_compile_per_size_leaves_the_curve_as_without_it(when):
    clean, stalled = CostCurve(), CostCurve()
    feed(clean)
    feed(stalled, {n: when for n in SIZES})
    for n in (1, 3, 8, 20, 100, 256):
        assert stalled.estimate(n) == pytest.approx(clean.estimate(n), rel=1e-9)
        assert stalled.estimate(n) == pytest.approx(cost(n), rel=0.05)
    # stalls in the first round are taken (the first one makes every estimate look slow)
    # and forgotten at each bucket's next sample (the minimum); later ones are dropped
    assert stalled.dropped == (0 if when == 0 else len(SIZES))


def test_a_compile_on_the_first_step_of_a_new_size_is_dropped():
    c = CostCurve()
    for _ in range(5):
        for n in (1, 8, 64):
            c.observe(n, cost(n))
    before = c.estimate(32)
    c.observe(32, 0.5)  # a size first met while serving, with a compile
    assert c.dropped == 1
    assert c.estimate(32) == pytest.approx(before)
    c.observe(32, cost(32))
    assert c.estimate(32) == pytest.approx(cost(32), rel=0.05)


def test_random_stalls_among_many_steps_do_not_move_the_estimates():
    rng = random.Random(7)
    c = CostCurve()
    for _ in range(400):
        n = rng.choice(SIZES)
        c.observe(n, rng.uniform(0.2, 5.0) if rng.random() < 0.03 else cost(n))
    for n in SIZES:
        assert c.estimate(n) == pytest.approx(cost(n), rel=0.05)
    assert c.dropped > 0


def test_a_real_change_of_cost_is_taken_after_a_run_of_spikes():
    c = CostCurve()
    for _ in range(10):
        c.observe(8, cost(8))
    slow = 10 * cost(8)  # e.g. contexts grew tenfold
    for _ in range(SPIKE_RUN):
        c.observe(8, slow)
    assert c.dropped == SPIKE_RUN - 1
    for _ in range(5):
        c.observe(8, slow)
    assert c.estimate(8) == pytest.approx(slow, rel=0.05)


def test_the_model_reports_dropped_spikes_per_curve():
    m = StepCostModel()
    for _ in range(5):
        for n in (4, 16):
            m.observe(n, cost(n), spec=False)
            m.observe(n, cost(n) * 1.5, spec=True)
    m.observe(16, 0.5, spec=True)
    assert m.stats()["cost_dropped"] == [0, 1]
    assert m.spec_cost(16) == pytest.approx(cost(16) * 1.5, rel=0.05)
