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
many slots. Plans made ahead (async scheduling) stay correct: the workers run plans in
order, so a slot given to a new request is zeroed by that request's first step, after every
step of its previous owner.
"""

from __future__ import annotations


class StateSlots:
    """A free list of `num_slots` state slots (ids 0 .. num_slots - 1). Pure bookkeeping."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first

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
