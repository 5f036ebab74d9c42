"""Watchdog dumps of real hangs under `kestrel serve` (issue 14 item 10): a SIGSTOPped worker
gets a dump with its Python stacks (py-spy) before the engine's timeout has it killed and
restarted, and with py-spy off a hung but running process gets faulthandler's stacks.
Every wait is a poll with a deadline; every server is torn down even when a test fails."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from tests.e2e.server import KestrelServer
from tests.faults.helpers import (chat_ok, find_pid, gone, join_all, py_spy_skip_reason,
                                  start_streams, wait_for)


def _slack() -> float:
    """How much slower than an idle 2-core machine this one is now (>= 1)."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


@pytest.fixture
def servers():
    started: list[KestrelServer] = []
    yield started
    for srv in started:
        srv.stop(signal.SIGKILL)


def _serve(servers, model_dir, *extra) -> KestrelServer:
    srv = KestrelServer(str(model_dir), *extra)
    servers.append(srv)
    return srv.start(timeout=300)


def _dump_of(dumps, role: str, pid: int, needle: str):
    """The first dump file of `role`-`pid` in `dumps` whose text holds `needle`, or None."""
    for f in sorted(dumps.glob(f"{role}-{pid}-*.txt")) if dumps.exists() else []:
        text = f.read_text()
        if needle in text:
            return text
    return None


def test_a_stopped_worker_is_dumped_with_its_stacks_then_killed_and_restarted(
        servers, smollm2_dir, tmp_path):
    why = py_spy_skip_reason()
    if why:
        pytest.skip(why)
    dumps = tmp_path / "dumps"
    # the default watchdog timeout (30 s) is longer than the worker timeout: the dump must
    # come from the engine's request before it gives up, not from the periodic scan
    srv = _serve(servers, smollm2_dir, "--worker-timeout-s", "3",
                 "--watchdog-dump-dir", str(dumps))
    worker = find_pid(srv, "kestrel:worker:0")
    streams = start_streams(srv.base_url, 1)  # the worker is stepping
    os.kill(worker, signal.SIGSTOP)
    try:
        text = wait_for(lambda: _dump_of(dumps, "worker-0", worker, "run_worker"),
                        120 * _slack(), step=0.2)
        assert text, srv.log_tail()
        header = text.splitlines()[0]
        assert header.startswith(f"# kestrel watchdog: worker-0 (pid {worker}) engine: no word "
                                 "from the workers"), header
        assert "(py-spy --nonblocking)" in header, header
        # real frames of the worker, in py-spy's "function (file:line)" form
        assert "run_worker (services/worker/worker.py:" in text, text
        assert join_all(streams, 60 * _slack()) == [], "the request hung"
        assert streams[0].outcome == "error", (streams[0].outcome, streams[0].detail)
        assert gone([worker], 60 * _slack()) == [], "the stopped worker was not killed"
    finally:
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert wait_for(lambda: chat_ok(srv.base_url, timeout=30 * _slack()), 240 * _slack(),
                    step=0.5), srv.log_tail()
    assert find_pid(srv, "kestrel:worker:0") != worker


def test_with_py_spy_off_a_hung_running_engine_gets_faulthandler_stacks(servers, smollm2_dir,
                                                                         tmp_path):
    dumps = tmp_path / "dumps"
    wd = tmp_path / "watchdog.json"
    wd.write_text(json.dumps({"timeout_s": 2, "dump_dir": str(dumps), "processes": ["engine"],
                              "py_spy": "off"}))
    srv = _serve(servers, smollm2_dir, "--debug-utilities", "--watchdog-config", str(wd))
    engine = find_pid(srv, "kestrel:engine")
    t0 = time.monotonic()
    # the engine sleeps in its loop: running, not beating (the utility answers at once)
    r = httpx.post(srv.base_url + "/debug/sleep", json={"seconds": 20}, timeout=30)
    assert r.status_code == 200, r.text
    text = wait_for(lambda: _dump_of(dumps, "engine", engine, "_debug_sleep_in_step"),
                    60 * _slack(), step=0.1)
    print(f"dump after {time.monotonic() - t0:.2f} s")
    assert text, srv.log_tail()
    header = text.splitlines()[0]
    assert "(faulthandler)" in header, header
    assert "# py-spy: not used" in text
    # faulthandler's format: 'File "...process.py", line N in _debug_sleep_in_step'
    assert "most recent call first" in text
    assert "process.py\", line " in text and "in _debug_sleep_in_step" in text
    assert find_pid(srv, "kestrel:engine") == engine  # the watchdog never kills


def test_a_stopped_kvstore_beats_no_more_and_the_watchdog_dumps_it(tmp_path):
    """docs/ARCHITECTURE.md §2.1: every process beats a watchdog beacon. The kvstore beat none,
    so a hung kvstore was never dumped (a watchdog config naming "kvstore" watched nothing)."""
    from services.supervisor.watchdog import Watchdog, WatchdogConfig
    from shared.liveness import read_beat, watchdog_dir
    from tests.kvstore_helpers import Store

    store = Store(slots=4)
    pid = store.proc.pid
    try:
        store.client()  # serving: the loop is running
        beat = os.path.join(watchdog_dir(store.runtime_dir), f"kvstore-{pid}.beat")
        first = wait_for(lambda: read_beat(beat), 30, step=0.05)
        assert first, f"no beacon {beat}: {os.listdir(store.runtime_dir)}"
        assert wait_for(lambda: (read_beat(beat) or first)[0] > first[0], 30, step=0.05)
        dumps = tmp_path / "dumps"
        wd = Watchdog(store.runtime_dir, WatchdogConfig(1.0, str(dumps), ["kvstore"], None))
        os.kill(pid, signal.SIGSTOP)
        try:
            wd.check()                            # sees the counter, now still
            wd.check(time.monotonic() + 5.0)      # ... still 5 s later: one dump
        finally:
            os.kill(pid, signal.SIGCONT)
        (dump,) = dumps.glob(f"kvstore-{pid}-*.txt")
        assert dump.read_text().startswith(f"# kestrel watchdog: kvstore (pid {pid}) made no progress")
    finally:
        store.close()
