"""`IdleGate`: the engine group's spares wait for an idle group (services/supervisor/standby.py)."""

from __future__ import annotations

import os
import time

from services.supervisor.standby import IDLE_CPU, IDLE_WINDOW_S, IdleGate, cpu_seconds


class FakeGroup:
    """A clock and the CPU seconds a group of processes has used, advanced by hand."""

    def __init__(self) -> None:
        self.now = 100.0
        self.used = 5.0
        self.gone = False

    def clock(self) -> float:
        return self.now

    def cpu(self, pids) -> float | None:
        return None if self.gone else self.used

    def run(self, seconds: float, cores: float) -> None:
        self.now += seconds
        self.used += seconds * cores


def test_busy_group_keeps_the_gate_closed_until_the_wait_ends():
    g = FakeGroup()
    gate = IdleGate(30.0, cpu=g.cpu, clock=g.clock)
    since = g.now
    opened_at = None
    while opened_at is None:
        if gate.open([11, 12], since):
            opened_at = g.now - since
        g.run(0.1, 1.0)  # one core busy: a batch-1 decode
    assert 30.0 <= opened_at < 30.0 + 0.2


def test_idle_group_opens_after_one_window():
    g = FakeGroup()
    gate = IdleGate(30.0, cpu=g.cpu, clock=g.clock)
    since = g.now
    steps = 0
    while not gate.open([11, 12], since):
        g.run(0.1, IDLE_CPU / 2)
        steps += 1
    assert IDLE_WINDOW_S <= g.now - since < IDLE_WINDOW_S + 0.2, steps


def test_load_just_over_the_bound_is_busy_and_just_under_is_idle():
    for cores, expect in ((IDLE_CPU * 1.2, False), (IDLE_CPU * 0.8, True)):
        g = FakeGroup()
        gate = IdleGate(30.0, cpu=g.cpu, clock=g.clock)
        assert not gate.open([1], g.now)  # the first call only takes a reading
        g.run(IDLE_WINDOW_S, cores)
        assert gate.open([1], g.now - IDLE_WINDOW_S) is expect, cores


def test_new_pids_or_a_gone_process_start_a_new_reading():
    g = FakeGroup()
    gate = IdleGate(30.0, cpu=g.cpu, clock=g.clock)
    since = g.now
    assert not gate.open([1, 2], since)
    g.run(IDLE_WINDOW_S, 0.0)
    assert not gate.open([1, 3], since)  # a restarted worker: its reading begins now
    g.run(IDLE_WINDOW_S, 0.0)
    assert gate.open([1, 3], since)
    g.gone = True
    g.run(IDLE_WINDOW_S, 0.0)
    assert not gate.open([1, 3], since)


def test_zero_wait_opens_at_once():
    g = FakeGroup()
    assert IdleGate(0.0, cpu=g.cpu, clock=g.clock).open([1], g.now)


def test_cpu_seconds_counts_this_process_and_none_for_a_dead_pid():
    t = os.times()
    mine = cpu_seconds([os.getpid()])
    assert mine is not None and abs(mine - (t.user + t.system)) < 0.5
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert cpu_seconds([os.getpid()]) >= mine + 0.15
    assert cpu_seconds([os.getpid(), 2 ** 22 + 12345]) is None
