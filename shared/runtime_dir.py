"""An instance's runtime folder (`/tmp/kestrel-<instance>/`: config.json, ipc sockets,
restarts.json, watchdog/, startup_report.json) and its owner record.

`kestrel serve` creates the folder and writes `owner.json` into it: the supervisor's pid,
its start time (time.time() seconds) and pid namespace, and the instance id. The folder is
removed when serve stops; a supervisor killed with -9 cannot do that, so the next
`kestrel serve` and `kestrel shm clean` call `sweep_dead_runtime_dirs`, which removes the
folders whose recorded owner is dead. A folder without a readable owner record, one owned
by another user, a symlink, or one whose owner is alive or cannot be judged (another pid
namespace) is never removed.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import psutil

from shared.shm_layout import owner_alive

OWNER_FILE = "owner.json"
DEFAULT_BASE = "/tmp"
PREFIX = "kestrel-"


def _pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino & 0xFFFFFFFF
    except OSError:
        return 0


def write_owner(runtime_dir: str, instance_id: str) -> None:
    """Record this process as the owner of `runtime_dir` (atomically, mode 0600).
    Raises OSError if the folder cannot be written."""
    rec = {"pid": os.getpid(), "created": psutil.Process().create_time(), "pidns": _pidns(),
           "instance_id": instance_id}
    path = os.path.join(runtime_dir, OWNER_FILE)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(rec, fh)
    os.replace(tmp, path)


def read_owner(runtime_dir: str) -> dict | None:
    """The owner record of `runtime_dir`, or None when there is none or it is unreadable."""
    try:
        with open(os.path.join(runtime_dir, OWNER_FILE)) as fh:
            rec = json.load(fh)
        return rec if isinstance(rec.get("pid"), int) else None
    except (OSError, ValueError, AttributeError):
        return None


def owner_is_dead(runtime_dir: str) -> bool:
    """True only when `runtime_dir` has an owner record and that process is gone (dead,
    a zombie, or its pid reused by a process started later)."""
    rec = read_owner(runtime_dir)
    if rec is None:
        return False
    return owner_alive(rec["pid"], int(rec.get("pidns") or 0),
                       float(rec.get("created") or 0.0)) is False


def sweep_dead_runtime_dirs(instance_id: str | None = None,
                            base: str = DEFAULT_BASE) -> list[str]:
    """Remove the runtime folders `<base>/kestrel-*` (of one instance if `instance_id` is
    given) whose recorded owner is dead; returns their paths. Never raises for one folder
    that cannot be judged or removed: it is skipped."""
    removed = []
    pattern = os.path.join(base, PREFIX + (instance_id if instance_id else "*"))
    for path in sorted(glob.glob(pattern)):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
            continue
        if not owner_is_dead(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed
