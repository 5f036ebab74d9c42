"""State slots: the cache group of a hybrid model's recurrent layers (docs/ARCHITECTURE.md §4.7).

A gated-DeltaNet layer keeps, per request, a fixed-size state (its short-conv window and its
recurrent matrix) instead of paged KV. The workers allocate `num_slots` of each such state
(`services/worker/state_cache.py`); the engine hands them out here: one slot per running
request, taken when the request starts running (admitted from the waiting queue, or again
after a preemption) and given back when it finishes or is preempted. Each `ScheduledSeq`
carries its request's slot (`state_slot`). A seq at start_pos 0 makes the workers start the
slot from zeros, so a slot handed out again needs no cleaning, and a preempted request
recomputes from token 0 into whichever slot it gets next.

Slots never run short: the scheduler runs at most max_num_seqs requests, and there are that
many slots.

Prefix caching (checkpoints): a recurrent layer's state cannot be rebuilt from cached KV, so
a prefix hit must also restore the state after the hit's last token. The scheduler makes a
prompt's prefill chunk end at the prompt's last full-block boundary B = (P - 1) // block_size
* block_size (the longest hit a later identical or extended prompt can use) and asks the
workers to save the slot's state there into a checkpoint slot (`ScheduledSeq.state_save`),
keyed by the chain hash of the block ending at B. A hit is trimmed to the longest prefix whose
last block has a checkpoint, which the workers copy into the request's slot before its first
step (`ScheduledSeq.state_restore`). Checkpoint slots are evicted least recently used; a plan
restoring one is sent before any later plan that could reuse it, and the workers run plans in
order. Plans made ahead (async scheduling) stay correct: the workers run plans in
order, so a slot given to a new request is zeroed by that request's first step, after every
step of its previous owner.

A checkpoint is pending from the plan that fills it (a save, or a load from the kvstore's
tier, `StepPlan.state_loads`) until that plan's result: `commit` makes it readable, `drop`
frees it when the step failed (its bytes are unreliable). A pending checkpoint is never
evicted nor restored from. While the KV connector copies a checkpoint into the kvstore
(`pin` .. `unpin`, docs/ARCHITECTURE.md §4.5) its slot is not evicted either.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


class StateSlots:
    """A free list of `num_slots` state slots (ids 0 .. num_slots - 1), and, for the prefix
    cache, `num_checkpoints` checkpoint slots after them (ids num_slots ..): each holds the
    state after the last token of one cached block chain, keyed by that block's name (its
    chain hash), least recently used evicted first (module doc: pending, pins). Pure
    bookkeeping."""

    def __init__(self, num_slots: int, num_checkpoints: int = 0):
        if num_slots < 1 or num_checkpoints < 0:
            raise ValueError(f"bad state slots: {num_slots} slots, {num_checkpoints} checkpoints")
        self.num_slots = num_slots
        self.num_checkpoints = num_checkpoints
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first
        self._checkpoints: OrderedDict[bytes, int] = OrderedDict()  # readable: name -> slot; LRU first
        self._pending: dict[bytes, int] = {}  # being filled by a plan in flight: name -> slot
        self._pins: Counter[int] = Counter()  # slot -> stores in flight
        self._orphans: set[int] = set()  # forgotten while pinned: freed at the last unpin
        self._free_checkpoints = list(range(num_slots + num_checkpoints - 1, num_slots - 1, -1))
        self.num_checkpoint_evictions = 0

    def checkpoint_of(self, name: bytes) -> int | None:
        """The checkpoint slot holding the state after block `name`'s chain (marked used),
        or None (none, or still pending)."""
        slot = self._checkpoints.get(name)
        if slot is not None:
            self._checkpoints.move_to_end(name)
        return slot

    def has_checkpoint(self, name: bytes) -> bool:
        """Whether block `name` has a readable checkpoint (marks nothing)."""
        return name in self._checkpoints

    def _evictable(self) -> bytes | None:
        for name, slot in self._checkpoints.items():
            if not self._pins[slot]:
                return name
        return None

    def can_add_checkpoint(self, name: bytes) -> bool:
        """Whether `new_checkpoint(name)` would give a slot."""
        if not self.num_checkpoints or name in self._checkpoints or name in self._pending:
            return False
        return bool(self._free_checkpoints) or self._evictable() is not None

    def new_checkpoint(self, name: bytes) -> int | None:
        """A checkpoint slot to fill with the state after block `name`'s chain (a free one,
        else the least recently used one not pinned, evicted), pending under `name` until
        `commit`; None when there are no checkpoint slots, `name` has one already (readable
        or pending), or every slot is pending or pinned."""
        if not self.can_add_checkpoint(name):
            return None
        if self._free_checkpoints:
            slot = self._free_checkpoints.pop()
        else:
            victim = self._evictable()
            assert victim is not None  # can_add_checkpoint saw one
            slot = self._checkpoints.pop(victim)
            self.num_checkpoint_evictions += 1
        self._pending[name] = slot
        return slot

    def commit(self, slot: int) -> bytes | None:
        """The plan filling pending checkpoint `slot` came back: it becomes readable (most
        recently used). Returns its name, None for a slot that is not pending."""
        name = next((n for n, s in self._pending.items() if s == slot), None)
        if name is not None:
            del self._pending[name]
            self._checkpoints[name] = slot
        return name

    def drop(self, slot: int) -> None:
        """The plan filling pending checkpoint `slot` failed: free it (nothing if the slot is
        not pending)."""
        name = next((n for n, s in self._pending.items() if s == slot), None)
        if name is not None:
            del self._pending[name]
            self._free_checkpoints.append(slot)

    def holds(self, slot: int, name: bytes) -> bool:
        """Whether checkpoint `slot` is readable and holds block `name`'s checkpoint now."""
        return self._checkpoints.get(name) == slot

    def pin(self, slot: int) -> None:
        """Keep checkpoint `slot` from eviction until `unpin` (its copy into the kvstore is
        in flight). Pins nest."""
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        """End one pin of `slot`. Raises RuntimeError if it is not pinned."""
        if self._pins[slot] <= 0:
            raise RuntimeError(f"checkpoint slot {slot} unpinned with no pin")
        self._pins[slot] -= 1
        if not self._pins[slot]:
            del self._pins[slot]
            if slot in self._orphans:
                self._orphans.discard(slot)
                self._free_checkpoints.append(slot)

    def forget_checkpoints(self) -> None:
        """Drop every readable checkpoint (the prefix cache was reset); a pinned one is freed
        at its last unpin, a pending one stays (its plan fills it correctly)."""
        for slot in self._checkpoints.values():
            if self._pins[slot]:
                self._orphans.add(slot)
            else:
                self._free_checkpoints.append(slot)
        self._checkpoints.clear()

    @property
    def num_free(self) -> int:
        """Slots not held by a request."""
        return len(self._free)

    def take(self) -> int:
        """A free slot. Raises RuntimeError when none is left (more running requests than
        slots: a scheduler bug)."""
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are taken")
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        """Return `slot` (taken before) to the free list. Raises ValueError for a slot out of
        range or already free."""
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not held")
        self._free.append(slot)
