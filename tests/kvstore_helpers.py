"""Start `kestrel kvstore` as a user would (a subprocess) and talk to it, for the kvstore tests."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from shared.kvstore_client import KVStoreClient
from shared.hashing import hash_block_chain, model_identity_hash

REPO = pathlib.Path(__file__).resolve().parent.parent
BLOCK = 4096           # bytes per block in these tests
FILE = 96 + BLOCK      # bytes of one disk block file (header + payload)
GIB = 1 << 30


def identity(model: str) -> bytes:
    """What the store should derive for `--model model --dtype float32 --block-size 16`."""
    return model_identity_hash(os.path.abspath(model), "float32", "float32", 16, 1)


def chain(model: str, n: int, salt: int = 0) -> list[bytes]:
    """n chained block names of a made-up prompt."""
    return hash_block_chain(identity(model), [salt * 100_000 + i for i in range(16 * n)], 16)


def payload(h: bytes) -> bytes:
    """Deterministic block bytes derived from the block's name."""
    return (h * (BLOCK // len(h) + 1))[:BLOCK]


class Store:
    """One `kestrel kvstore` subprocess; `client()` opens sessions; `stop()` sends SIGTERM."""

    def __init__(self, slots: int, disk_dir: str | None = None, disk_blocks: int = 0,
                 model: str = "/nonexistent/model-a", instance: str | None = None,
                 runtime_dir: str | None = None, extra: tuple = ()):
        self.model, self.instance = model, instance or "kvt" + uuid.uuid4().hex[:6]
        self.runtime_dir = runtime_dir or tempfile.mkdtemp(prefix="kvs-")
        self.address = f"ipc://{self.runtime_dir}/kvstore.sock"
        self.args = store_args(self.instance, self.runtime_dir, model, slots, disk_dir, disk_blocks, extra)
        self.proc = subprocess.Popen(self.args, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.clients: list[KVStoreClient] = []

    def client(self, client_id: str = "engine", model: str | None = None,
               block_bytes: int = BLOCK, connect: bool = True,
               state: tuple[bytes, int] = (b"", 0)) -> KVStoreClient:
        """A session; state: (state identity, state bytes) of a hybrid model's store."""
        c = KVStoreClient(self.address, client_id, identity(model or self.model), block_bytes,
                          timeout_s=15.0, state_identity=state[0], state_bytes=state[1])
        self.clients.append(c)
        if connect:
            c.connect()
        return c

    def stop(self, timeout: float = 15.0) -> int:
        for c in self.clients:
            c.close(bye=False)
        self.clients.clear()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


def store_args(instance: str, runtime_dir: str, model: str, slots: int,
               disk_dir: str | None = None, disk_blocks: int = 0, extra: tuple = ()) -> list[str]:
    args = [sys.executable, "-m", "services.cli", "kvstore", "--instance-id", instance,
            "--runtime-dir", runtime_dir, "--model", model, "--dtype", "float32",
            "--block-size", "16", "--kv-offload-block-bytes", str(BLOCK),
            "--kv-offload-cpu-gib", repr(slots * BLOCK / GIB), "--log-level", "WARNING"]
    if disk_dir:
        args += ["--kv-offload-disk-dir", disk_dir, "--kv-offload-disk-gib", repr(disk_blocks * FILE / GIB)]
    return args + list(extra)


def store_blocks(c: KVStoreClient, hashes: list[bytes]) -> list[int]:
    """prepare + write payload(h) into each slot + complete; returns the slots (-1 skipped)."""
    pool = c.attach_pool()
    slots = c.prepare_store(hashes).slots
    for h, s in zip(hashes, slots):
        if s >= 0:
            pool.slot(s)[:] = payload(h)
    got = [s for s in slots if s >= 0]
    if got:
        assert c.complete_store(got) == len(got)
    return slots


def load_blocks(c: KVStoreClient, hashes: list[bytes]) -> list[bytes]:
    """reserve, copy out, complete; returns the bytes of the reserved run."""
    pool = c.attach_pool()
    slots = c.reserve_load(hashes)
    out = [bytes(pool.slot(s)) for s in slots]
    if slots:
        assert c.complete_load(slots) == len(slots)
    return out


def wait_for(pred, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
