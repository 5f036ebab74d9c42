"""The worker's torch thread count when `--num-threads` is not given: from the CPUs that
this process may actually run on, not the machine's core count.

Available CPUs: the affinity set (`os.sched_getaffinity(0)`: taskset, cpusets, a
container's `--cpuset-cpus`), lowered by a cgroup v2 CPU quota (`cpu.max`: `<quota>
<period>` in microseconds, or `max` for none; the smallest over this process's cgroup and
its ancestors; `--cpus` in Docker), rounded up to whole CPUs.

Default threads (docs/ARCHITECTURE.md §8.3):
- CPU: `available - 1` (at least 1, at most CPU_MAX_THREADS): one CPU is left for the
  engine and the frontend, which run beside the worker. An OpenMP pool wider than the free
  CPUs spins against them (a 2-core host with one other busy process: two 32-token streams
  took 52 s with 2 threads; 1 thread gave about 24 tok/s). Measured again with SmolLM2 int4
  over HTTP (benchmarks/cpu_decode_profile.py --levels --concurrent, the 2-core VM): 2 threads
  win on an otherwise quiet host (batch 1 110 vs 97 tok/s, 8 streams 390 vs 302) and collapse
  beside one spinning process (34 vs 93, 103 vs 288), so 1 stays the default.
- GPU: at most GPU_MAX_THREADS: the host side of a GPU step is small tensor work (H200
  host, 16 cores, serve_bench at 256 streams: 8,305 -> 9,445 output tok/s with 2 threads
  instead of all).

`resolve_num_threads` is the one place this is decided; the config builder calls it for a
`num_threads` of 0 or unset and stores the value with source `derived`, and the reason
(`ThreadChoice.reason`) goes into the startup report.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

CPU_MAX_THREADS = 32  # beyond this the CPU decode of the models served here gains nothing
GPU_MAX_THREADS = 4
CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class ThreadChoice:
    """threads: the torch intra-op threads of the worker. reason: how they were chosen,
    for the startup report (e.g. "2 CPUs available (affinity 2, no cgroup quota), 1 left
    for the engine and frontend")."""

    threads: int
    reason: str


def cgroup_quota_cpus(cpu_max_texts: Iterable[str]) -> float | None:
    """The tightest CPU limit, in CPUs, of cgroup v2 `cpu.max` contents (`"max 100000"`:
    none; `"150000 100000"`: 1.5). None when there is no limit. Malformed texts are skipped."""
    best: float | None = None
    for text in cpu_max_texts:
        parts = text.split()
        if len(parts) != 2 or parts[0] == "max":
            continue
        try:
            quota, period = int(parts[0]), int(parts[1])
        except ValueError:
            continue
        if quota > 0 and period > 0:
            cpus = quota / period
            best = cpus if best is None else min(best, cpus)
    return best


def read_cpu_max_texts(root: str = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> list[str]:
    """The `cpu.max` files of this process's cgroup v2 and its ancestors up to `root` (one
    read each; the root cgroup has none). [] on cgroup v1 or when nothing is readable."""
    try:
        with open(proc_cgroup) as fh:
            rel = next((line.split("::", 1)[1].strip() for line in fh if line.startswith("0::")), None)
    except OSError:
        return []
    if rel is None:
        return []
    texts = []
    parts = [p for p in rel.split("/") if p and p != ".."]
    for depth in range(len(parts), -1, -1):
        path = os.path.join(root, *parts[:depth], "cpu.max")
        try:
            with open(path) as fh:
                texts.append(fh.read())
        except OSError:
            continue
    return texts


def available_cpus(affinity: Callable[[], set[int]] | None = None,
                   cpu_max_texts: Iterable[str] | None = None) -> tuple[int, str]:
    """(CPUs this process may use, how that was found). affinity: returns the CPU set
    (default os.sched_getaffinity(0); os.cpu_count() where it is missing). cpu_max_texts:
    cgroup `cpu.max` contents (default: read from this process's cgroups)."""
    try:
        cpus = len((affinity or (lambda: os.sched_getaffinity(0)))())
        how = f"affinity {cpus}"
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
        how = f"cpu_count {cpus}"
    quota = cgroup_quota_cpus(read_cpu_max_texts() if cpu_max_texts is None else cpu_max_texts)
    if quota is None:
        how += ", no cgroup quota"
    else:
        how += f", cgroup quota {quota:g}"
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(cpus, 1), how


def resolve_num_threads(setting: int | None, device: str,
                        affinity: Callable[[], set[int]] | None = None,
                        cpu_max_texts: Iterable[str] | None = None) -> ThreadChoice:
    """The worker's torch threads. setting: `num_threads` as given (a positive value is
    taken as it is; 0 or None: the default of the module docstring). device: "cpu" or
    "cuda". affinity, cpu_max_texts: as in `available_cpus` (tests pass fakes).
    Raises ValueError for a negative setting."""
    if setting is not None and setting < 0:
        raise ValueError(f"setting num_threads: must be >= 0 (0: automatic), got {setting}")
    if setting:
        return ThreadChoice(setting, "set explicitly")
    cpus, how = available_cpus(affinity, cpu_max_texts)
    if device == "cpu":
        n = min(max(1, cpus - 1), CPU_MAX_THREADS)
        spare = "1 left for the engine and frontend" if cpus > 1 else "none to spare"
        return ThreadChoice(n, f"{cpus} CPUs available ({how}), {spare}"
                            + (f", capped at {CPU_MAX_THREADS}" if cpus - 1 > CPU_MAX_THREADS else ""))
    n = min(GPU_MAX_THREADS, max(1, cpus - 1))
    return ThreadChoice(n, f"{cpus} CPUs available ({how}), at most {GPU_MAX_THREADS} with a GPU")
