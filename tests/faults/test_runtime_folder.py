"""The runtime folder hole, probed as an attacker would: another user pre-creates
`kestrel-<instance>` (a predictable name with --instance-id) or opens its mode, and plants
symlinks named config.json and owner.json.tmp pointing at a victim file; `kestrel serve`
(a real subprocess, run as root here) must refuse to start, exit 2 naming the folder and
the problem, and leave the victim and the planted folder as they were. A fresh start makes
both folders 0700 and every file 0600, and a normal stop removes them. The truth is the
file system (lstat, contents) and the process's exit code."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest

from shared.config import runtime_base
from tests.e2e.server import KESTREL, KestrelServer, free_port, segments
from tests.faults.helpers import wait_for
from tests.runtime_guard import new_instance_id

NOBODY = 65534


def _serve(smollm2_dir, iid: str) -> subprocess.CompletedProcess:
    """`kestrel serve` as a user starts it; a refusal comes back within the timeout (a server
    that starts instead runs until the timeout kills it, which fails the test)."""
    return subprocess.run([KESTREL, "serve", "--model", str(smollm2_dir), "--host", "127.0.0.1",
                           "--port", str(free_port()), "--instance-id", iid, "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def planted(tmp_path):
    """(instance id, its runtime folder path, victim file, the folders to remove)."""
    iid = new_instance_id("r")
    run = os.path.join(runtime_base(), f"kestrel-{iid}")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    made = [run, run + "-dumps"]
    yield iid, run, victim, made
    for path in made:
        if os.path.islink(path):
            os.unlink(path)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _listing(folder: str) -> dict[str, tuple[int, int, str | None]]:
    out = {}
    for name in os.listdir(folder):
        st = os.lstat(os.path.join(folder, name))
        link = os.readlink(os.path.join(folder, name)) if stat.S_ISLNK(st.st_mode) else None
        out[name] = (st.st_mode, st.st_uid, link)
    return out


@pytest.mark.parametrize("how", ["owned by nobody", "mode 0777"])
def test_serve_refuses_a_planted_runtime_folder_and_writes_nothing_through_its_symlinks(
        planted, smollm2_dir, how):
    iid, run, victim, _ = planted
    os.mkdir(run, 0o700)
    for name in ("config.json", "owner.json.tmp", "owner.json", "restarts.json"):
        os.symlink(victim, os.path.join(run, name))
    if how == "owned by nobody":
        os.chown(run, NOBODY, NOBODY)
        problem = f"owned by uid {NOBODY}"
    else:
        os.chmod(run, 0o777)
        problem = "mode is 0777"
    before = _listing(run)
    r = _serve(smollm2_dir, iid)
    assert r.returncode == 2, r.stdout + r.stderr[-3000:]
    assert f"refusing the folder {run}" in r.stderr and problem in r.stderr, r.stderr[-3000:]
    assert victim.read_text() == "precious\n"
    assert _listing(run) == before, "something was written into the planted folder"
    assert segments(iid) == [], "a process started"


def test_serve_refuses_a_symlink_in_place_of_the_dump_folder(planted, smollm2_dir, tmp_path):
    iid, run, victim, _ = planted
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    os.symlink(target, run + "-dumps")
    r = _serve(smollm2_dir, iid)
    assert r.returncode == 2, r.stdout + r.stderr[-3000:]
    assert f"refusing the folder {run}-dumps" in r.stderr and "symlink" in r.stderr, r.stderr[-3000:]
    assert os.listdir(target) == []
    assert not os.path.exists(run), "the runtime folder was made although serve refused"


def test_a_fresh_serve_makes_private_folders_and_files_and_a_stop_removes_them(smollm2_dir):
    srv = KestrelServer(str(smollm2_dir))
    run, dumps = srv.runtime_dir, srv.runtime_dir + "-dumps"
    try:
        srv.start()
        # the engine writes its startup report once the workers are ready
        assert wait_for(lambda: os.path.exists(os.path.join(run, "startup_report.json")), 60)
        for folder in (run, dumps, os.path.join(run, "watchdog")):
            st = os.lstat(folder)
            assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700, folder
            assert st.st_uid == os.geteuid(), folder
        files = []
        for root, _, names in os.walk(run):
            for name in names:
                path = os.path.join(root, name)
                st = os.lstat(path)
                if stat.S_ISSOCK(st.st_mode):
                    continue  # ipc sockets: 0600 by restrict_ipc_file, inside the 0700 folder
                assert stat.S_ISREG(st.st_mode), path
                assert stat.S_IMODE(st.st_mode) == 0o600, (path, oct(st.st_mode))
                files.append(name)
        assert {"config.json", "owner.json", "restarts.json", "startup_report.json"} <= set(files)
        assert wait_for(lambda: "num_threads derived:" in srv.log_tail(400), 30), srv.log_tail()
    finally:
        code = srv.stop()
    assert code == 0, srv.log_tail()
    assert not os.path.exists(run) and not os.path.exists(dumps)
