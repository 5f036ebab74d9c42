"""An instance's runtime folder (`<base>/kestrel-<instance>/`: config.json, ipc sockets,
restarts.json, watchdog/, startup_report.json), the watchdog's dump folder, and the owner
record.

Private folders: the runtime folder holds the API key (config.json) and the sockets that
drive the engine, and its name is predictable (`--instance-id`), so it is never taken as
found. `private_dir` makes it with mkdir mode 0700, or accepts an existing one only when it
is a real folder (not a symlink: opened with O_NOFOLLOW|O_DIRECTORY and fstat'ed) owned by
this process's effective uid with no group or other bits in its mode; anything else raises
`UnsafeFolderError`, which `kestrel serve` reports (exit 2) before it writes anything. Files
inside are written through `write_private_file` (a new mkstemp file in the same folder,
renamed over the name: a planted symlink is replaced, never written through) or opened
with `open_private` (O_NOFOLLOW). The base is `$XDG_RUNTIME_DIR` when it is usable, else
/tmp (`runtime_base`, called by the config builder, which alone reads the environment).

`kestrel serve` creates the folder and writes `owner.json` into it: the supervisor's pid,
its start time (time.time() seconds) and pid namespace, and the instance id. The folder is
removed when serve stops; a supervisor killed with -9 cannot do that, so the next
`kestrel serve` and `kestrel shm clean` call `sweep_dead_runtime_dirs`, which removes the
folders whose recorded owner is dead. A folder without a readable owner record, one owned
by another user, a symlink, or one whose owner is alive or cannot be judged (another pid
namespace) is never removed.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import stat
import tempfile

import psutil

from shared.shm_layout import owner_alive

OWNER_FILE = "owner.json"
DEFAULT_BASE = "/tmp"
PREFIX = "kestrel-"
DUMPS_SUFFIX = "-dumps"  # the default dump folder: <base>/kestrel-<instance>-dumps
# longest base taken from $XDG_RUNTIME_DIR: the ipc socket paths inside the runtime folder
# (`<base>/kestrel-<id>/kestrel-<id>-plan-notify.sock`) must stay under the ~107 bytes of a
# unix socket address
MAX_BASE_LEN = 48


class UnsafeFolderError(OSError):
    """A folder Kestrel would write into is not private to this user. path: the folder;
    problem: what is wrong (a symlink, another owner, group/other mode bits, not a folder)."""

    def __init__(self, path: str, problem: str):
        super().__init__(errno.EPERM, f"refusing the folder {path}: {problem}; remove it, or "
                         "choose another with --runtime-dir / --watchdog-dump-dir")
        self.path, self.problem = path, problem

    def __str__(self) -> str:
        return str(self.args[1])


def private_problem(path: str) -> str | None:
    """Why the existing folder `path` is not private (None when it is): it is a symlink or
    not a folder, it is owned by another uid than this process's effective uid, or its mode
    has group or other bits. Raises FileNotFoundError when it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "it is a symlink"
        if e.errno == errno.ENOTDIR:
            return "it is a symlink or not a folder" if os.path.islink(path) else "it is not a folder"
        raise
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o077:
        return (f"its mode is {stat.S_IMODE(st.st_mode):04o}, open to group or others "
                "(it must be 0700)")
    return None


def private_dir(path: str) -> bool:
    """Make the folder `path` private to this user, or check that it already is.

    Missing parents are created (os.makedirs, mode 0700 for the leaf only); the folder itself
    is created with mkdir mode 0700. An existing folder must pass `private_problem`.
    Returns True when this call created the folder, False when it was there.
    Raises UnsafeFolderError naming the path and the problem; OSError when it cannot be
    created."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        created = False
    problem = private_problem(path)
    if problem is not None:
        raise UnsafeFolderError(path, problem)
    return created


def open_private(path: str, flags: int) -> int:
    """os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, 0o600): a file descriptor, never
    through a symlink. Raises OSError (ELOOP when `path` is a symlink)."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def write_private_file(folder: str, name: str, data: str | bytes) -> str:
    """Write `data` to `<folder>/<name>`, mode 0600, atomically: a new file made by mkstemp
    (O_EXCL) in `folder`, renamed over the name, so a symlink planted there is replaced and
    never written through. Returns the path. Raises OSError when the folder is not
    writable."""
    path = os.path.join(folder, name)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def runtime_base(xdg_runtime_dir: str | None) -> str:
    """Where runtime folders go: `xdg_runtime_dir` ($XDG_RUNTIME_DIR, passed by the config
    builder) when it is usable (an absolute path of at most MAX_BASE_LEN characters to a
    private folder of this user, `private_problem` None, writable), else DEFAULT_BASE."""
    if not xdg_runtime_dir or not os.path.isabs(xdg_runtime_dir) or \
            len(xdg_runtime_dir) > MAX_BASE_LEN:
        return DEFAULT_BASE
    try:
        if private_problem(xdg_runtime_dir) is None and \
                os.access(xdg_runtime_dir, os.W_OK | os.X_OK):
            return xdg_runtime_dir
    except OSError:
        pass
    return DEFAULT_BASE


def remove_if_empty(path: str) -> None:
    """Remove the folder `path` if it is empty (an unused dump folder); never raises."""
    try:
        os.rmdir(path)
    except OSError:
        pass


def _pidns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino & 0xFFFFFFFF
    except OSError:
        return 0


def write_owner(runtime_dir: str, instance_id: str) -> None:
    """Record this process as the owner of `runtime_dir` (`write_private_file`: atomic,
    mode 0600, never through a symlink). Raises OSError if the folder cannot be written."""
    rec = {"pid": os.getpid(), "created": psutil.Process().create_time(), "pidns": _pidns(),
           "instance_id": instance_id}
    write_private_file(runtime_dir, OWNER_FILE, json.dumps(rec))


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
    given) whose recorded owner is dead, with their dump folder `<path>-dumps` when it is
    empty; returns their paths. Never raises for one folder that cannot be judged or
    removed: it is skipped."""
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
            remove_if_empty(path + DUMPS_SUFFIX)
    return removed
