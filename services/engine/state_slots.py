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
"""

from __future__ import annotations

from collections import OrderedDict


class StateSlots:
    """A free list of `num_slots` state slots (ids 0 .. num_slots - 1), and, for the prefix
    cache, `num_checkpoints` checkpoint slots after them (ids num_slots ..): each holds the
    state after the last token of one cached block chain, keyed by that block's name (its
    chain hash), least recently used evicted first. Pure bookkeeping."""

    def __init__(self, num_slots: int, num_checkpoints: int = 0):
        if num_slots < 1 or num_checkpoints < 0:
            raise ValueError(f"bad state slots: {num_slots} slots, {num_checkpoints} checkpoints")
        self.num_slots = num_slots
        self.num_checkpoints = num_checkpoints
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first
        self._checkpoints: OrderedDict[bytes, int] = OrderedDict()  # block name -> slot; LRU first
        self._free_checkpoints = list(range(num_slots + num_checkpoints - 1, num_slots - 1, -1))
        self.num_checkpoint_evictions = 0

    def checkpoint_of(self, name: bytes) -> int | None:
        """The checkpoint slot holding the state after block `name`'s chain (marked used),
        or None."""
        slot = self._checkpoints.get(name)
        if slot is not None:
            self._checkpoints.move_to_end(name)
        return slot

    def new_checkpoint(self, name: bytes) -> int | None:
        """A checkpoint slot to save the state after block `name`'s chain into (a free one,
        else the least recently used one, evicted), now keyed by `name`; None when there are
        no checkpoint slots or `name` has one already."""
        if self.num_checkpoints == 0 or name in self._checkpoints:
            return None
        if self._free_checkpoints:
            slot = self._free_checkpoints.pop()
        else:
            _, slot = self._checkpoints.popitem(last=False)
            self.num_checkpoint_evictions += 1
        self._checkpoints[name] = slot
        return slot

    def forget_checkpoints(self) -> None:
        """Drop every checkpoint (the prefix cache was reset)."""
        self._free_checkpoints.extend(self._checkpoints.values())
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
