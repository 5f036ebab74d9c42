"""What the soak benchmark (benchmarks/soak.py) observes of the server besides its answers:
its processes (RSS, pids, fds, threads through psutil), its /metrics text and its log.

Processes are the supervisor (`kestrel serve`'s own process) and all its descendants, named
by their process titles (`shared.procutil.set_title`: `kestrel:supervisor`,
`kestrel:engine`, `kestrel:worker:0`, `kestrel:frontend:0`, `kestrel:kvstore`); a process
without a `kestrel:` title is named by its executable.
"""

from __future__ import annotations

from typing import Any

import psutil

from benchmarks.soak_report import MIB


class ProcessWatch:
    """The server's processes: the supervisor (root_pid) and its descendants, keyed by
    process title (a second process of one title gets "#2"). Records a restart whenever a
    title's pid changes."""

    def __init__(self, root_pid: int):
        self.root = psutil.Process(root_pid)
        self.pids: dict[str, int] = {}
        self.restarts: list[dict[str, Any]] = []
        self.seen: set[int] = set()

    def processes(self) -> dict[str, psutil.Process]:
        """title -> process, now. Processes that vanish while listed are left out."""
        out: dict[str, psutil.Process] = {}
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return out
        for p in procs:
            try:
                cmd = " ".join(p.cmdline()).strip()
                title = cmd if cmd.startswith("kestrel:") else p.name()
            except psutil.Error:
                continue
            key, i = title, 2
            while key in out:
                key, i = f"{title}#{i}", i + 1
            out[key] = p
        return out

    def sample(self, t: float) -> dict[str, int]:
        """title -> RSS bytes of every process now; notes restarts (t: seconds into the run)."""
        rss: dict[str, int] = {}
        for title, p in self.processes().items():
            try:
                rss[title] = p.memory_info().rss
            except psutil.Error:
                continue
            old = self.pids.get(title)
            if old is not None and old != p.pid:
                self.restarts.append({"process": title, "old_pid": old, "new_pid": p.pid, "t_s": round(t, 1)})
            self.pids[title] = p.pid
            self.seen.add(p.pid)
        return rss

    def details(self) -> dict[str, dict[str, Any]]:
        """title -> pid, RSS (MiB), open fds and threads: for the report."""
        out = {}
        for title, p in self.processes().items():
            try:
                with p.oneshot():
                    out[title] = {"pid": p.pid, "rss_mib": round(p.memory_info().rss / MIB, 2),
                                  "num_fds": p.num_fds(), "num_threads": p.num_threads()}
            except psutil.Error:
                continue
        return out

    def leftovers(self) -> list[int]:
        """Pids seen during the run that still run (after the server stopped)."""
        alive = []
        for pid in sorted(self.seen):
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} for the kestrel gauges and counters that
    the report shows (KV usage, running/waiting, restarts, finished requests)."""
    keep = ("kv_cache_usage_perc", "num_requests_", "process_restarts_total", "request_success_total")
    out = {}
    for line in text.splitlines():
        if line.startswith("kestrel:") and any(k in line for k in keep):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def server_errors(log_path: str, limit: int = 5) -> dict[str, Any]:
    """Lines of the server's log at ERROR/CRITICAL or starting a traceback: count and first few."""
    with open(log_path, errors="replace") as fh:
        bad = [ln.rstrip() for ln in fh if " ERROR " in ln or " CRITICAL " in ln or ln.startswith("Traceback")]
    return {"count": len(bad), "first": [b[:400] for b in bad[:limit]]}
