"""The kvstore's index: which block (by chained hash) sits in which tier, LRU and pinning.

Pure bookkeeping, no I/O: every method returns the I/O it implies as `Actions`, which the
server carries out (`services.kvstore.server`). Single-threaded: only the server's main loop
calls it.

States of a block in the CPU tier (one pool slot each):
- WRITING: a client got the slot from `prepare_store` and is copying the block in. Owned
  by that client session; invisible to lookups; never evicted.
- LOADING: the block is being read from its disk file into the slot (a promotion, started
  by `reserve_load`). Visible to lookups (tier "disk"); never evicted.
- VALID: the slot holds the block. Evictable (LRU) only while no reader pins it.
A reader pin (from `reserve_load`, released by `complete_load`) keeps a slot's bytes in
place; a slot is reused only when it is VALID with no pins, or freed.

The disk tier holds at most `disk_capacity` files (= kv_offload_disk_gib // file size; the
limit counts files being written). A file is WRITING while a demotion writes it (invisible,
never evicted) and VALID after its rename; a VALID file with readers (a promotion reading
it) is never evicted. Eviction from the CPU tier demotes the block to disk when the disk
tier is on and the block has no file yet; if the disk tier is full of files that cannot be
evicted, the block is dropped. While `max_pending_writes` demotions are queued, blocks
that would need one are not evicted by a store (it finds no slot and is skipped), so that a
burst of stores never drops blocks the disk could keep. A promotion does evict them then,
without a write: a hit being served now is worth more than a cold block that may be asked for
again.

Sessions: every pin and every WRITING slot belongs to a client session (one connected
engine). `drop_session` releases them all, so a client that restarts never leaks slots.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

WRITING, LOADING, VALID = "writing", "loading", "valid"
EVICTION_SCAN = 64  # LRU entries an allocation looks at for one it may evict now


@dataclass
class CpuEntry:
    """A block in a CPU slot: its state (WRITING, LOADING, VALID) and the pins on it."""

    block_hash: bytes
    slot: int
    state: str
    pins: int = 0
    writer: str | None = None    # session owning a WRITING slot


@dataclass
class DiskEntry:
    """A block file of the disk tier: its state and the promotions reading it."""

    state: str
    readers: int = 0


@dataclass
class Reservation:
    """A load whose blocks are not all in CPU slots yet. failed_at: index of the first block
    whose promotion failed (blocks from there on are released), None while all is well."""
    session: str
    req_id: int
    hashes: list[bytes]
    slots: list[int]
    waiting: set[bytes]
    failed_at: int | None = None

    @property
    def num_ok(self) -> int:
        """Blocks of the reservation that are loaded (all of them unless one failed)."""
        return len(self.hashes) if self.failed_at is None else self.failed_at


@dataclass
class Actions:
    """I/O for the server, in this order: demote = (hash, slot) to copy out of the slot now
    (before the reply that hands the slot to someone else) and write to disk; unlink =
    block files to delete; read = (hash, slot) disk files to read into slots."""
    demote: list[tuple[bytes, int]] = field(default_factory=list)
    unlink: list[bytes] = field(default_factory=list)
    read: list[tuple[bytes, int]] = field(default_factory=list)


class BlockStore:
    """The index of both tiers.

    n_slots: CPU pool slots. disk_capacity: block files the disk tier may hold (0: no disk
    tier). max_pending_writes: demotions queued at most; beyond it an evicted block is
    dropped instead of written (bounds the memory of queued copies).
    """

    def __init__(self, n_slots: int, disk_capacity: int = 0, max_pending_writes: int = 64):
        self.n_slots, self.disk_capacity = n_slots, disk_capacity
        self.max_pending_writes = max_pending_writes
        self.free_slots: list[int] = list(range(n_slots - 1, -1, -1))   # pop() gives slot 0 first
        self.cpu: dict[bytes, CpuEntry] = {}
        self.by_slot: dict[int, CpuEntry] = {}
        self.cpu_lru: OrderedDict[bytes, None] = OrderedDict()   # VALID entries, oldest first
        self.disk: OrderedDict[bytes, DiskEntry] = OrderedDict()  # oldest first
        self.pending_writes = 0
        self.load_pins: dict[str, Counter] = {}     # session -> slot -> pins
        self.reservations: dict[bytes, list[Reservation]] = {}   # hash being promoted -> waiters
        self.counters: Counter[str] = Counter()

    # ------------------------------------------------------------ queries
    @property
    def slots_used(self) -> int:
        """CPU slots holding or receiving a block."""
        return self.n_slots - len(self.free_slots)

    def tier(self, h: bytes) -> str | None:
        """"cpu" (VALID in a slot), "disk" (a VALID file, or being promoted), or None."""
        e = self.cpu.get(h)
        if e is not None and e.state == VALID:
            return "cpu"
        if e is not None and e.state == LOADING:
            return "disk"
        d = self.disk.get(h)
        return "disk" if d is not None and d.state == VALID else None

    def lookup(self, hashes: list[bytes]) -> list[str]:
        """Tiers of the longest run of hits from hashes[0] (its length is the hit count)."""
        out = []
        for h in hashes:
            t = self.tier(h)
            if t is None:
                break
            out.append(t)
        self.counters["lookups"] += 1
        self.counters["lookup_hits"] += len(out)
        return out

    def stats(self) -> dict:
        """Occupancy (slots, blocks per tier, pins, pending writes) and the counters."""
        return {"slots": self.n_slots, "slots_used": self.slots_used,
                "cpu_blocks": sum(1 for e in self.cpu.values() if e.state == VALID),
                "disk_blocks": sum(1 for d in self.disk.values() if d.state == VALID),
                "disk_capacity": self.disk_capacity, "pending_writes": self.pending_writes,
                "pinned_slots": sum(1 for e in self.cpu.values() if e.pins or e.state != VALID),
                **self.counters}

    # ------------------------------------------------------------ allocation
    def _alloc_slot(self, acts: Actions, evicted: list[bytes], may_drop: bool = False) -> int | None:
        """A free slot, else the slot of the least recently used unpinned VALID block (demoted
        or dropped). None when every slot is pinned or being written, or (unless may_drop)
        when the demotion queue is full and the LRU blocks would need a disk write."""
        if self.free_slots:
            return self.free_slots.pop()
        writes_full = self.pending_writes >= self.max_pending_writes
        for scanned, h in enumerate(self.cpu_lru):
            e = self.cpu[h]
            if e.pins:
                continue
            # While the demotion queue is full, a block that would need a disk write stays
            # (backpressure: the caller gets no slot now) rather than being dropped; blocks
            # already on disk, or all blocks without a disk tier, go as before.
            if writes_full and not may_drop and self.disk_capacity and h not in self.disk:
                if scanned >= EVICTION_SCAN:
                    return None
                continue
            break
        else:
            return None
        del self.cpu_lru[h], self.cpu[h], self.by_slot[e.slot]
        self.counters["cpu_evictions"] += 1
        if h not in self.disk and self.disk_capacity and self.pending_writes < self.max_pending_writes \
                and self._make_disk_room(acts):
            self.disk[h] = DiskEntry(WRITING)
            self.pending_writes += 1
            acts.demote.append((h, e.slot))
        elif h not in self.disk:
            evicted.append(h)
        return e.slot

    def _make_disk_room(self, acts: Actions) -> bool:
        """Evict LRU unread VALID files until one more fits. False if it cannot."""
        while len(self.disk) >= self.disk_capacity:
            victim = next((h for h, d in self.disk.items() if d.state == VALID and d.readers == 0), None)
            if victim is None:
                return False
            del self.disk[victim]
            acts.unlink.append(victim)
            self.counters["disk_evictions"] += 1
        return True

    def _free(self, e: CpuEntry) -> None:
        self.cpu.pop(e.block_hash, None)
        self.cpu_lru.pop(e.block_hash, None)
        self.by_slot.pop(e.slot, None)
        self.free_slots.append(e.slot)

    # ------------------------------------------------------------ loads
    def reserve_load(self, session: str, req_id: int, hashes: list[bytes]
                     ) -> tuple[list[int], Reservation | None, Actions]:
        """Pin a slot for each block of the longest available run from hashes[0].

        Returns (slots, reservation, actions): reservation is None when every slot already
        holds its block; otherwise it completes when the promotions in `actions.read` finish
        (see `read_done`). Blocks past a miss, or past a disk block with no slot to promote
        into, are not reserved (len(slots) < len(hashes)).
        """
        acts, slots, waiting = Actions(), [], set()
        evicted: list[bytes] = []
        pins = self.load_pins.setdefault(session, Counter())
        run = []
        for h in hashes:
            if self.tier(h) is None:
                break
            run.append(h)
        # Pin the run's blocks already in slots first, so its promotions never evict them.
        for h in run:
            if h in self.cpu:
                self.cpu[h].pins += 1
        for i, h in enumerate(run):
            e = self.cpu.get(h)
            if e is None:   # on disk only: promote into a slot
                slot = self._alloc_slot(acts, evicted, may_drop=True)
                if slot is None:
                    for rest in run[i + 1:]:
                        if rest in self.cpu:
                            self.cpu[rest].pins -= 1
                    break
                e = CpuEntry(h, slot, LOADING, pins=1)
                self.cpu[h] = self.by_slot[slot] = e
                d = self.disk[h]
                d.readers += 1
                self.disk.move_to_end(h)
                acts.read.append((h, slot))
                waiting.add(h)
                self.counters["promotions"] += 1
            elif e.state == VALID:
                self.cpu_lru.move_to_end(h)
            else:           # LOADING: another reservation's promotion
                waiting.add(h)
            pins[e.slot] += 1
            slots.append(e.slot)
        hashes = hashes[:len(slots)]
        self.counters["load_blocks"] += len(slots)
        if not waiting:
            return slots, None, acts
        r = Reservation(session, req_id, list(hashes), slots, waiting)
        for h in waiting:
            self.reservations.setdefault(h, []).append(r)
        return slots, r, acts

    def read_done(self, h: bytes, ok: bool) -> list[Reservation]:
        """A promotion of `h` finished (ok: the slot holds the block; else the file was
        corrupt or gone, and is no longer indexed). Returns reservations now complete."""
        d = self.disk.get(h)
        if d is not None:
            d.readers -= 1
            if not ok:
                del self.disk[h]
        e = self.cpu.get(h)
        waiters = self.reservations.pop(h, [])
        if ok and e is not None:
            e.state = VALID
            self.cpu_lru[h] = None
        elif e is not None:
            # Every pin of a LOADING block comes from a waiting reservation: truncating them
            # releases it, and the slot goes back to the free list.
            self.counters["promotion_failures"] += 1
            for r in waiters:
                self._truncate(r, r.hashes.index(h))
            self._free(e)
        done = []
        for r in waiters:
            r.waiting.discard(h)
            if not r.waiting:
                done.append(r)
        return done

    def _truncate(self, r: Reservation, idx: int) -> None:
        """Release blocks idx.. of a reservation (the promotion of block idx failed)."""
        stop = len(r.hashes) if r.failed_at is None else r.failed_at
        if idx >= stop:
            return
        r.failed_at = idx
        for h, slot in zip(r.hashes[idx:stop], r.slots[idx:stop]):
            self._unpin(r.session, slot)
            if h != r.hashes[idx] and h in r.waiting:
                r.waiting.discard(h)
                lst = self.reservations.get(h)
                if lst and r in lst:
                    lst.remove(r)

    def _unpin(self, session: str, slot: int) -> bool:
        pins = self.load_pins.get(session)
        e = self.by_slot.get(slot)
        if not pins or pins[slot] <= 0 or e is None:
            return False
        pins[slot] -= 1
        if pins[slot] == 0:
            del pins[slot]
        e.pins -= 1
        return True

    def complete_load(self, session: str, slots: list[int]) -> int:
        """Unpin slots this session reserved (one pin each). Returns how many were pinned;
        the others are ignored."""
        return sum(self._unpin(session, s) for s in slots)

    # ------------------------------------------------------------ stores
    def prepare_store(self, session: str, hashes: list[bytes]
                      ) -> tuple[list[int], list[bytes], Actions]:
        """Slots to write for the blocks not already stored (-1: present, being written by
        someone, or no slot free). Returns (slots, evicted, actions); evicted lists blocks
        that left the store entirely to make room (demoted blocks are not listed)."""
        acts: Actions = Actions()
        slots: list[int] = []
        evicted: list[bytes] = []
        for h in hashes:
            if h in self.cpu or self.tier(h) is not None or h in self.disk:
                slots.append(-1)
                continue
            slot = self._alloc_slot(acts, evicted)
            if slot is None:
                slots.append(-1)
                self.counters["store_no_slot"] += 1
                continue
            e = CpuEntry(h, slot, WRITING, writer=session)
            self.cpu[h] = self.by_slot[slot] = e
            slots.append(slot)
        return slots, evicted, acts

    def complete_store(self, session: str, slots: list[int], ok: bool) -> int:
        """Slots this session was writing become VALID (ok) or are freed. Returns how many
        were this session's WRITING slots; the others are ignored."""
        n = 0
        for s in slots:
            e = self.by_slot.get(s)
            if e is None or e.state != WRITING or e.writer != session:
                continue
            n += 1
            if ok:
                e.state, e.writer = VALID, None
                self.cpu_lru[e.block_hash] = None
                self.counters["stored_blocks"] += 1
            else:
                self._free(e)
        return n

    # ------------------------------------------------------------ disk
    def add_disk_blocks(self, hashes: list[bytes]) -> Actions:
        """Index files found at startup (oldest first); files beyond the capacity (the limit
        was lowered) are returned for removal, oldest first."""
        acts = Actions()
        for h in hashes:
            self.disk[h] = DiskEntry(VALID)
        while len(self.disk) > self.disk_capacity:
            h, _ = self.disk.popitem(last=False)
            acts.unlink.append(h)
        return acts

    def write_done(self, h: bytes, ok: bool, skipped: bool = False) -> None:
        """A demotion's file write finished: the file becomes VALID, or is forgotten (a
        failed write, or with skipped a write the server did not make: the block is dropped)."""
        self.pending_writes -= 1
        d = self.disk.get(h)
        if d is None or d.state != WRITING:
            return
        if ok:
            d.state = VALID
            self.counters["demotions"] += 1
        else:
            del self.disk[h]
            self.counters["demotions_skipped" if skipped else "demotion_failures"] += 1

    # ------------------------------------------------------------ sessions
    def drop_session(self, session: str) -> int:
        """Release every pin and WRITING slot of a session (its client left or restarted).
        Returns how many slots were released."""
        n = 0
        for slot, cnt in list(self.load_pins.pop(session, Counter()).items()):
            e = self.by_slot.get(slot)
            if e is not None:
                e.pins -= cnt
                n += 1
        for e in [e for e in self.cpu.values() if e.state == WRITING and e.writer == session]:
            self._free(e)
            n += 1
        for lst in self.reservations.values():
            lst[:] = [r for r in lst if r.session != session]
        return n
