"""Faults of the kvstore's disk tier: a write storm against the size limit, and damaged
block files (truncated, corrupted) that must turn into misses, never a crash."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest

from tests.kvstore_helpers import FILE, Store, chain, identity, load_blocks, payload, store_blocks, wait_for


@pytest.fixture
def disk_dir():
    d = tempfile.mkdtemp(prefix="kvd-")
    yield d
    subprocess.run(["rm", "-rf", d])


def _disk_usage(folder: str) -> tuple[int, int]:
    """(files, bytes) in the folder, temporaries included."""
    n = size = 0
    for name in os.listdir(folder):
        try:
            size += os.path.getsize(os.path.join(folder, name))
            n += 1
        except FileNotFoundError:
            pass
    return n, size


def test_disk_tier_never_exceeds_its_limit_under_a_write_storm(disk_dir):
    s = Store(4, disk_dir=disk_dir, disk_blocks=50)
    try:
        c = s.client()
        folder = os.path.join(disk_dir, identity(s.model).hex())
        hs = chain(s.model, 500, salt=7)
        peak = 0
        for i in range(0, 500, 4):                      # 4 stores fill the 4-slot pool
            assert min(store_blocks(c, hs[i:i + 4])) >= 0
            n, size = _disk_usage(folder)
            peak = max(peak, size)
            assert size <= 50 * FILE, f"{n} files, {size} bytes after {i + 4} stores"
        wait_for(lambda: c.stats()["pending_writes"] == 0, what="queued demotions")
        n, size = _disk_usage(folder)
        assert size <= 50 * FILE and n <= 50 and peak <= 50 * FILE
        st = c.stats()
        assert st["disk_blocks"] == n and st["disk_evictions"] > 0
        # The newest blocks are the ones kept: a disk-tier entry loads back intact.
        tiers = c.lookup(hs[-4:])
        assert tiers == ["cpu"] * 4
        on_disk = [h for h in hs if os.path.exists(os.path.join(folder, h.hex() + ".kvb"))]
        assert on_disk and load_blocks(c, on_disk[-1:]) == [payload(on_disk[-1])]
        assert s.proc.poll() is None
    finally:
        s.close()


def _demoted_store(disk_dir: str, n: int = 4) -> tuple[Store, object, list[bytes], str]:
    """A store with 2 slots whose first n-2 blocks sit on disk only."""
    s = Store(2, disk_dir=disk_dir, disk_blocks=20)
    c = s.client()
    hs = chain(s.model, n, salt=9)
    for h in hs:
        store_blocks(c, [h])
    wait_for(lambda: c.lookup(hs) == ["disk"] * (n - 2) + ["cpu"] * 2, what="demotion")
    return s, c, hs, os.path.join(disk_dir, identity(s.model).hex())


@pytest.mark.parametrize("damage", ["truncate", "flip_payload_byte", "flip_header_byte"])
def test_a_damaged_block_file_is_a_miss_and_is_removed(disk_dir, damage):
    s, c, hs, folder = _demoted_store(disk_dir)
    try:
        path = os.path.join(folder, hs[1].hex() + ".kvb")
        with open(path, "r+b") as fh:
            if damage == "truncate":
                fh.truncate(FILE // 2)
            else:
                off = FILE - 10 if damage == "flip_payload_byte" else 60
                fh.seek(off)
                b = fh.read(1)
                fh.seek(off)
                fh.write(bytes([b[0] ^ 0xFF]))
        # The lookup still believes the file; the load finds it damaged and stops there.
        assert load_blocks(c, hs[:2]) == [payload(hs[0])]
        assert not os.path.exists(path)
        assert c.lookup(hs) == ["cpu"]                   # hs[0] promoted, hs[1] gone
        assert c.stats()["promotion_failures"] == 1
        # The store keeps serving: the block can be stored again and loads back intact.
        store_blocks(c, [hs[1]])
        assert load_blocks(c, hs[:2]) == [payload(hs[0]), payload(hs[1])]
        assert s.proc.poll() is None
    finally:
        s.close()


def test_damaged_and_stray_files_are_dropped_when_the_index_is_rebuilt(disk_dir):
    s, c, hs, folder = _demoted_store(disk_dir, n=5)
    instance = s.instance
    assert s.stop() == 0
    with open(os.path.join(folder, hs[0].hex() + ".kvb"), "r+b") as fh:
        fh.truncate(10)
    with open(os.path.join(folder, hs[1].hex() + ".kvb"), "r+b") as fh:
        fh.seek(20)
        fh.write(b"\0" * 8)                              # header identity bytes damaged
    tmp = os.path.join(folder, ".tmp-" + hs[2].hex() + "-1-0")
    open(tmp, "wb").write(b"partial")
    again = Store(2, disk_dir=disk_dir, disk_blocks=20, instance=instance)
    try:
        c = again.client()
        assert c.lookup(hs) == []                        # hs[0] is gone: the run starts with a miss
        assert c.lookup(hs[2:]) == ["disk"]
        assert sorted(os.listdir(folder)) == [hs[2].hex() + ".kvb"]
        assert load_blocks(c, hs[2:3]) == [payload(hs[2])]
    finally:
        again.close()
