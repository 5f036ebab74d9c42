"""The worker's default thread count comes from the CPUs available to the process (affinity,
cgroup v2 quota), one left for the engine and frontend on the CPU, at most 4 with a GPU
(shared/cpu_budget.py); the config builder stores it as `derived` and the startup report
says where it came from. Fake affinity sets and cpu.max texts stand in for the host."""

from __future__ import annotations

import os

import pytest

from shared.config import build_config
from shared.cpu_budget import (CPU_MAX_THREADS, available_cpus, cgroup_quota_cpus,
                               read_cpu_max_texts, resolve_num_threads)
from shared.startup_report import format_startup_report


def _affinity(n):
    return lambda: set(range(n))


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 1), (3, 2), (16, 15), (64, CPU_MAX_THREADS)])
def test_the_cpu_default_leaves_one_available_cpu_for_the_engine_and_frontend(cpus, threads):
    choice = resolve_num_threads(0, "cpu", affinity=_affinity(cpus), cpu_max_texts=[])
    assert choice.threads == threads
    assert f"{cpus} CPUs available (affinity {cpus}, no cgroup quota)" in choice.reason


def test_the_default_counts_the_affinity_set_not_the_machine():
    # a 2-of-many cpuset (taskset -c 4,5): the machine's core count does not matter
    choice = resolve_num_threads(None, "cpu", affinity=lambda: {4, 5}, cpu_max_texts=[])
    assert choice.threads == 1


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 1), (4, 3), (16, 4)])
def test_a_gpu_worker_takes_at_most_four_threads(cpus, threads):
    assert resolve_num_threads(0, "cuda", affinity=_affinity(cpus), cpu_max_texts=[]).threads == threads


def test_a_cgroup_quota_below_the_affinity_set_wins():
    # docker --cpus 1.5 on a 16-CPU host: 2 CPUs (rounded up), 1 thread
    choice = resolve_num_threads(0, "cpu", affinity=_affinity(16),
                                 cpu_max_texts=["max 100000\n", "150000 100000\n"])
    assert choice.threads == 1 and "cgroup quota 1.5" in choice.reason
    assert cgroup_quota_cpus(["max 100000", "garbage", "400000 100000", "200000 100000"]) == 2.0
    assert cgroup_quota_cpus(["max 100000"]) is None
    assert available_cpus(_affinity(8), ["50000 100000"]) == (1, "affinity 8, cgroup quota 0.5")


def test_an_explicit_setting_is_taken_as_it_is():
    choice = resolve_num_threads(3, "cpu", affinity=_affinity(2), cpu_max_texts=[])
    assert choice.threads == 3 and choice.reason == "set explicitly"
    with pytest.raises(ValueError, match="num_threads"):
        resolve_num_threads(-1, "cpu", affinity=_affinity(2), cpu_max_texts=[])


def test_cpu_max_is_read_from_the_process_cgroup_and_its_ancestors(tmp_path):
    root = tmp_path / "cgroup"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "cpu.max").write_text("max 100000\n")
    (root / "a" / "cpu.max").write_text("300000 100000\n")
    proc = tmp_path / "self-cgroup"
    proc.write_text("0::/a/b\n")
    assert read_cpu_max_texts(str(root), str(proc)) == ["max 100000\n", "300000 100000\n"]
    proc.write_text("4:cpu:/a\n")  # cgroup v1 only: no quota read
    assert read_cpu_max_texts(str(root), str(proc)) == []


def test_the_config_derives_num_threads_from_this_process_affinity():
    cfg = build_config({"device": "cpu"}, env={})
    cpus = len(os.sched_getaffinity(0))
    assert cfg.source("num_threads") == "derived"
    assert 1 <= cfg.num_threads <= max(1, cpus - 1)
    assert "CPUs available" in cfg.threads_detail
    assert build_config({"device": "cpu", "num_threads": 0}, env={}).source("num_threads") == "derived"
    given = build_config({"device": "cpu", "num_threads": 3}, env={})
    assert (given.num_threads, given.source("num_threads"), given.threads_detail) == (3, "cli", "")
    with pytest.raises(ValueError, match="num_threads"):
        build_config({"device": "cpu", "num_threads": -2}, env={})


def test_the_startup_report_shows_the_thread_count_and_its_source():
    report = {"workers": [{"rank": 0, "device": "cpu", "dtype": "float32", "threads": 1}],
              "threads_source": "derived: 2 CPUs available (affinity 2, no cgroup quota), "
                                "1 left for the engine and frontend"}
    line = format_startup_report(report)[0]
    assert "1 threads (num_threads derived: 2 CPUs available (affinity 2" in line
