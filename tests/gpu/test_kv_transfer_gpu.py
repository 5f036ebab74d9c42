"""The worker's KV tier copies (services/worker/kv_transfer.py) on CUDA, through a real CPU
tier pool (shared/kv_pool.py, created as services/kvstore/cpu_tier.py does: a /dev/shm segment that KVTransfer registers as
pinned host memory): blocks copied GPU cache -> pool slots -> other GPU blocks come back
bit-identical, slots hold the documented byte layout, and nothing else is touched.

Random bit patterns (NaN and Inf payloads included, so a copy that converts values would
show), odd block counts, destinations poisoned first. The copies need only torch and
psutil; plans are plain namespaces with StepPlan's transfer fields, so this runs where
msgspec or zmq are absent or of another version. Skipped without CUDA.
"""

from __future__ import annotations

import os
import random
import uuid
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from services.kvstore.cpu_tier import OwnedPool  # noqa: E402
from services.worker.kv_transfer import KVTransfer  # noqa: E402
from shared.kv_layout import KVLayout  # noqa: E402

NUM_BLOCKS, LAYERS, BS, HEADS, HEAD_DIM = 41, 3, 16, 3, 40
N_SLOTS = 29
POISON = 0xA5


def random_cache(dtype: torch.dtype, gen: torch.Generator) -> SimpleNamespace:
    """A KVCache-like object: k and v lists of [NUM_BLOCKS, BS, HEADS, HEAD_DIM] on CUDA,
    filled with random bytes (any bit pattern of the dtype)."""
    elem = torch.empty((), dtype=dtype).element_size()

    def one() -> torch.Tensor:
        raw = torch.randint(0, 256, (NUM_BLOCKS, BS, HEADS, HEAD_DIM * elem), dtype=torch.uint8,
                            generator=gen)
        return raw.view(dtype).cuda()

    return SimpleNamespace(k=[one() for _ in range(LAYERS)], v=[one() for _ in range(LAYERS)])


def layout_of(dtype: torch.dtype) -> KVLayout:
    """The KV layout of `random_cache(dtype)` (rank 0 of 1)."""
    name = str(dtype).removeprefix("torch.")
    elem = torch.empty((), dtype=dtype).element_size()
    return KVLayout(BS, LAYERS, HEADS, HEAD_DIM, name, elem, bytes(32))


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t (bitwise comparisons: NaN payloads compare too)."""
    return t.contiguous().view(torch.uint8)


def snapshot(kv) -> list[torch.Tensor]:
    return [raw(t).clone() for t in kv.k + kv.v]


def layout_bytes(kv, blk: int) -> bytes:
    """Block `blk` in the slot layout of kv_transfer's module doc: [L, 2, BS, H, D]."""
    parts = torch.stack([torch.stack([k[blk], v[blk]]) for k, v in zip(kv.k, kv.v)])
    return raw(parts).cpu().numpy().tobytes()


def new_pool(slot_bytes: int) -> OwnedPool:
    """A fresh CPU-tier pool segment (as the kvstore creates it), every slot poisoned."""
    pool = OwnedPool.create("kvg" + uuid.uuid4().hex[:10], N_SLOTS, slot_bytes, os.urandom(32))
    for s in range(N_SLOTS):
        pool.slot(s)[:] = bytes([POISON]) * slot_bytes
    return pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 7, 13])
def test_blocks_round_trip_through_pinned_pool_slots_bit_identical(dtype, n):
    gen = torch.Generator().manual_seed(n * 100 + LAYERS)
    rng = random.Random(n)
    kv = random_cache(dtype, gen)
    xfer = KVTransfer(kv, layout_of(dtype))
    elem = torch.empty((), dtype=dtype).element_size()
    assert xfer.slot_bytes == 2 * LAYERS * BS * HEADS * HEAD_DIM * elem
    pool = new_pool(xfer.slot_bytes)
    try:
        src = rng.sample(range(NUM_BLOCKS), n)
        dst = rng.sample([b for b in range(NUM_BLOCKS) if b not in src], n)
        slots = rng.sample(range(N_SLOTS), n)
        want = {b: layout_bytes(kv, b) for b in src}

        xfer.after_step(SimpleNamespace(step_id=1, kv_stores=list(zip(src, slots)), state_stores=[],
                                        kv_pool=pool.name, kv_pool_pid=os.getpid()))
        assert xfer.blocks._registered and xfer.blocks._mem.is_pinned(), "the pool is not pinned memory"
        for b, s in zip(src, slots):
            assert bytes(pool.slot(s)) == want[b], f"slot {s} does not hold block {b}"
        untouched = [s for s in range(N_SLOTS) if s not in slots]
        assert all(bytes(pool.slot(s)) == bytes([POISON]) * xfer.slot_bytes for s in untouched)

        for t in kv.k + kv.v:  # poison the destinations
            raw(t)[dst] = POISON
        before = snapshot(kv)
        assert xfer.before_step(SimpleNamespace(step_id=2, kv_loads=list(zip(slots, dst)), state_loads=[],
                                                kv_pool=pool.name, kv_pool_pid=os.getpid())) == ""
        torch.cuda.synchronize()
        after = snapshot(kv)
        others = torch.tensor([b for b in range(NUM_BLOCKS) if b not in dst], device="cuda")
        for old, new in zip(before, after):
            assert torch.equal(new[others], old[others]), "a block outside the load changed"
        for b_src, b_dst in zip(src, dst):
            assert layout_bytes(kv, b_dst) == want[b_src], f"block {b_dst} != block {b_src}"
    finally:
        xfer.detach()
        pool.close()


def test_a_new_kvstore_pool_is_mapped_again_and_a_missing_one_fails_cleanly():
    gen = torch.Generator().manual_seed(7)
    kv = random_cache(torch.bfloat16, gen)
    xfer = KVTransfer(kv, layout_of(torch.bfloat16))
    first, second = new_pool(xfer.slot_bytes), new_pool(xfer.slot_bytes)
    try:
        xfer.store(first.name, 1001, [(3, 0), (5, 1), (8, 2)])
        want = [layout_bytes(kv, b) for b in (3, 5, 8)]
        assert [bytes(first.slot(s)) for s in range(3)] == want
        # A restarted kvstore: another pool and pid. The worker maps it and registers it.
        xfer.store(second.name, 1002, [(8, 4), (3, 6), (5, 5)])
        assert xfer.blocks.pool.name == second.name and xfer.blocks._registered
        assert [bytes(second.slot(s)) for s in (6, 5, 4)] == want
        for t in kv.k + kv.v:
            raw(t)[[10, 11, 12]] = POISON
        xfer.load(second.name, 1002, [(6, 10), (5, 11), (4, 12)])
        torch.cuda.synchronize()
        assert [layout_bytes(kv, b) for b in (10, 11, 12)] == want
        # A pool that is gone: stores are reported (the step's tokens stand), and so are loads
        # (the step runs no forward and its requests recompute, docs/ARCHITECTURE.md §4.5).
        gone = SimpleNamespace(step_id=9, kv_stores=[(1, 0)], kv_loads=[(0, 1)], state_loads=[], state_stores=[],
                               kv_pool="kestrel-kvg-gone-kvpool", kv_pool_pid=1003)
        assert xfer.after_step(gone).startswith("FileNotFoundError")
        assert xfer.before_step(gone).startswith("FileNotFoundError")
    finally:
        xfer.detach()
        first.close()
        second.close()
