"""Fault tests of stopping and cleaning up: Ctrl-C to a whole process group drains like
SIGTERM, /health follows the engine's connection, a kill -9'd supervisor's runtime folder is
removed by the next start, and a closed stdout pipe ends a command quietly. Real `kestrel
serve` processes; every wait is a poll with a deadline; servers are torn down on failure."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import psutil
import pytest

from shared.config import runtime_base
from tests.e2e.server import KESTREL, KestrelServer, segments
from tests.faults.helpers import find_pid, gone, join_all, start_streams, wait_for


@pytest.fixture
def servers():
    started: list[KestrelServer] = []
    yield started
    for srv in started:
        if srv.proc is not None and srv.proc.poll() is None:
            try:  # a server in its own session: take its whole group down
                os.killpg(srv.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        srv.stop(signal.SIGKILL)


def _start(srv: KestrelServer, timeout: float = 120.0, **popen) -> KestrelServer:
    """Start `srv` with extra Popen arguments and wait for a 200 from /health."""
    srv.proc = subprocess.Popen(srv.argv, stdout=srv.log, stderr=subprocess.STDOUT, **popen)
    ok = wait_for(lambda: srv.proc.poll() is None and
                  httpx.get(srv.base_url + "/health", timeout=1).status_code == 200, timeout, 0.2)
    assert ok, srv.log_tail()
    return srv


def _exit_codes(log: str) -> dict[str, int]:
    """The children's exit codes, from the supervisor's "<role> (pid N) stopped with exit
    code C" lines."""
    codes = {}
    for line in log.splitlines():
        if "stopped with exit code" in line and "kestrel.supervisor: " in line:
            role = line.split("kestrel.supervisor: ", 1)[1].split()[0]
            codes[role] = int(line.rsplit(" ", 1)[1])
    return codes


def test_ctrl_c_to_the_process_group_drains_a_stream_and_everything_exits_zero(
        servers, smollm2_dir):
    srv = KestrelServer(str(smollm2_dir), "--shutdown-timeout", "120")
    servers.append(srv)
    _start(srv, start_new_session=True)  # its own group, as a terminal's foreground job
    kids = [p.pid for p in srv.children()]
    # long enough to be in flight when the 503 is checked, short enough for a loaded host
    [s] = start_streams(srv.base_url, 1, max_tokens=48)
    os.killpg(srv.proc.pid, signal.SIGINT)  # what Ctrl-C does: every process of the group

    def drain_answer():
        r = httpx.get(srv.base_url + "/health", timeout=2)
        return r if r.status_code == 503 else None

    r = wait_for(drain_answer, 10)
    assert r is not None and s.is_alive(), "no 503 while the stream was still running"
    assert r.headers.get("retry-after"), r.headers
    assert "shutting down" in r.json()["error"]["message"]
    assert join_all([s], 120) == []
    assert s.outcome == "done" and s.finish_reason == "length", (s.outcome, s.detail,
                                                                  srv.log_tail())
    assert srv.proc.wait(60) == 0, srv.log_tail()  # the supervisor; the children below
    assert gone(kids, 10) == []
    log = srv.log_tail(400)
    codes = _exit_codes(log)
    assert set(codes) >= {"engine", "worker-0", "frontend-0"} and set(codes.values()) == {0}, log
    assert "KeyboardInterrupt" not in log, log
    assert segments(srv.instance_id) == []
    assert not os.path.exists(srv.runtime_dir)


def test_health_turns_503_as_soon_as_the_engine_socket_is_gone(servers, smollm2_dir):
    srv = KestrelServer(str(smollm2_dir))
    servers.append(srv)
    _start(srv)
    worker = find_pid(srv, "kestrel:worker:0")
    engine = find_pid(srv, "kestrel:engine")
    os.kill(worker, signal.SIGKILL)
    # The supervisor stops the engine group; once the engine process is gone the frontend
    # cannot send to it, and /health must say so (not 2-3 s later, when silence counts).
    assert gone([engine], 15) == [], "the engine was not stopped after its worker died"
    t0 = time.monotonic()
    r = httpx.get(srv.base_url + "/health", timeout=2)
    chat = httpx.post(srv.base_url + "/v1/chat/completions", timeout=5, json={
        "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2})
    print(f"health {r.status_code}, chat {chat.status_code} right after the engine exited")
    if chat.status_code == 503:  # the engine is still away: both say so
        assert r.status_code == 503, (r.status_code, r.text)
    assert time.monotonic() - t0 < 5
    # and it comes back
    assert wait_for(lambda: httpx.get(srv.base_url + "/health", timeout=1).status_code == 200,
                    60), srv.log_tail()


def _runtime_dir(instance_id: str) -> str:
    return os.path.join(runtime_base(), f"kestrel-{instance_id}")


@pytest.fixture
def own_base():
    """A private base folder for runtime folders, short (unix socket paths inside must fit):
    the `kestrel serve` of other sessions on this host sweep dead folders under /tmp too."""
    base = tempfile.mkdtemp(prefix="kb-", dir="/tmp")
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_next_serve_removes_the_runtime_folder_of_a_kill9_supervisor_never_a_live_one(
        servers, smollm2_dir, own_base):
    dead = KestrelServer(str(smollm2_dir), base=own_base)
    servers.append(dead)
    _start(dead)
    kids = [p.pid for p in dead.children()]
    rdir = dead.runtime_dir
    assert os.path.isfile(os.path.join(rdir, "owner.json"))
    dead.proc.kill()
    dead.proc.wait(10)
    assert gone(kids, 15) == []
    assert os.path.isdir(rdir), "nothing to clean: the folder is already gone"

    live = KestrelServer(str(smollm2_dir), base=own_base)
    servers.append(live)
    _start(live)
    assert wait_for(lambda: not os.path.exists(rdir), 10), os.listdir(rdir)
    assert not os.path.exists(rdir + "-dumps"), "the dead instance's empty dump folder stayed"
    assert "removed the runtime folder of a dead instance" in live.log_tail(400)

    # `kestrel shm clean` (over /tmp and $XDG_RUNTIME_DIR) keeps the live instance's folder
    # and removes a dead one's
    live.stop()
    live = KestrelServer(str(smollm2_dir))
    servers.append(live)
    _start(live)
    live_dir = live.runtime_dir
    fake = _runtime_dir("tdead" + live.instance_id[1:])
    os.makedirs(fake)
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    with open(os.path.join(fake, "owner.json"), "w") as fh:
        json.dump({"pid": int(proc.stdout), "created": time.time() - 5, "pidns": 0,
                   "instance_id": "x"}, fh)
    unowned = _runtime_dir("tnoowner" + live.instance_id[1:])
    os.makedirs(unowned)
    try:
        out = subprocess.run([KESTREL, "shm", "clean"], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        assert f"removed {fake}/" in out.stdout, out.stdout
        assert not os.path.exists(fake)
        assert os.path.isfile(os.path.join(live_dir, "config.json")), "a live folder was removed"
        assert os.path.isdir(unowned), "a folder without an owner record was removed"
        assert httpx.get(live.base_url + "/health", timeout=5).status_code == 200
    finally:
        shutil.rmtree(fake, ignore_errors=True)
        shutil.rmtree(unowned, ignore_errors=True)


@pytest.mark.parametrize("argv", [["--help"], ["shm", "watch", "NAME"], ["shm", "ls"]])
def test_a_closed_stdout_pipe_ends_a_command_without_a_traceback(argv, tmp_path):
    if argv[1:2] == ["watch"]:  # a segment to watch: any file with the ring preamble
        argv = ["shm", "watch", _fake_ring(tmp_path), "--interval", "0.05"]
    p = subprocess.Popen([KESTREL, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if argv[1:2] == ["watch"]:
        p.stdout.readline()  # it runs (and would run forever) before the reader goes
    p.stdout.close()  # what `| head` does once it has its lines
    err = p.stderr.read().decode()
    code = p.wait(30)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert code in (0, 141), (code, err)


def _fake_ring(tmp_path):
    """A live plan ring of a throwaway writer, created by the real ring code."""
    from shared.shm_ring import ShmRingWriter

    inst = f"t{os.getpid()}x"
    name = f"kestrel-{inst}-plan"
    w = ShmRingWriter(name, n_readers=1, n_chunks=4, chunk_size=256,
                      runtime_dir=str(tmp_path), instance_id=inst)
    _RINGS.append(w)
    return name


_RINGS: list = []


@pytest.fixture(autouse=True)
def _close_rings():
    yield
    while _RINGS:
        _RINGS.pop().close()


def test_a_child_spawned_by_the_supervisor_survives_ctrl_c_while_its_interpreter_starts():
    # SIGINT at once, while the child's interpreter is still starting (its first line sleeps
    # before ignore_sigint_if_supervised, as a slow import would): it must stay pending and
    # be discarded, not raise KeyboardInterrupt (a Ctrl-C as a standby was being spawned).
    from shared.procutil import spawn_supervised

    code = ("import time; time.sleep(1.0); from shared.procutil import ignore_sigint_if_supervised;"
            "ignore_sigint_if_supervised(); time.sleep(0.2); print('alive', flush=True)")
    env = dict(os.environ, KESTREL_SUPERVISOR_PID=str(os.getpid()))
    p = spawn_supervised([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
        assert (p.returncode, out.strip()) == (0, b"alive"), err.decode()
        assert b"KeyboardInterrupt" not in err
    finally:
        p.kill()
        p.wait()
    # the caller's thread got its mask back: SIGINT is not left blocked here
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())


def test_children_of_a_supervisor_ignore_sigint_but_a_lone_process_stops():
    code = ("import os, signal, time; from shared.procutil import on_stop_signals;"
            "on_stop_signals(lambda s, f: os._exit(7)); print('ready', flush=True);"
            "time.sleep(30); os._exit(0)")
    env = dict(os.environ)
    env.pop("KESTREL_SUPERVISOR_PID", None)
    for supervised in (True, False):
        e = dict(env, KESTREL_SUPERVISOR_PID=str(os.getpid())) if supervised else env
        p = subprocess.Popen([sys.executable, "-c", code], env=e, stdout=subprocess.PIPE,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        try:
            assert p.stdout.readline().strip() == b"ready"
            p.send_signal(signal.SIGINT)
            if supervised:
                with pytest.raises(subprocess.TimeoutExpired):
                    p.wait(1.0)
                assert psutil.pid_exists(p.pid)
                p.send_signal(signal.SIGTERM)
            assert p.wait(10) == 7
        finally:
            p.kill()
            p.wait()
