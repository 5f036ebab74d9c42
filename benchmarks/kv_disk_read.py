"""Disk-tier read throughput of the kvstore's own code path, the part of a disk-tier hit's
TTFT that the kvstore controls.

Writes `--blocks` block files with `DiskTier.write` into a temporary folder, then promotes
them into a `KVPool` (shared memory, as the server does) with `DiskTier.read_into` on a
thread pool, in three ways:
- plain: read + crc32 into the slots;
- copy-new: each job first copies its slot into a new `bytes` (the old demotion copy) and
  queues a disk write of it;
- copy-staged: the same copy into a reused buffer from a pre-made set
  (`services.kvstore.server.STAGING_KEEP`), dropping the write when none is free (what the
  server does now).
Reports GB/s of reads for each, at each thread count, as JSON (stdout and --out).

    python benchmarks/kv_disk_read.py [--blocks 1400] [--block-bytes 1835008] [--threads 8 16]

1835008 bytes is a Qwen3-0.6B block of 16 tokens in bf16.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import emit_json  # noqa: E402
from services.kvstore.cpu_tier import OwnedPool  # noqa: E402
from services.kvstore.disk_tier import DiskTier  # noqa: E402
from services.kvstore.server import STAGING_KEEP  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=1400)
    ap.add_argument("--block-bytes", type=int, default=1835008)
    ap.add_argument("--threads", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--dir", default=None, help="folder for the block files (default: a temp dir)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    n, size = a.blocks, a.block_bytes
    root = tempfile.mkdtemp(prefix="kestrel-kvdisk-", dir=a.dir)
    pool = OwnedPool.create("kvdisk" + os.urandom(3).hex(), n, size, b"\0" * 32)
    disk = DiskTier(root, b"\1" * 32, size)
    disk.scan()  # creates the model folder
    try:
        data = os.urandom(size)
        hashes = [i.to_bytes(32, "little") for i in range(n)]
        spare = [(n + i).to_bytes(32, "little") for i in range(n)]
        t = time.perf_counter()
        for h in hashes:
            disk.write(h, data)
        out = {"benchmark": "kv_disk_read", "blocks": n, "block_bytes": size, "cpus": os.cpu_count(),
               "write_GBps_1_thread": round(n * size / (time.perf_counter() - t) / 1e9, 2), "read_GBps": {}}
        for i in range(n):
            pool.slot(i)[:] = data  # a used pool: its pages are resident
        stage: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(STAGING_KEEP):
            stage.put(bytearray(size))
        for threads in a.threads:
            for mode in ("plain", "copy-new", "copy-staged"):
                writes = ThreadPoolExecutor(max(1, threads // 4))

                def write(h: bytes, buf) -> None:
                    disk.write(h, buf)
                    if mode == "copy-staged":
                        stage.put(buf)

                def job(i: int) -> None:
                    if mode == "copy-new":
                        writes.submit(write, spare[i], bytes(pool.slot(i)))
                    elif mode == "copy-staged":
                        try:
                            buf = stage.get_nowait()
                        except queue.Empty:
                            buf = None
                        if buf is not None:
                            buf[:] = pool.slot(i)
                            writes.submit(write, spare[i], buf)
                    disk.read_into(hashes[i], pool.slot(i))

                t = time.perf_counter()
                with ThreadPoolExecutor(threads) as ex:
                    list(ex.map(job, range(n)))
                secs = time.perf_counter() - t
                writes.shutdown(wait=True)
                for h in spare:
                    disk.remove(h)
                out["read_GBps"][f"{mode}_t{threads}"] = round(n * size / secs / 1e9, 2)
    finally:
        pool.close()
        shutil.rmtree(root, ignore_errors=True)
    emit_json(out, a.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
