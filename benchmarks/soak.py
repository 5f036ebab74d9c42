"""Soak: a real `kestrel serve` under a steady mixed load for a long time, watching for leaks.

Server: `python -m services.cli serve` (benchmarks/serve_process.py: this interpreter, its
own session, a free port, KESTREL_* variables not passed, torn down at the end also on
error or SIGTERM) with `--model` (default models/SmolLM2-135M-Instruct, on the server's
default device: the CPU here), `--tool-call-parser hermes` (so that tool requests go
through the parser) and any `--serve-arg` flags.

Load (benchmarks/soak_requests.py): --concurrency (8) client loops, each sending one
request after another from the mix (OpenAI chat and completions, Anthropic messages,
streamed and not, stop strings, n=2 with logprobs, json_schema, tools), every answer
checked against the official SDKs' types. --disconnect-frac (0.1) of the requests are
streams the client closes after 2-4 events. --abort-cycles (20) times, spread evenly over
the run, a burst of --abort-burst (8) extra streams (max_tokens 64) starts at once, and
when each has its first event (or ended) all still open are cancelled at the same moment.

Phases: warm-up (--warmup-s; default 10 % of --duration-s, at least 60 s, at most half),
then the load stops, the engine is polled (GET /internal/stats) until it is idle, and the
baseline is taken: RSS of every process (psutil: the supervisor and all its descendants,
named by their process titles, `kestrel:engine`, `kestrel:worker:0`, `kestrel:frontend:0`,
...) and the KV blocks in use (num_blocks - num_free_blocks; evictable prefix-cache blocks
count as free). The load resumes for the rest of --duration-s; then it stops, the last
requests finish, the engine is polled until idle with its blocks back to the baseline (or
--idle-timeout-s passes), and the end is taken the same way. RSS is also sampled every
--sample-every-s (10) seconds through the whole run. A new pid under a title is a restart.

Writes JSON (benchmarks/soak_report.py computes the figures and the verdict: RSS growth
<= --max-rss-growth-pct (2) for every process, 0 failed requests, blocks back to the
baseline, no restart) to --out (default benchmarks/results/<date>_<host>_soak.json) and
prints it. Exit status 1 if the verdict is a fail.

Usage:
  python benchmarks/soak.py                                  # 30 minutes, the full soak
  python benchmarks/soak.py --duration-s 120 --serve-arg=--num-threads=1 --out /tmp/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import signal
import sys
import time
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from benchmarks.common import emit_json  # noqa: E402
from benchmarks.serve_process import ROOT, ServeProcess  # noqa: E402
from benchmarks.soak_probes import ProcessWatch, parse_metrics, server_errors  # noqa: E402
from benchmarks.soak_report import MIB, rss_report, verdict  # noqa: E402
from benchmarks.soak_requests import (KINDS, SDK_TYPES, STREAM_KINDS, Kind, Outcome,  # noqa: E402
                                      run_request)


class Soak:
    """One run: the load, the sampler, the measurements (see the module docstring)."""

    def __init__(self, a: argparse.Namespace, client: httpx.AsyncClient, model: str, watch: ProcessWatch):
        self.a, self.client, self.model, self.watch = a, client, model, watch
        self.rng = random.Random(a.seed)
        self.outcomes: list[Outcome] = []
        self.samples: list[dict[str, Any]] = []
        self.phase = "warmup"
        self.t0 = time.monotonic()
        self.disconnect_missed = 0
        self.cycles_done = 0
        self.weights = [k.weight for k in KINDS]

    def record(self, o: Outcome, cut: bool = False) -> None:
        """Keep one outcome (a cut stream that ended first is counted as missed)."""
        if cut and o.outcome == "ok":
            self.disconnect_missed += 1
        self.outcomes.append(o)

    def take_sample(self) -> dict[str, int]:
        """Sample every process's RSS now, in the current phase; returns title -> bytes."""
        t = time.monotonic() - self.t0
        rss = self.watch.sample(t)
        self.samples.append({"t_s": round(t, 1), "phase": self.phase, "rss": rss})
        return rss

    async def sampler(self) -> None:
        """Sample every --sample-every-s seconds until cancelled."""
        while True:
            self.take_sample()
            await asyncio.sleep(self.a.sample_every_s)

    async def client_loop(self, stop_at: float) -> None:
        """Send requests of the mix one after another until stop_at (monotonic)."""
        while time.monotonic() < stop_at:
            cut = self.rng.random() < self.a.disconnect_frac
            kind = self.rng.choice(STREAM_KINDS) if cut else self.rng.choices(KINDS, self.weights)[0]
            body = kind.body(self.model, self.rng)
            o = await run_request(self.client, kind, body, cut_after=self.rng.randint(2, 4) if cut else 0)
            self.record(o, cut)

    async def abort_burst(self) -> None:
        """Start --abort-burst streams at once; when each has an event (or ended, or
        --request-timeout-s passed), cancel all still open at the same moment."""
        firsts, tasks, kinds = [], [], []
        for _ in range(self.a.abort_burst):
            kind: Kind = self.rng.choice(STREAM_KINDS)
            body = {**kind.body(self.model, self.rng), "max_tokens": 64}
            ev = asyncio.Event()
            firsts.append(ev)
            kinds.append(kind)
            tasks.append(asyncio.create_task(run_request(self.client, kind, body, first_event=ev)))

        async def started(ev: asyncio.Event, task: asyncio.Task) -> None:
            waiter = asyncio.create_task(ev.wait())
            try:
                await asyncio.wait([waiter, task], return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()

        try:
            await asyncio.wait_for(asyncio.gather(*(started(e, t) for e, t in zip(firsts, tasks))),
                                   self.a.request_timeout_s)
        except TimeoutError:
            pass
        for t in tasks:
            t.cancel()
        for kind, res in zip(kinds, await asyncio.gather(*tasks, return_exceptions=True)):
            if isinstance(res, Outcome):
                self.record(res)
            elif isinstance(res, asyncio.CancelledError):
                self.record(Outcome(kind.name, "aborted"))
            else:
                self.record(Outcome(kind.name, "failed", f"{type(res).__name__}: {res}"))
        self.cycles_done += 1

    async def load(self, offset: float, seconds: float, total: float) -> None:
        """Run the load for `seconds`; the abort cycles whose times (spread evenly over
        `total` seconds of load) fall in [offset, offset + seconds) run in it."""
        start = time.monotonic()
        n = self.a.abort_cycles
        cycles = [(i + 0.5) * total / n for i in range(n)]
        mine = [c - offset for c in cycles if offset <= c < offset + seconds]

        async def aborts() -> None:
            for c in mine:
                await asyncio.sleep(max(0.0, start + c - time.monotonic()))
                await self.abort_burst()

        await asyncio.gather(aborts(), *(self.client_loop(start + seconds) for _ in range(self.a.concurrency)))

    async def stats(self) -> dict[str, Any]:
        """The engine's stats (GET /internal/stats), with blocks_in_use added."""
        r = await self.client.get("/internal/stats")
        r.raise_for_status()
        s = r.json()
        return {**s, "blocks_in_use": s["num_blocks"] - s["num_free_blocks"]}

    async def metrics(self) -> dict[str, float]:
        """The selected /metrics values (parse_metrics)."""
        r = await self.client.get("/metrics")
        r.raise_for_status()
        return parse_metrics(r.text)

    async def wait_idle(self, max_in_use: int | None) -> tuple[dict[str, Any], float, bool]:
        """Poll the engine's stats until nothing runs or waits (and, with max_in_use, at
        most that many blocks are in use), for up to --idle-timeout-s. Returns (the last
        stats, seconds waited, whether it got there)."""
        t0 = time.monotonic()
        while True:
            s = await self.stats()
            idle = s["num_running"] == 0 and s["num_waiting"] == 0
            if idle and (max_in_use is None or s["blocks_in_use"] <= max_in_use):
                return s, round(time.monotonic() - t0, 2), True
            if time.monotonic() - t0 > self.a.idle_timeout_s:
                return s, round(time.monotonic() - t0, 2), False
            await asyncio.sleep(0.25)

    async def run(self) -> dict[str, Any]:
        """The whole run (warm-up, baseline, load, end). Returns the report's measurements."""
        a = self.a
        warm = a.warmup_s if a.warmup_s is not None else min(max(60.0, 0.1 * a.duration_s), a.duration_s / 2)
        initial = await self.stats()
        sampler = asyncio.create_task(self.sampler())
        try:
            await self.load(0.0, warm, a.duration_s)
            self.phase = "baseline"
            base_stats, base_wait, _ = await self.wait_idle(None)
            base_metrics = await self.metrics()
            base_rss = self.take_sample()
            base_details = self.watch.details()
            self.phase = "measure"
            t_measure = time.monotonic()
            await self.load(warm, a.duration_s - warm, a.duration_s)
            self.phase = "end"
            end_stats, end_wait, end_idle = await self.wait_idle(base_stats["blocks_in_use"])
            end_metrics = await self.metrics()
            end_rss = self.take_sample()
            end_details = self.watch.details()
        finally:
            sampler.cancel()
        return {"warmup_s": round(warm, 1), "measure_s": round(time.monotonic() - t_measure, 1),
                "initial_stats": initial, "baseline": (base_stats, base_wait, base_metrics, base_rss, base_details),
                "end": (end_stats, end_wait, end_idle, end_metrics, end_rss, end_details)}


def build_report(a: argparse.Namespace, soak: Soak, m: dict[str, Any], serve: ServeProcess,
                 flags: list[str], load_start: tuple[float, ...]) -> dict[str, Any]:
    """The JSON of the run from the measurements `m` of Soak.run."""
    base_stats, base_wait, base_metrics, base_rss, base_details = m["baseline"]
    end_stats, end_wait, end_idle, end_metrics, end_rss, end_details = m["end"]
    counts = Counter(o.outcome for o in soak.outcomes)
    by_kind: dict[str, Counter] = {}
    for o in soak.outcomes:
        by_kind.setdefault(o.kind, Counter())[o.outcome] += 1
    failures = [{"kind": o.kind, "error": o.error} for o in soak.outcomes if o.outcome == "failed"]
    rss = rss_report(base_rss, end_rss, soak.samples, a.max_rss_growth_pct)
    blocks = {"num_blocks": base_stats["num_blocks"], "initial_in_use": m["initial_stats"]["blocks_in_use"],
              "baseline_in_use": base_stats["blocks_in_use"], "end_in_use": end_stats["blocks_in_use"],
              "seconds_to_idle_at_baseline": base_wait, "seconds_to_idle_at_end": end_wait,
              "idle_at_end": end_idle, "baseline_stats": base_stats, "end_stats": end_stats}
    ok_secs = sorted(o.seconds for o in soak.outcomes if o.outcome == "ok")
    return {
        "benchmark": "soak", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "load_avg_start": load_start, "load_avg_end": os.getloadavg()},
        "settings": {k: v for k, v in vars(a).items() if k != "out"} | {"server_flags": flags,
                                                                      "sdk_shape_checks": SDK_TYPES},
        "server": {"startup_seconds": serve.startup_seconds, "log": serve.log_path,
                   "errors_in_log": server_errors(serve.log_path)},
        "phases": {"warmup_s": m["warmup_s"], "measure_s": m["measure_s"]},
        "requests": {"total": len(soak.outcomes), "by_outcome": dict(counts),
                     "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
                     "disconnect_missed": soak.disconnect_missed, "abort_cycles": soak.cycles_done,
                     "ok_seconds_p50": ok_secs[len(ok_secs) // 2] if ok_secs else None,
                     "ok_seconds_max": ok_secs[-1] if ok_secs else None,
                     "first_failures": failures[:a.keep_errors]},
        "rss": rss, "processes": {"baseline": base_details, "end": end_details},
        "restarts": soak.watch.restarts, "blocks": blocks,
        "metrics": {"baseline": base_metrics, "end": end_metrics},
        "samples": [{"t_s": s["t_s"], "phase": s["phase"],
                     "rss_mib": {k: round(v / MIB, 2) for k, v in s["rss"].items()}} for s in soak.samples],
        "targets": {"max_rss_growth_pct": a.max_rss_growth_pct, "failed_requests": 0,
                    "blocks_in_use_at_end": "== baseline", "restarts": 0},
        "verdict": verdict(rss, dict(counts), blocks, soak.watch.restarts),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct"))
    ap.add_argument("--duration-s", type=float, default=1800.0, help="seconds of load, warm-up included")
    ap.add_argument("--warmup-s", type=float, default=None,
                    help="seconds of warm-up load (default 10%% of the duration, >= 60, <= half)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--disconnect-frac", type=float, default=0.1)
    ap.add_argument("--abort-cycles", type=int, default=20)
    ap.add_argument("--abort-burst", type=int, default=8, help="streams per abort cycle")
    ap.add_argument("--sample-every-s", type=float, default=10.0)
    ap.add_argument("--max-rss-growth-pct", type=float, default=2.0)
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--idle-timeout-s", type=float, default=120.0)
    ap.add_argument("--startup-timeout-s", type=float, default=600.0)
    ap.add_argument("--tool-call-parser", default="hermes", help="'' to start the server without one")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="an extra `kestrel serve` flag, e.g. --serve-arg=--num-threads=1 (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-errors", type=int, default=10, help="failures kept in the report")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.abort_cycles < 0 or a.concurrency < 1 or a.duration_s <= 0:
        ap.error("--concurrency >= 1, --abort-cycles >= 0 and --duration-s > 0")
    return a


def main(argv: list[str] | None = None) -> int:
    """Run the soak; returns the exit status (0 passed, 1 failed)."""
    a = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    flags = ["--model", os.path.abspath(a.model), *a.serve_arg]
    if a.tool_call_parser:
        flags += ["--tool-call-parser", a.tool_call_parser]
    out = a.out or os.path.join(ROOT, "benchmarks", "results",
                                f"{datetime.date.today()}_cpu{os.cpu_count()}_soak.json")
    load_start = os.getloadavg()
    serve = ServeProcess(flags)
    try:
        serve.start(a.startup_timeout_s)
        watch = ProcessWatch(serve.proc.pid)  # type: ignore[union-attr]
        model = serve.model_name()

        async def go() -> tuple[Soak, dict[str, Any]]:
            limits = httpx.Limits(max_connections=4 * (a.concurrency + a.abort_burst))
            timeout = httpx.Timeout(a.request_timeout_s, connect=30.0)
            async with httpx.AsyncClient(base_url=serve.base_url, limits=limits, timeout=timeout,
                                         trust_env=False) as client:
                soak = Soak(a, client, model, watch)
                return soak, await soak.run()

        soak, m = asyncio.run(go())
        report = build_report(a, soak, m, serve, flags, load_start)
    except BaseException:
        print(serve.log_tail(), file=sys.stderr)
        raise
    finally:
        exit_code = serve.stop()
    report["server"]["exit_code"] = exit_code
    report["server"]["leftover_pids"] = watch.leftovers()
    emit_json(report, out)
    v = report["verdict"]
    print(f"soak: {report['requests']['by_outcome']}, rss growth "
          f"{ {k: p['growth_pct'] for k, p in report['rss'].items()} } %, blocks "
          f"{report['blocks']['baseline_in_use']} -> {report['blocks']['end_in_use']}: "
          f"{'PASS' if v['passed'] else 'FAIL'}", file=sys.stderr)
    return 0 if v["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
