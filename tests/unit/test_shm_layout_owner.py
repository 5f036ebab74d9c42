"""The shm segments' owner check (shared/shm_layout.owner_alive, docs/ARCHITECTURE.md §3)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from shared.shm_layout import REUSE_MARGIN_S, _pidns, owner_alive


def test_a_live_writer_is_alive_even_when_the_clocks_disagree_by_seconds():
    """A segment created a few seconds before its writer's start as psutil computes it
    (clock steps, whole-second boot time) is still owned by a live process."""
    import psutil

    started = psutil.Process(os.getpid()).create_time()
    # the segment's time 5 s before the process's start as this process computes it: the
    # writer's clock stepped back, or psutil's boot time rounded (a 1 s margin said dead)
    assert owner_alive(os.getpid(), _pidns(), started - 5.0) is True


def test_a_pid_started_well_after_the_segment_is_a_reused_pid():
    import psutil

    started = psutil.Process(os.getpid()).create_time()
    assert owner_alive(os.getpid(), _pidns(), started - REUSE_MARGIN_S - 5.0) is False


def test_a_dead_pid_is_not_alive():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert owner_alive(p.pid, _pidns(), time.time()) is False
