"""Recovery times after kill -9, against the process-fault bounds of issue 7: a killed
frontend is back (GET /health 200 through it) within 3 s; after a killed worker or engine,
a chat request succeeds again within 15 s.

The fault tests (tests/faults/test_process_faults.py) check that each recovery happens and
what it keeps (the engine survives a frontend's death, ...), with deadlines that only bound
a hang; the times are measured here, on a machine the caller keeps quiet. Each round: kill
-9 one process of a running `kestrel serve`, poll every 20 ms, record seconds from the kill
to the first success. Writes JSON (every round, the median and max per victim, and whether
the max is within the bound) and prints it.

    .venv/bin/python benchmarks/fault_recovery.py --rounds 3 \\
        --out benchmarks/results/<date>_<machine>_fault_recovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

import httpx
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.serve_process import ServeProcess  # noqa: E402

BOUNDS_S = {"kestrel:frontend:0": 3.0, "kestrel:worker:0": 15.0, "kestrel:engine": 15.0}


def _pid(server: ServeProcess, title: str, timeout: float = 60.0) -> int:
    """Pid of the server's live child whose process title is `title`. Raises TimeoutError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in psutil.Process(server.proc.pid).children(recursive=True):
            try:
                cmd = p.cmdline()
                if cmd and cmd[0].strip() == title and p.status() != psutil.STATUS_ZOMBIE:
                    return p.pid
            except psutil.Error:
                continue
        time.sleep(0.05)
    raise TimeoutError(f"no {title} within {timeout} s")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1.0, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def _chat_ok(url: str, model: str) -> bool:
    try:
        r = httpx.post(url + "/v1/chat/completions", timeout=10.0, trust_env=False, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        return r.status_code == 200
    except httpx.HTTPError:
        return False


def recovery_s(server: ServeProcess, victim: str, model: str, timeout: float = 120.0) -> float:
    """Kill -9 `victim` (a process title) and return the seconds until the server serves
    again: /health 200 for a frontend, a completed chat request for the engine group.
    Raises TimeoutError after `timeout` s."""
    old = _pid(server, victim)
    ok = (lambda: _healthy(server.base_url)) if victim.startswith("kestrel:frontend") \
        else (lambda: _chat_ok(server.base_url, model))
    t0 = time.monotonic()
    os.kill(old, signal.SIGKILL)
    while time.monotonic() - t0 < timeout:
        if ok():
            return time.monotonic() - t0
        time.sleep(0.02)
    raise TimeoutError(f"not back {timeout} s after killing {victim}")


def main() -> int:
    """Run the rounds; exit code 0 when every victim's max is within its bound, else 1."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join("models", "SmolLM2-135M-Instruct"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = ap.parse_args()
    server = ServeProcess(["--model", args.model])
    rounds: dict[str, list[float]] = {v: [] for v in BOUNDS_S}
    try:
        server.start(timeout=300)
        model = server.model_name()
        for _ in range(args.rounds):
            for victim in BOUNDS_S:
                # let the restarted group settle (and its standbys be made) between kills
                time.sleep(12.0)
                rounds[victim].append(round(recovery_s(server, victim, model), 3))
    finally:
        server.stop()
    result = {
        "benchmark": "fault_recovery", "model": args.model, "rounds": args.rounds,
        "cpus": os.cpu_count(), "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
        "victims": {v: {"seconds": s, "median_s": statistics.median(s), "max_s": max(s),
                        "bound_s": BOUNDS_S[v], "within_bound": max(s) <= BOUNDS_S[v]}
                    for v, s in rounds.items()},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0 if all(v["within_bound"] for v in result["victims"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
