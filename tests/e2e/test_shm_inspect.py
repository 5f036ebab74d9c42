"""`kestrel shm` against a live `kestrel serve`: `inspect` shows the plan ring moving while a
streaming request runs, and `clean` removes a stale segment (its writer SIGKILLed) but never
a live one. Every command runs as a user runs it: the `kestrel` executable, as a subprocess."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from tests.e2e.server import KESTREL, KestrelServer

pytestmark = pytest.mark.timeout(300)


def shm(*args: str) -> str:
    r = subprocess.run([KESTREL, "shm", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"kestrel shm {' '.join(args)}: {r.returncode}\n{r.stdout}{r.stderr}"
    return r.stdout


def parse_inspect(text: str) -> dict:
    """The fields of `kestrel shm inspect` output this test relies on (format_inspect)."""
    write_seq = int(re.search(r"^\s*write seq\s+(\d+)", text, re.M).group(1))
    writer = re.search(r"^\s*writer\s+pid (\d+) \((\w+)\)", text, re.M)
    readers = [(int(m.group(1)), int(m.group(2)), int(m.group(3)))
               for m in re.finditer(r"^\s{4}(\d+)\s+\S+\s+(\d+)\s+(-?\d+)\s", text, re.M)]
    return {"write_seq": write_seq, "writer_pid": int(writer.group(1)),
            "writer_state": writer.group(2), "readers": readers}


@pytest.fixture(scope="module")
def server(smollm2_dir):
    srv = KestrelServer(str(smollm2_dir))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_inspect_shows_plan_ring_sequence_numbers_advancing_during_a_stream(server):
    name = f"kestrel-{server.instance_id}-plan"
    idle = parse_inspect(shm("inspect", name))
    assert idle["writer_state"] == "alive" and idle["readers"], idle
    assert all(lag >= 0 for _, _, lag in idle["readers"])

    done = threading.Event()
    tokens: list[str] = []
    errors: list[BaseException] = []

    def stream():
        body = {"model": "SmolLM2-135M-Instruct", "stream": True, "max_tokens": 96,
                "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Tell me a long story about a falcon."}]}
        try:
            with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body,
                              timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        tokens.append(line)
        except BaseException as e:  # reported by the main thread
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    samples = []
    deadline = time.monotonic() + 120
    while not done.is_set() and time.monotonic() < deadline:
        samples.append(parse_inspect(shm("inspect", name)))
    t.join(10)
    assert not errors, errors
    assert len(tokens) > 20, f"the stream ended early: {len(tokens)} events"
    after = parse_inspect(shm("inspect", name))

    seqs = [s["write_seq"] for s in samples]
    assert seqs == sorted(seqs), f"write seq went backwards: {seqs}"
    assert len(set(seqs)) >= 3, f"write seq did not move while the stream ran: {seqs}"
    assert after["write_seq"] >= seqs[-1] > idle["write_seq"]
    # Reader 0 (the worker) follows the writer: its read seq moves too, and its lag is the
    # distance to the writer (never negative, never more than the ring holds).
    reads = [s["readers"][0][1] for s in samples]
    assert len(set(reads)) >= 3, f"reader 0's read seq did not move: {reads}"
    for s in samples:
        for _, read_seq, lag in s["readers"]:
            assert 0 <= lag <= s["write_seq"] and read_seq <= s["write_seq"], s


def _planted_orphan_ring(instance_id: str, runtime_dir: str) -> str:
    """Create `kestrel-<instance>-orphan` from a child process, then SIGKILL the child, so
    the ring keeps its real header and a dead writer pid (nothing unlinks it)."""
    name = f"kestrel-{instance_id}-orphan"
    code = ("import sys, time\n"
            "from shared.shm_ring import ShmRingWriter\n"
            f"w = ShmRingWriter({name!r}, n_readers=1, n_chunks=4, chunk_size=256, "
            f"runtime_dir={runtime_dir!r}, instance_id={instance_id!r})\n"
            "print('ready', flush=True)\n"
            "time.sleep(120)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    return name


def test_clean_removes_a_stale_ring_but_not_the_live_ones(server):
    live_before = {n for n in os.listdir("/dev/shm") if n.startswith(f"kestrel-{server.instance_id}-")}
    assert f"kestrel-{server.instance_id}-plan" in live_before
    orphan = _planted_orphan_ring(server.instance_id, tempfile.mkdtemp(prefix="krun-"))
    assert os.path.exists(f"/dev/shm/{orphan}")

    rows = {line.split()[0]: line for line in shm("ls", "--instance", server.instance_id).splitlines()[1:]}
    assert "dead" in rows[orphan] and "stale" in rows[orphan], rows[orphan]
    for n in live_before:
        assert "alive" in rows[n] and "stale" not in rows[n], rows[n]
    assert "dead" in shm("inspect", orphan).split("writer", 1)[1].splitlines()[0]

    out = shm("clean", "--instance", server.instance_id)
    assert f"removed {orphan}" in out and "1 stale segment(s) removed" in out, out
    assert not os.path.exists(f"/dev/shm/{orphan}")
    left = {n for n in os.listdir("/dev/shm") if n.startswith(f"kestrel-{server.instance_id}-")}
    assert left == live_before
    # The live server is undisturbed: a request still completes.
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Hello!"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
