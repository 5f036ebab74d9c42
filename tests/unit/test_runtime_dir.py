"""Private runtime and dump folders (shared/runtime_dir.py): made 0700, refused when another
user owns them, when their mode lets others in or when they are symlinks; files written
inside never go through a planted symlink; `$XDG_RUNTIME_DIR` is the base when usable.
The tests run as root, so "another user" is a folder chowned to nobody (65534). The truth
is the file system itself (lstat, file contents), not our own reports."""

from __future__ import annotations

import os
import pathlib
import shutil
import stat
import tempfile

import pytest

from shared.config import build_config
from shared.liveness import Beacon
from shared.restart_counts import write_restart_counts
from shared.runtime_dir import (DEFAULT_BASE, MAX_BASE_LEN, UnsafeFolderError, private_dir, runtime_base,
                                write_owner, write_private_file)

NOBODY = 65534


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _victim(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    return victim


def test_a_fresh_folder_is_made_0700_and_its_files_0600(tmp_path):
    run = tmp_path / "kestrel-x"
    assert private_dir(str(run)) is True
    assert _mode(run) == 0o700 and os.lstat(run).st_uid == os.geteuid()
    write_owner(str(run), "x")
    write_restart_counts(str(run), {"engine": 0})
    path = write_private_file(str(run), "config.json", '{"api_key": "k"}')
    for name in ("owner.json", "restarts.json", "config.json"):
        assert _mode(run / name) == 0o600, name
    assert open(path).read() == '{"api_key": "k"}'
    assert sorted(os.listdir(run)) == ["config.json", "owner.json", "restarts.json"]  # no temp left
    assert private_dir(str(run)) is False  # ours and private: taken as it is


def test_a_folder_of_another_user_is_refused_and_nothing_is_written_through_it(tmp_path):
    victim = _victim(tmp_path)
    run = tmp_path / "kestrel-compose"
    run.mkdir(mode=0o700)
    os.symlink(victim, run / "config.json")
    os.chown(run, NOBODY, NOBODY)
    with pytest.raises(UnsafeFolderError) as e:
        private_dir(str(run))
    assert str(run) in str(e.value) and f"owned by uid {NOBODY}" in str(e.value)
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("mode", [0o777, 0o755, 0o750, 0o701])
def test_a_folder_with_group_or_other_bits_is_refused(tmp_path, mode):
    run = tmp_path / "kestrel-open"
    run.mkdir()
    os.chmod(run, mode)
    with pytest.raises(UnsafeFolderError) as e:
        private_dir(str(run))
    assert str(run) in str(e.value) and f"{mode:04o}" in str(e.value)
    assert _mode(run) == mode  # not "fixed" behind the user's back


def test_a_symlink_in_place_of_the_folder_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "kestrel-link"
    os.symlink(target, link)
    with pytest.raises(UnsafeFolderError, match="symlink"):
        private_dir(str(link))
    assert os.listdir(target) == []


def test_a_file_in_place_of_the_folder_is_refused(tmp_path):
    (tmp_path / "kestrel-file").write_text("")
    with pytest.raises(UnsafeFolderError, match="not a folder"):
        private_dir(str(tmp_path / "kestrel-file"))


def test_writing_over_a_planted_symlink_replaces_the_link_and_leaves_its_target(tmp_path):
    victim = _victim(tmp_path)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    for name in ("config.json", "owner.json", "owner.json.tmp", "restarts.json", "restarts.json.tmp"):
        os.symlink(victim, run / name)
    write_private_file(str(run), "config.json", "{}")
    write_owner(str(run), "i")
    write_restart_counts(str(run), {"engine": 1})
    assert victim.read_text() == "precious\n"
    for name in ("config.json", "owner.json", "restarts.json"):
        st = os.lstat(run / name)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, name


def test_a_beacon_never_opens_a_planted_symlink(tmp_path):
    victim = _victim(tmp_path)
    run = tmp_path / "run"
    (run / "watchdog").mkdir(parents=True, mode=0o700)
    os.chmod(run, 0o700)
    os.symlink(victim, run / "watchdog" / f"engine-{os.getpid()}.beat")
    with pytest.raises(OSError):
        Beacon(str(run), "engine")
    assert victim.read_text() == "precious\n"


def test_a_beacon_refuses_an_open_runtime_folder_and_makes_a_missing_one_private(tmp_path):
    open_run = tmp_path / "open"
    open_run.mkdir()
    os.chmod(open_run, 0o777)
    with pytest.raises(UnsafeFolderError):
        Beacon(str(open_run), "engine")
    assert not (open_run / "watchdog").exists()
    fresh = tmp_path / "fresh"
    b = Beacon(str(fresh), "frontend-0")
    assert _mode(fresh) == 0o700 and _mode(fresh / "watchdog") == 0o700
    assert _mode(b.path) == 0o600


@pytest.fixture
def short_dir():
    """A private folder with a short path (a unix socket address inside must fit)."""
    d = tempfile.mkdtemp(prefix="kxdg-", dir="/tmp")
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)


def test_xdg_runtime_dir_is_the_base_only_when_it_is_a_private_folder_of_this_user(
        tmp_path, short_dir):
    xdg = short_dir
    assert runtime_base(str(xdg)) == str(xdg)
    cfg = build_config({"instance_id": "abc"}, env={"XDG_RUNTIME_DIR": str(xdg)})
    assert cfg.runtime_dir == str(xdg / "kestrel-abc") and cfg.source("runtime_dir") == "derived"
    assert cfg.watchdog_dump_dir == str(xdg / "kestrel-abc-dumps")
    assert cfg.engine_address == f"ipc://{xdg}/kestrel-abc/engine.sock"
    os.chmod(xdg, 0o755)
    assert runtime_base(str(xdg)) == DEFAULT_BASE
    os.chmod(xdg, 0o700)
    os.chown(xdg, NOBODY, NOBODY)
    assert runtime_base(str(xdg)) == DEFAULT_BASE
    assert runtime_base(str(tmp_path / "missing")) == DEFAULT_BASE
    assert runtime_base("relative/dir") == DEFAULT_BASE
    assert runtime_base(None) == DEFAULT_BASE
    deep = tmp_path / ("d" * MAX_BASE_LEN)  # private, but too long for the socket paths
    deep.mkdir(mode=0o700)
    assert runtime_base(str(deep)) == DEFAULT_BASE
    cfg = build_config({"instance_id": "abc"}, env={})
    assert cfg.runtime_dir == "/tmp/kestrel-abc" and cfg.watchdog_dump_dir == "/tmp/kestrel-abc-dumps"
