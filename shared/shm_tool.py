"""`kestrel shm`: list, inspect, watch and clean Kestrel's /dev/shm segments (docs/ARCHITECTURE.md §3).

Every function here only reads segments with plain file reads (never maps or attaches as a
reader, never writes a live ring); `clean` / `sweep_stale` unlink segments whose creator is
dead, and `clean` also removes the runtime folders of dead instances (shared/runtime_dir.py).
A segment is judged from the common preamble described in `shared.shm_ring`: a segment
whose magic does not start with b"KSTR" has kind "unknown" and is never removed.
"""

from __future__ import annotations

import argparse
import glob
import os
import struct
import sys
import time
from dataclasses import dataclass
from typing import TextIO

from shared.shm_layout import PREAMBLE, SHM_DIR, RingHeader, owner_alive, read_header, shm_path

PREFIX = "kestrel-"


@dataclass
class SegmentInfo:
    """One /dev/shm/kestrel-* segment: size in bytes; owner_alive None when unknown (no
    preamble, or the owner runs in another pid namespace); stale only when the owner is dead."""
    name: str
    path: str
    kind: str
    instance_id: str
    owner_pid: int
    owner_alive: bool | None
    size: int
    inode: int
    detail: str = ""      # kind-specific occupancy, e.g. a kvpool's slots used/free

    @property
    def stale(self) -> bool:
        """Its owner is known to be dead (an unknown owner is not stale)."""
        return self.owner_alive is False


def _read_preamble(path: str) -> SegmentInfo:
    """SegmentInfo of one segment. Raises FileNotFoundError if it vanished meanwhile."""
    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())
        raw = fh.read(PREAMBLE.size)
    name = os.path.basename(path)
    if len(raw) == PREAMBLE.size and raw[:4] == b"KSTR":
        _, _, _, pid, pidns, created, kind, inst = PREAMBLE.unpack(raw)
        kind_s = kind.rstrip(b"\0").decode("utf-8", "replace") or "unknown"
        detail = ""
        if kind_s == "kvpool":   # slots used/free (shared/kv_pool.py header, offset 72)
            with open(path, "rb") as fh:
                pool = fh.read(112)
            if len(pool) == 112:
                n_slots, = struct.unpack_from("<I", pool, 72)
                used, free = struct.unpack_from("<QQ", pool, 96)
                detail = f"slots {used} used / {free} free of {n_slots}"
        return SegmentInfo(name, path, kind_s, inst.rstrip(b"\0").decode("utf-8", "replace"),
                           pid, owner_alive(pid, pidns, created), st.st_size, st.st_ino, detail)
    return SegmentInfo(name, path, "unknown", "", 0, None, st.st_size, st.st_ino)


def list_segments(instance_id: str | None = None) -> list[SegmentInfo]:
    """Every /dev/shm/kestrel-* segment (of one instance if `instance_id` is given), by name."""
    pattern = PREFIX + (f"{instance_id}-" if instance_id else "") + "*"
    out = []
    for path in sorted(glob.glob(os.path.join(SHM_DIR, pattern))):
        try:
            out.append(_read_preamble(path))
        except (FileNotFoundError, PermissionError):
            continue
    return out


def sweep_stale(instance_id: str | None = None) -> list[str]:
    """Unlink the stale segments (owner dead) of one instance, or of all; returns their names.

    A live segment, one of unknown kind, or one whose owner is in another pid namespace is
    never removed. Before unlinking, the path is re-checked to be the same file (inode) that
    was judged stale, so a ring recreated under the same name meanwhile survives.
    """
    removed = []
    for seg in list_segments(instance_id):
        if not seg.stale:
            continue
        try:
            if os.stat(seg.path).st_ino != seg.inode:
                continue
            os.unlink(seg.path)
            removed.append(seg.name)
        except FileNotFoundError:
            continue
    return removed


def _state(seg: SegmentInfo) -> str:
    return {True: "alive", False: "dead", None: "?"}[seg.owner_alive]


def format_ls(segs: list[SegmentInfo]) -> str:
    """A table: name, kind, owner pid, alive/dead/?, size in bytes, `stale` flag, detail
    (a kvpool's slots used/free)."""
    rows = [("NAME", "KIND", "PID", "OWNER", "BYTES", "", "")]
    for s in segs:
        rows.append((s.name, s.kind, str(s.owner_pid or "-"), _state(s), str(s.size),
                     "stale" if s.stale else "", s.detail))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def format_inspect(h: RingHeader, now: float | None = None) -> str:
    """The ring header, per-reader read seq / lag / last-seen age, chunks in use."""
    now = time.time() if now is None else now
    alive = {True: "alive", False: "dead", None: "?"}[owner_alive(h.writer_pid, h.writer_pidns, h.created)]
    lines = [
        f"{os.path.basename(h.path)}  kind={h.kind}  layout=v{h.version}  bytes={h.segment_bytes}",
        f"  instance     {h.instance_id}",
        f"  writer       pid {h.writer_pid} ({alive}), state {h.writer_state}, "
        f"created {now - h.created:.1f} s ago",
        f"  chunks       {h.n_chunks} x {h.chunk_size} bytes (stride {h.chunk_stride}), "
        f"in use {h.chunks_in_use}/{h.n_chunks}",
        f"  write seq    {h.write_seq}",
        f"  last type    {h.last_msg_type or '-'}",
        f"  readers      {h.n_readers}",
        "    idx  pid      read_seq  lag      last_seen",
    ]
    for r in h.readers:
        seen = f"{now - r.last_seen:.2f} s ago" if r.last_seen else "never"
        lines.append(f"    {r.index:<4} {r.pid or '-':<8} {r.read_seq:<9} {h.lag(r.index):<8} {seen}")
    return "\n".join(lines)


def format_pool(seg: SegmentInfo) -> str:
    """A kvstore pool (kind kvpool: the KV blocks' or a hybrid's state checkpoints'): owner,
    size and slots used/free (it has no readers or chunks)."""
    return "\n".join([
        f"{seg.name}  kind={seg.kind}  bytes={seg.size}",
        f"  instance     {seg.instance_id}",
        f"  owner        pid {seg.owner_pid} ({_state(seg)})",
        f"  {seg.detail or 'slots        ?'}",
    ])


def _inspect(name: str, out: TextIO) -> int:
    try:
        seg = _read_preamble(shm_path(name))
        if seg.kind == "kvpool":
            out.write(format_pool(seg) + "\n")
            return 0
        out.write(format_inspect(read_header(shm_path(name))) + "\n")
    except FileNotFoundError:
        print(f"kestrel shm: no segment {shm_path(name)}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"kestrel shm: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str], out: TextIO | None = None) -> int:
    """Run `kestrel shm ls | inspect NAME | watch NAME [--interval S] | clean [--instance ID]`.

    Returns the exit status: 0 ok, 1 segment missing or not a ring, 2 bad usage.
    """
    out = sys.stdout if out is None else out
    p = argparse.ArgumentParser(prog="kestrel shm", description="Kestrel shared-memory segments")
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list segments, owner pid, liveness, size, stale flag")
    ls.add_argument("--instance", default=None, help="only this instance id")
    ins = sub.add_parser("inspect", help="show a ring's header, reader lag, chunks in use "
                         "(a kvstore pool's owner and slots)")
    ins.add_argument("name", help="segment name (kestrel-<instance>-<ring>) or path")
    w = sub.add_parser("watch", help="refresh `inspect` until Ctrl-C")
    w.add_argument("name")
    w.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    w.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)  # 0: forever (tests)
    cl = sub.add_parser("clean", help="remove stale segments and runtime folders (owner dead); "
                        "never a live one")
    cl.add_argument("--instance", default=None, help="only this instance id")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if args.cmd == "ls":
        out.write(format_ls(list_segments(args.instance)) + "\n")
        return 0
    if args.cmd == "inspect":
        return _inspect(args.name, out)
    if args.cmd == "watch":
        n = 0
        try:
            while True:
                out.write("\x1b[H\x1b[2J" if out.isatty() else "\n")
                rc = _inspect(args.name, out)
                out.flush()
                n += 1
                if rc or (args.count and n >= args.count):
                    return rc
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0
    removed = sweep_stale(args.instance)
    for name in removed:
        out.write(f"removed {name}\n")
    out.write(f"{len(removed)} stale segment(s) removed\n")
    from shared.config import runtime_base
    from shared.runtime_dir import DEFAULT_BASE, sweep_dead_runtime_dirs

    dirs = [path for base in dict.fromkeys([DEFAULT_BASE, runtime_base()])  # /tmp and $XDG_RUNTIME_DIR
            for path in sweep_dead_runtime_dirs(args.instance, base)]
    for path in dirs:
        out.write(f"removed {path}/\n")
    out.write(f"{len(dirs)} runtime folder(s) of dead instances removed\n")
    return 0
