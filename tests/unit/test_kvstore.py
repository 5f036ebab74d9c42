"""The kvstore service (services/kvstore): a real `kestrel kvstore` subprocess, its shm pool
and its disk tier, driven through the client the engine will use."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import psutil
import pytest

from shared.kvstore_client import KVStoreRefused
from services.kvstore.disk_tier import HEADER, MAGIC
from tests.kvstore_helpers import (BLOCK, FILE, REPO, Store, chain, identity, load_blocks,
                                   payload, store_args, store_blocks, wait_for)


@pytest.fixture
def stores():
    made: list[Store] = []

    def make(*a, **kw) -> Store:
        s = Store(*a, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture
def disk_dir():
    d = tempfile.mkdtemp(prefix="kvd-")
    yield d
    subprocess.run(["rm", "-rf", d])


def test_stored_blocks_load_back_with_identical_bytes(stores):
    s = stores(8)
    c = s.client()
    hs = chain(s.model, 5)
    assert all(slot >= 0 for slot in store_blocks(c, hs))
    assert c.lookup(hs) == ["cpu"] * 5
    assert load_blocks(c, hs) == [payload(h) for h in hs]
    # A second session (another engine process) sees the same bytes.
    c2 = s.client("engine-b")
    assert load_blocks(c2, hs) == [payload(h) for h in hs]


def test_lookup_counts_only_consecutive_hits_from_the_first_block(stores):
    s = stores(8)
    c = s.client()
    hs = chain(s.model, 6)
    store_blocks(c, [hs[0], hs[1], hs[3], hs[4]])     # hole at block 2
    assert c.lookup(hs) == ["cpu", "cpu"]
    assert c.lookup(hs[1:]) == ["cpu"]
    assert c.lookup(hs[2:]) == []
    assert len(c.reserve_load(hs)) == 2                 # the reservation stops at the hole too


def test_storing_a_present_block_gets_no_slot(stores):
    s = stores(4)
    c = s.client()
    hs = chain(s.model, 2)
    store_blocks(c, hs[:1])
    assert c.prepare_store(hs).slots[0] == -1


def test_cpu_tier_evicts_the_least_recently_used_block_first(stores):
    s = stores(4)
    c = s.client()
    a, b, d, e, f = chain(s.model, 5, salt=1)
    store_blocks(c, [a, b, d, e])                      # pool full; LRU order a b d e
    load_blocks(c, [a])                                # a becomes the most recent
    prep = c.prepare_store([f])
    assert prep.evicted == [b]                         # no disk tier: b leaves the store
    c.complete_store([s for s in prep.slots if s >= 0])
    assert c.lookup([b]) == [] and c.lookup([a]) == ["cpu"] and c.lookup([f]) == ["cpu"]


def test_pinned_slots_are_never_evicted_under_a_reader(stores):
    s = stores(3)
    c = s.client()
    hs = chain(s.model, 3)
    store_blocks(c, hs)
    slots = c.reserve_load(hs)                         # pins every slot
    new = chain(s.model, 2, salt=2)
    assert c.prepare_store(new).slots == [-1, -1]      # nothing evictable
    assert c.lookup(hs) == ["cpu"] * 3
    assert [bytes(c.attach_pool().slot(x)) for x in slots] == [payload(h) for h in hs]
    c.complete_load(slots[:1])                         # unpin hs[0] only
    prep = c.prepare_store(new[:1])
    assert prep.slots == [slots[0]] and prep.evicted == [hs[0]]
    c.complete_store(prep.slots)
    assert c.lookup(hs[1:]) == ["cpu", "cpu"]


def test_a_slot_being_written_is_invisible_and_dropped_on_failure(stores):
    s = stores(4)
    c = s.client()
    hs = chain(s.model, 2)
    prep = c.prepare_store(hs)
    assert c.lookup(hs) == []                          # not valid until completed
    assert c.complete_store(prep.slots, ok=False) == 2
    assert c.lookup(hs) == [] and c.stats()["slots_used"] == 0


def test_a_restarted_client_releases_the_pins_of_its_old_session(stores):
    s = stores(2)
    old = s.client("engine")
    hs = chain(s.model, 2)
    store_blocks(old, hs)
    old.reserve_load(hs)                               # pinned, then the engine "dies"
    new = s.client("engine")                           # same name, new session
    prep = new.prepare_store(chain(s.model, 1, salt=3))
    assert prep.slots[0] >= 0                          # the old pins were released


def test_evicted_block_is_demoted_to_disk_and_promoted_back_identical(stores, disk_dir):
    s = stores(4, disk_dir=disk_dir, disk_blocks=10)
    c = s.client()
    hs = chain(s.model, 6)
    store_blocks(c, hs[:4])
    store_blocks(c, hs[4:])                            # evicts hs[0], hs[1] to disk
    wait_for(lambda: c.lookup(hs) == ["disk"] * 2 + ["cpu"] * 4, what="demotion")
    folder = os.path.join(disk_dir, identity(s.model).hex())
    with open(os.path.join(folder, hs[0].hex() + ".kvb"), "rb") as fh:
        raw = fh.read()
    assert raw[:8] == MAGIC and len(raw) == FILE and raw[HEADER.size:] == payload(hs[0])
    # Promotion of hs[0], hs[1]: the run's own blocks in slots (hs[2], hs[3]) are pinned
    # first, so the promotions evict hs[4], hs[5] (demoted in turn), never hs[2], hs[3].
    assert load_blocks(c, hs[:4]) == [payload(h) for h in hs[:4]]
    assert c.lookup(hs[:4]) == ["cpu"] * 4
    wait_for(lambda: c.lookup(hs[4:]) == ["disk", "disk"], what="second demotion")
    assert load_blocks(c, hs[4:]) == [payload(h) for h in hs[4:]]


def test_restart_rebuilds_the_disk_index_for_the_same_model_only(stores, disk_dir):
    s = stores(1, disk_dir=disk_dir, disk_blocks=10)
    c = s.client()
    hs = chain(s.model, 4)
    for h in hs:
        store_blocks(c, [h])                           # each store demotes the previous block
    wait_for(lambda: c.lookup(hs) == ["disk"] * 3 + ["cpu"], what="demotion")
    assert s.stop() == 0                               # the CPU-tier block is lost with the pool
    again = stores(4, disk_dir=disk_dir, disk_blocks=10, instance=s.instance)
    c = again.client()
    assert c.lookup(hs) == ["disk"] * 3
    assert load_blocks(c, hs[:3]) == [payload(h) for h in hs[:3]]
    again.stop()
    other = stores(2, disk_dir=disk_dir, disk_blocks=10, model="/nonexistent/model-b")
    c = other.client()
    assert c.lookup(chain(other.model, 3)) == []
    assert c.lookup(hs) == []                          # another model's blocks are not served
    kept = os.listdir(os.path.join(disk_dir, identity(s.model).hex()))
    assert sorted(kept) == sorted(h.hex() + ".kvb" for h in hs[:3])   # and left untouched


def test_hello_with_another_model_identity_or_block_size_is_refused(stores):
    s = stores(2)
    with pytest.raises(KVStoreRefused, match="model identity"):
        s.client(model="/nonexistent/model-b")
    with pytest.raises(KVStoreRefused, match="block_bytes"):
        s.client(block_bytes=BLOCK * 2)
    c = s.client(connect=False)
    with pytest.raises(KVStoreRefused, match="KVHello first"):
        c.lookup(chain(s.model, 1))


def test_undecodable_messages_are_dropped_and_the_store_keeps_serving(stores):
    import zmq

    s = stores(2)
    c = s.client()
    raw = c.ctx.socket(zmq.DEALER)
    raw.connect(s.address)
    raw.send(b"\x93garbage")
    raw.send_multipart([b"two", b"frames"])
    raw.close(linger=100)
    c.socket.send(b"\xc1")
    hs = chain(s.model, 1)
    store_blocks(c, hs)
    assert c.lookup(hs) == ["cpu"]


def _reject(tmp, *extra, slots=2) -> subprocess.CompletedProcess:
    args = store_args("kvrej", tmp, "/nonexistent/model-a", slots, extra=extra)
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_bad_offload_configuration_is_rejected_at_startup():
    with tempfile.TemporaryDirectory(prefix="kvr-") as tmp:
        r = _reject(tmp, "--kv-offload-disk-dir", tmp)
        assert r.returncode != 0 and "requires --kv-offload-disk-gib" in r.stderr
        huge = psutil.virtual_memory().total / (1 << 30) * 2
        r = _reject(tmp, "--kv-offload-cpu-gib", str(huge))
        assert r.returncode != 0 and "larger than the host memory" in r.stderr
        blocker = os.path.join(tmp, "a-file")
        open(blocker, "w").close()
        r = _reject(tmp, "--kv-offload-disk-dir", os.path.join(blocker, "sub"),
                    "--kv-offload-disk-gib", "1")
        assert r.returncode != 0 and "not a writable folder" in r.stderr
        r = _reject(tmp, "--kv-offload-cpu-gib", "0")
        assert r.returncode != 0 and "kv_offload_cpu_gib" in r.stderr
        assert not os.path.exists("/dev/shm/kestrel-kvrej-kvpool")


def test_pool_is_listed_by_shm_ls_and_gone_after_sigterm(stores):
    s = stores(4)
    c = s.client()
    store_blocks(c, chain(s.model, 3))
    name = c.info.pool_name
    ls = subprocess.run([sys.executable, "-m", "services.cli", "shm", "ls", "--instance", s.instance],
                        cwd=REPO, capture_output=True, text=True, timeout=30).stdout
    row = next(line for line in ls.splitlines() if line.startswith(name))
    assert row.split()[1] == "kvpool" and "slots 3 used / 1 free of 4" in row
    assert oct(os.stat(f"/dev/shm/{name}").st_mode & 0o777) == "0o600"
    assert s.stop() == 0
    assert not os.path.exists(f"/dev/shm/{name}")


def test_a_full_demotion_queue_skips_new_stores_instead_of_dropping_old_blocks():
    """BlockStore alone: with max_pending_writes demotions queued, a store that would need
    one more gets no slot (backpressure) and no block is lost; once a write is done the
    next store demotes again; a block already on disk is evicted without a write."""
    from services.kvstore.store import BlockStore

    st = BlockStore(n_slots=3, disk_capacity=10, max_pending_writes=2)
    h = [bytes([i]) * 32 for i in range(8)]
    slots, _, _ = st.prepare_store("s", h[:3])
    st.complete_store("s", slots, True)
    slots, evicted, acts = st.prepare_store("s", h[3:6])
    assert slots[:2] != [-1, -1] and slots[2] == -1 and evicted == []  # 2 demoted, 1 skipped
    assert [x for x, _ in acts.demote] == h[:2] and st.tier(h[2]) == "cpu"
    st.complete_store("s", [s for s in slots if s >= 0], True)
    st.write_done(h[0], True)  # one demotion finished: room for one more
    slots, evicted, acts = st.prepare_store("s", [h[6]])
    assert slots != [-1] and [x for x, _ in acts.demote] == [h[2]] and evicted == []
    assert [st.tier(x) for x in h[:3]] == ["disk", None, None]  # h[1], h[2] still being written
    st.write_done(h[1], True)
    st.write_done(h[2], True)
    assert [st.tier(x) for x in h[:3]] == ["disk", "disk", "disk"]


def test_a_full_demotion_queue_does_not_stop_a_promotion():
    """BlockStore alone: with the demotion queue full, a promotion (a hit being served) still
    gets slots, by evicting LRU blocks without a disk write, so the whole disk run loads."""
    from services.kvstore.store import BlockStore

    st = BlockStore(n_slots=3, disk_capacity=10, max_pending_writes=1)
    h = [bytes([i]) * 32 for i in range(8)]
    for i in range(3):  # h0..h2 stored, each demoted in turn and written
        slots, _, _ = st.prepare_store("s", [h[i]])
        st.complete_store("s", slots, True)
    slots, _, acts = st.prepare_store("s", h[3:5])  # h0 demoted; the queue is then full
    assert [x for x, _ in acts.demote] == [h[0]] and slots[1] == -1
    st.complete_store("s", [s for s in slots if s >= 0], True)
    st.write_done(h[0], True)
    slots, _, acts = st.prepare_store("s", [h[5]])  # h1 demoted: the queue is full again
    st.complete_store("s", slots, True)
    assert st.tier(h[0]) == "disk" and st.pending_writes == 1
    slots, res, acts = st.reserve_load("s", 1, [h[0]])
    assert len(slots) == 1 and res is not None and [x for x, _ in acts.read] == [h[0]]
    assert st.pending_writes == 1  # no new write: the evicted block was dropped
