"""The watchdog's stack dumps of real processes: py-spy on a stopped one, faulthandler when
py-spy is off or fails, dumps on request (shared.liveness.request_dump), and the py_spy
setting. Each target is a real Python child with a Beacon, torn down even on failure."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from services.supervisor.stack_dump import collect_stacks, find_py_spy
from services.supervisor.watchdog import Watchdog, WatchdogConfig, load_watchdog_config
from shared.config import build_config
from shared.liveness import request_dump, take_dump_answer, watchdog_dir
from tests.faults.helpers import py_spy_skip_reason

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY_SPY = find_py_spy("auto")

# A process that beats once, then hangs in a function of a known name (not beating).
CHILD = textwrap.dedent("""
    import sys, time
    from shared.liveness import Beacon

    def hang_here_for_the_watchdog():
        while True:
            time.sleep(0.05)

    beacon = Beacon(sys.argv[1], "worker-0")
    print("ready", flush=True)
    hang_here_for_the_watchdog()
""")


@pytest.fixture
def child(tmp_path):
    """(pid, runtime_dir) of a hung child with a Beacon; killed at the end."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(run)], stdout=subprocess.PIPE,
                            text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc.pid, str(run)
    finally:
        proc.kill()  # SIGKILL ends a stopped process too
        proc.wait(30)


def _stacks_path(run: str, pid: int) -> str:
    return os.path.join(watchdog_dir(run), f"worker-0-{pid}.stacks")


def _wait_for(pred, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    return None


@pytest.fixture
def py_spy() -> str:
    """The py-spy binary; skips when it is absent or cannot trace here."""
    why = py_spy_skip_reason()
    if why:
        pytest.skip(why)
    binary = find_py_spy("auto")
    assert binary is not None
    return binary


def test_py_spy_reads_the_stacks_of_a_stopped_process(child, py_spy):
    pid, run = child
    os.kill(pid, signal.SIGSTOP)
    assert _wait_for(lambda: open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "T", 30)
    st = collect_stacks(pid, _stacks_path(run, pid), py_spy)
    assert st.method == "py-spy --nonblocking", st.notes
    assert "hang_here_for_the_watchdog" in st.text
    assert any("stopped" in n for n in st.notes)
    # py-spy leaves it stopped (the watchdog never changes a process's state)
    assert open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "T"


def test_a_stopped_process_without_py_spy_gets_a_dump_that_says_why_it_has_no_stacks(child):
    pid, run = child
    os.kill(pid, signal.SIGSTOP)
    assert _wait_for(lambda: open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "T", 30)
    st = collect_stacks(pid, _stacks_path(run, pid), None)
    assert st.method == "none"
    assert any("cannot run in a stopped process" in n for n in st.notes)


def test_faulthandler_is_the_fallback_when_py_spy_fails(child, tmp_path):
    pid, run = child
    failing = tmp_path / "py-spy"
    failing.write_text("#!/bin/sh\necho 'Error: Permission denied (os error 13)' >&2\nexit 1\n")
    failing.chmod(0o755)
    st = collect_stacks(pid, _stacks_path(run, pid), str(failing))
    assert st.method == "faulthandler"
    assert any("py-spy failed" in n and "Permission denied" in n for n in st.notes), st.notes
    # faulthandler's own format (Python's faulthandler module writes it from the child)
    assert "most recent call first" in st.text
    assert "in hang_here_for_the_watchdog" in st.text


def test_a_dump_request_is_answered_with_the_dump_file(child, tmp_path):
    pid, run = child
    dumps = tmp_path / "dumps"
    wd = Watchdog(run, WatchdogConfig(timeout_s=3600, dump_dir=str(dumps), py_spy=PY_SPY))
    wd.check()  # first sight of the beacon: no stall yet, nothing dumped
    assert wd.dumps == []
    request_dump(run, "worker-0", pid, "engine: no word from the workers for 3 s in step 7")
    wd.check()
    path = take_dump_answer(run, "worker-0", pid)
    assert path is not None and os.path.dirname(path) == str(dumps)
    text = open(path).read()
    assert text.startswith(f"# kestrel watchdog: worker-0 (pid {pid}) engine: no word from the "
                           "workers for 3 s in step 7")
    assert "hang_here_for_the_watchdog" in text
    assert take_dump_answer(run, "worker-0", pid) is None  # the answer is taken once
    assert not os.path.exists(os.path.join(watchdog_dir(run), f"worker-0-{pid}.dump-request"))


def test_the_py_spy_setting_picks_the_binary_or_refuses_a_bad_path(tmp_path):
    cfg = build_config({"watchdog_py_spy": "off"}, env={})
    assert load_watchdog_config(cfg).py_spy is None
    with pytest.raises(ValueError, match="not an executable"):
        load_watchdog_config(dataclasses.replace(cfg, watchdog_py_spy=str(tmp_path / "nope")))
    wc_file = tmp_path / "wd.json"
    wc_file.write_text('{"py_spy": "/bin/sh"}')  # the file's key wins over the setting
    wc = load_watchdog_config(dataclasses.replace(cfg, watchdog_config=str(wc_file)))
    assert wc.py_spy == "/bin/sh"
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(beside, os.X_OK):  # pip installs it next to the interpreter
        assert find_py_spy("auto") == beside
