"""The runtime folders of this test session: the instance ids its servers use, and which
`kestrel-*` folders the session left behind (the session fixture in tests/conftest.py fails
on any).

Only folders that are this session's are counted, so servers of other sessions running at
the same time never make it fail: folders of instance ids registered here (`new_instance_id`,
used by tests/e2e/server.py and the frontend stacks), and folders whose beacons were made by
this pytest process itself (an in-process frontend or engine), that were not there when the
session started."""

from __future__ import annotations

import glob
import os
import uuid

from shared.config import runtime_base
from shared.runtime_dir import DEFAULT_BASE, DUMPS_SUFFIX, PREFIX

OUR_INSTANCE_IDS: set[str] = set()


def new_instance_id(prefix: str = "t") -> str:
    """A fresh instance id (`prefix` + 8 hex digits), registered as this session's."""
    iid = prefix + uuid.uuid4().hex[:8]
    OUR_INSTANCE_IDS.add(iid)
    return iid


def runtime_folders() -> set[str]:
    """Every `kestrel-*` folder under /tmp and the runtime base ($XDG_RUNTIME_DIR)."""
    out: set[str] = set()
    for base in {DEFAULT_BASE, runtime_base()}:
        out.update(p for p in glob.glob(os.path.join(base, PREFIX + "*")) if os.path.isdir(p))
    return out


def _ours(path: str, pid: int) -> bool:
    name = os.path.basename(path)[len(PREFIX):]
    iid = name[:-len(DUMPS_SUFFIX)] if name.endswith(DUMPS_SUFFIX) else name
    if iid in OUR_INSTANCE_IDS:
        return True
    try:
        beacons = os.listdir(os.path.join(path, "watchdog"))
    except OSError:
        return False
    return any(n.rsplit(".", 1)[0].endswith(f"-{pid}") for n in beacons)


def left_behind(before: set[str], pid: int | None = None) -> list[str]:
    """This session's runtime and dump folders that exist now and not in `before`.
    pid: the pytest process (default this one)."""
    pid = os.getpid() if pid is None else pid
    return sorted(p for p in runtime_folders() - before if _ours(p, pid))
