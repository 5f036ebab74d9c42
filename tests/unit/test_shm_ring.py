"""The shared-memory ring (shared/shm_ring.py) and `kestrel shm` (shared/shm_tool.py)."""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

from shared import shm_tool
from shared.config import ring_name
from shared.shm_layout import read_header
from shared.shm_ring import RingClosed, ShmRingReader, ShmRingWriter

pytestmark = pytest.mark.timeout(60)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def payload_for(i: int, big_every: int = 0, chunk_size: int = 0) -> bytes:
    """Deterministic message i: random bytes of a varying length, some larger than a chunk."""
    rng = random.Random(i)
    n = chunk_size * 3 + rng.randrange(100) if big_every and i % big_every == 0 else rng.randrange(1, 400)
    return i.to_bytes(4, "little") + rng.randbytes(n)


def digest(payloads) -> str:
    h = hashlib.sha256()
    for p in payloads:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


def wait_for(pred, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def run_py(code: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


@pytest.fixture
def env():
    """A unique instance id and a short runtime dir (AF_UNIX paths are limited to ~107 bytes);
    removes whatever segments and sockets the test left."""
    inst = "t" + uuid.uuid4().hex[:10]
    rdir = tempfile.mkdtemp(prefix="kr", dir="/tmp")
    yield inst, rdir
    for p in glob.glob(f"/dev/shm/kestrel-{inst}-*"):
        os.unlink(p)
    shutil.rmtree(rdir, ignore_errors=True)


def test_wrap_around_delivers_every_message_in_order_byte_for_byte(env):
    inst, rdir = env
    name, n = ring_name(inst, "plan"), 3000
    with ShmRingWriter(name, 1, 4, 512, rdir, inst) as w:
        r = ShmRingReader(name, 0, rdir)
        got = []
        t = threading.Thread(target=lambda: got.extend(r.read(timeout=10) for _ in range(n)))
        t0 = time.monotonic()
        t.start()
        seqs = [w.write(payload_for(i), "step") for i in range(n)]
        t.join(20)
        assert not t.is_alive()
        # ~0.3 s normally; each lost wake-up costs the reader a 0.1 s safety slice
        assert time.monotonic() - t0 < 5.0
        assert seqs == list(range(1, n + 1))
        assert got == [payload_for(i) for i in range(n)]
        assert r.read(timeout=0.05) is None
        h = read_header(name)
        assert h.write_seq == n and h.readers[0].read_seq == n and h.chunks_in_use == 0
        r.close()


READER_PROC = """
import sys, hashlib
from shared.shm_ring import ShmRingReader
name, idx, rdir, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
r = ShmRingReader(name, idx, rdir)
h = hashlib.sha256()
for _ in range(n):
    p = r.read(timeout=20)
    assert p is not None, "timed out"
    h.update(len(p).to_bytes(8, "little")); h.update(p)
extra = r.read(timeout=0.2)
print(h.hexdigest(), "END" if extra is None else "EXTRA", flush=True)
"""


def test_three_reader_processes_each_get_every_message_in_order(env):
    inst, rdir = env
    name, n, chunk = ring_name(inst, "plan"), 600, 1024
    payloads = [payload_for(i, big_every=50, chunk_size=chunk) for i in range(n)]
    with ShmRingWriter(name, 3, 8, chunk, rdir, inst) as w:
        procs = [run_py(READER_PROC, name, str(i), rdir, str(n)) for i in range(3)]
        try:
            for p in payloads:
                w.write(p, "step", timeout=30)
            outs = [p.communicate(timeout=30) for p in procs]
        finally:
            for p in procs:
                p.kill()
    for (out, err), p in zip(outs, procs):
        assert p.returncode == 0, err
        assert out.split() == [digest(payloads), "END"]


def test_slow_reader_blocks_writer_until_it_reads(env):
    inst, rdir = env
    name = ring_name(inst, "plan")
    with ShmRingWriter(name, 2, 2, 64, rdir, inst) as w, \
            ShmRingReader(name, 0, rdir) as fast, ShmRingReader(name, 1, rdir) as slow:
        w.write(b"m1"), w.write(b"m2")
        assert fast.read(1) == b"m1" and fast.read(1) == b"m2"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"readers \[1\]"):
            w.write(b"m3", timeout=0.2)
        assert time.monotonic() - t0 >= 0.2
        result = []
        t = threading.Thread(target=lambda: result.append(w.write(b"m3", timeout=10)))
        t.start()
        t.join(0.2)
        assert t.is_alive() and result == []          # still waiting on the slow reader
        assert slow.read(1) == b"m1"                  # frees chunk 0
        t.join(5)
        assert result == [3]
        assert slow.read(1) == b"m2" and slow.read(1) == b"m3" and fast.read(1) == b"m3"


def test_overflow_messages_go_over_side_channel_and_wait_for_late_reader(env):
    inst, rdir = env
    name = ring_name(inst, "plan")
    sizes = [100, 5000, 256, 257, 0, 200_000, 3]
    msgs = [random.Random(s).randbytes(s) for s in sizes]
    with ShmRingWriter(name, 1, 8, 256, rdir, inst) as w:
        for m in msgs:                      # all written before the reader attaches
            w.write(m, "big" if len(m) > 256 else "small")
        h = read_header(name)
        assert [c.overflow for c in h.chunks[:len(msgs)]] == [s > 256 for s in sizes]
        assert [c.length for c in h.chunks[:len(msgs)]] == sizes
        with ShmRingReader(name, 0, rdir) as r:
            assert [r.read(timeout=5) for _ in msgs] == msgs
            for i in range(40):             # reuse chunks that held overflow payloads
                m = random.Random(i).randbytes(300 if i % 3 else 10)
                w.write(m)
                assert r.read(timeout=5) == m


HEADER_PROC = """
import json, sys
from shared.shm_layout import read_header
h = read_header(sys.argv[1])
print(json.dumps(dict(pid=h.writer_pid, inst=h.instance_id, kind=h.kind, n_chunks=h.n_chunks,
    chunk_size=h.chunk_size, n_readers=h.n_readers, write_seq=h.write_seq, last=h.last_msg_type,
    read_seqs=[r.read_seq for r in h.readers], reader_pids=[r.pid for r in h.readers],
    in_use=h.chunks_in_use, state=h.writer_state)))
"""


def test_header_read_from_another_process_matches_writer_and_byte_layout(env):
    inst, rdir = env
    name = ring_name(inst, "plan")
    with ShmRingWriter(name, 2, 5, 4096, rdir, inst) as w, ShmRingReader(name, 1, rdir) as r:
        for i in range(3):
            w.write(b"x" * i, "plan" if i < 2 else "step")
        assert r.read(1) == b""
        before = open(f"/dev/shm/{name}", "rb").read()
        out, err = run_py(HEADER_PROC, name).communicate(timeout=20)
        assert err == "", err
        assert json.loads(out) == dict(pid=os.getpid(), inst=inst, kind="ring", n_chunks=5,
                                       chunk_size=4096, n_readers=2, write_seq=3, last="step",
                                       read_seqs=[0, 1], reader_pids=[0, os.getpid()],
                                       in_use=3, state="open")
        assert open(f"/dev/shm/{name}", "rb").read() == before   # reading changed nothing
        # the documented byte layout, read without the module
        assert before[0:8] == b"KSTRRING"
        assert struct.unpack_from("<III", before, 8) == (1, 640, os.getpid())
        assert before[32:40].rstrip(b"\0") == b"ring" and before[40:72].rstrip(b"\0") == inst.encode()
        assert struct.unpack_from("<IIII", before, 72) == (5, 4096, 4160, 2)
        assert struct.unpack_from("<Q", before, 88) == (3,) and before[96:112].rstrip(b"\0") == b"step"
        assert struct.unpack_from("<Q", before, 128 + 32) == (1,)
        chunk0 = 640
        assert struct.unpack_from("<IxxxxQQ", before, chunk0) == (1, 1, 0)
        assert before[chunk0 + 24:chunk0 + 26] == b"\x00\x01"


WRITER_PROC = """
import sys, time
from shared.shm_ring import ShmRingWriter
w = ShmRingWriter(sys.argv[1], 1, 4, 256, sys.argv[2], sys.argv[3])
w.write(b"hello", "step")
print("ready", flush=True)
if sys.argv[4] == "sleep":
    time.sleep(60)
"""


def test_killed_writer_is_stale_and_clean_removes_only_stale(env):
    inst, rdir = env
    dead, live = ring_name(inst, "dead"), ring_name(inst, "live")
    proc = run_py(WRITER_PROC, dead, rdir, inst, "sleep")
    try:
        assert proc.stdout.readline().strip() == "ready"
        with ShmRingWriter(live, 1, 2, 64, rdir, inst):
            by_name = {s.name: s for s in shm_tool.list_segments(inst)}
            assert by_name[dead].owner_pid == proc.pid and not by_name[dead].stale
            proc.send_signal(signal.SIGKILL)            # not reaped yet: a zombie is dead too
            wait_for(lambda: {s.name: s for s in shm_tool.list_segments(inst)}[dead].stale,
                     what="dead writer shown stale")
            out = io.StringIO()
            assert shm_tool.main(["ls", "--instance", inst], out) == 0
            lines = {ln.split()[0]: ln.split() for ln in out.getvalue().splitlines()[1:]}
            assert lines[dead][1:4] == ["ring", str(proc.pid), "dead"] and lines[dead][-1] == "stale"
            assert lines[live][1:4] == ["ring", str(os.getpid()), "alive"] and "stale" not in lines[live]
            assert int(lines[live][4]) == os.path.getsize(f"/dev/shm/{live}")
            out = io.StringIO()
            assert shm_tool.main(["clean", "--instance", inst], out) == 0
            assert f"removed {dead}" in out.getvalue()
            assert not os.path.exists(f"/dev/shm/{dead}") and os.path.exists(f"/dev/shm/{live}")
            assert shm_tool.sweep_stale(inst) == []
            # a new writer may take over the name of a dead one
            proc2 = run_py(WRITER_PROC, dead, rdir, inst, "exit")
            assert proc2.communicate(timeout=20)[0].strip() == "ready"
    finally:
        proc.kill()
        proc.wait()


def test_blocked_reader_gets_ring_closed_when_writer_is_killed(env):
    inst, rdir = env
    name = ring_name(inst, "plan")
    proc = run_py(WRITER_PROC, name, rdir, inst, "sleep")
    try:
        assert proc.stdout.readline().strip() == "ready"
        with ShmRingReader(name, 0, rdir) as r:
            assert r.read(timeout=5) == b"hello"
            proc.kill()
            proc.wait()
            t0 = time.monotonic()
            with pytest.raises(RingClosed, match="gone"):
                r.read(timeout=5)
            assert time.monotonic() - t0 < 1.0
    finally:
        proc.kill()
        proc.wait()


def test_unknown_segment_is_listed_but_never_cleaned(env):
    inst, _ = env
    path = f"/dev/shm/kestrel-{inst}-junk"
    with open(path, "wb") as fh:
        fh.write(b"NOTMAGIC" + bytes(100))
    (seg,) = shm_tool.list_segments(inst)
    assert (seg.kind, seg.stale, seg.size) == ("unknown", False, 108)
    assert shm_tool.sweep_stale(inst) == [] and os.path.exists(path)


def test_inspect_and_watch_show_lag_and_chunks_in_use(env):
    inst, rdir = env
    name = ring_name(inst, "plan")
    with ShmRingWriter(name, 2, 4, 64, rdir, inst) as w, ShmRingReader(name, 0, rdir) as r:
        for i in range(3):
            w.write(b"p%d" % i, "step")
        r.read(1)
        out = io.StringIO()
        assert shm_tool.main(["inspect", name], out) == 0
        text = out.getvalue()
        assert "in use 3/4" in text and "write seq    3" in text and "last type    step" in text
        rows = [ln.split() for ln in text.splitlines() if ln.startswith("    ") and ln.split()[0].isdigit()]
        assert [(row[0], row[2], row[3]) for row in rows] == [("0", "1", "2"), ("1", "0", "3")]
        out = io.StringIO()
        assert shm_tool.main(["watch", name, "--interval", "0.01", "--count", "2"], out) == 0
        assert out.getvalue().count("in use 3/4") == 2
    assert shm_tool.main(["inspect", name], io.StringIO()) == 1


def test_idle_blocked_reader_uses_almost_no_cpu(env):
    inst, rdir = env
    name = ring_name(inst, "plan")
    with ShmRingWriter(name, 1, 4, 64, rdir, inst), ShmRingReader(name, 0, rdir) as r:
        wall, cpu = time.monotonic(), time.process_time()
        assert r.read(timeout=1.0) is None
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        assert wall >= 1.0 and cpu < 0.2, (wall, cpu)
        assert time.time() - read_header(name).readers[0].last_seen < 0.5


def test_blocked_reader_wakes_on_write_from_another_thread(env):
    inst, rdir = env
    name = ring_name(inst, "plan")
    with ShmRingWriter(name, 1, 4, 64, rdir, inst) as w, ShmRingReader(name, 0, rdir) as r:
        got = []
        t = threading.Thread(target=lambda: got.append(r.read(timeout=10)))
        t.start()
        wait_for(lambda: read_header(name).readers[0].last_seen > 0)
        w.write(b"wake")
        t.join(5)
        assert got == [b"wake"]


def test_close_unlinks_segment_and_sockets_and_ends_readers(env):
    inst, rdir = env
    name = ring_name(inst, "plan")
    w = ShmRingWriter(name, 1, 4, 64, rdir, inst)
    r = ShmRingReader(name, 0, rdir)
    assert os.path.exists(f"/dev/shm/{name}") and len(os.listdir(rdir)) == 2
    w.write(b"last")
    w.close()
    w.close()                                   # idempotent
    assert not os.path.exists(f"/dev/shm/{name}") and os.listdir(rdir) == []
    assert r.read(timeout=1) == b"last"         # what was written is still delivered
    with pytest.raises(RingClosed):
        r.read(timeout=1)
    r.close()
    with pytest.raises(FileNotFoundError):
        ShmRingReader(name, 0, rdir)
    with pytest.raises(ValueError):
        w.write(b"x")


@pytest.mark.parametrize("how", ["exit", "sigterm"])
def test_creator_process_unlinks_on_exit_and_sigterm(env, how):
    inst, rdir = env
    name = ring_name(inst, "plan")
    proc = run_py(WRITER_PROC, name, rdir, inst, "sleep" if how == "sigterm" else "exit")
    assert proc.stdout.readline().strip() == "ready"
    if how == "sigterm":
        assert os.path.exists(f"/dev/shm/{name}")
        proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=20)
    assert proc.returncode == (-signal.SIGTERM if how == "sigterm" else 0)
    assert not os.path.exists(f"/dev/shm/{name}")


def test_second_writer_of_a_live_ring_and_bad_reader_index_are_refused(env):
    inst, rdir = env
    name = ring_name(inst, "plan")
    with ShmRingWriter(name, 2, 4, 64, rdir, inst):
        with pytest.raises(FileExistsError):
            ShmRingWriter(name, 2, 4, 64, rdir, inst)
        with pytest.raises(ValueError):
            ShmRingReader(name, 2, rdir)
        assert os.path.exists(f"/dev/shm/{name}")


def test_reattached_reader_resumes_after_its_last_message(env):
    inst, rdir = env
    name = ring_name(inst, "plan")
    with ShmRingWriter(name, 1, 4, 64, rdir, inst) as w:
        for i in range(4):
            w.write(b"m%d" % i)
        with ShmRingReader(name, 0, rdir) as r:
            assert [r.read(1), r.read(1)] == [b"m0", b"m1"]
        with ShmRingReader(name, 0, rdir) as r:
            assert [r.read(1), r.read(1)] == [b"m2", b"m3"]


def test_inspect_and_watch_show_a_kvstore_pool_listed_by_ls(env):
    """`kestrel shm ls` lists the kvstore's pool; `inspect` / `watch` on it used to fail with
    "not a version-1 ring (magic b'KSTRPOOL', version 1)"."""
    from services.kvstore.cpu_tier import OwnedPool
    inst, _ = env
    pool = OwnedPool.create(inst, 4, 128, bytes(32))
    try:
        name = f"kestrel-{inst}-kvpool"
        out = io.StringIO()
        assert shm_tool.main(["inspect", name], out) == 0
        text = out.getvalue()
        assert f"{name}  kind=kvpool" in text and f"pid {os.getpid()} (alive)" in text
        assert "slots 0 used / 4 free of 4" in text
        out = io.StringIO()
        assert shm_tool.main(["watch", name, "--interval", "0.01", "--count", "2"], out) == 0
        assert out.getvalue().count("slots 0 used / 4 free of 4") == 2
    finally:
        pool.close()
