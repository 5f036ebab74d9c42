"""A KV connector's book of stores: blocks (and a hybrid model's state checkpoints) on their
way into the kvstore (docs/ARCHITECTURE.md §4.5 "Store"). Socket-free: `KVStoreConnector`
(services/engine/kv_tiers.py) keeps one.

The way of a store: queued (`queue_blocks` after a step named blocks, `queue_states` after a
step saved checkpoints) -> `take_prepare`: those still holding what was named are pinned
(blocks in the block manager, checkpoint slots in the scheduler's `StateSlots`: neither is
reused while its copy is in flight) and go out in one KVPrepareStore -> `prepared`: the
store's slots; -1 is unpinned at once -> `take_ready` for the next plan's kv_stores /
state_stores -> `done` after that plan's result: unpinned (the connector completes them).
A lost store unpins everything in flight (`unpin_prepared`, `lost`).
"""

from __future__ import annotations

from services.engine.kv_connector import CheckpointPins, StorePins


class StoreBook:
    """Stores queued, prepared and ready; the pins they hold.

    pins: the block manager; checkpoints: the scheduler's state slots (None: a dense
    model). Attributes: queued_blocks ((block, name)), queued_states ((name, checkpoint
    slot)), ready_blocks ((block, pool slot)), ready_states ((checkpoint slot, state pool
    slot)), num_pinned (blocks and checkpoint slots pinned).
    """

    def __init__(self, pins: StorePins, checkpoints: CheckpointPins | None = None):
        self.pins, self.checkpoints = pins, checkpoints
        self.queued_blocks: list[tuple[int, bytes]] = []
        self.queued_states: list[tuple[bytes, int]] = []
        self.ready_blocks: list[tuple[int, int]] = []
        self.ready_states: list[tuple[int, int]] = []
        self.num_pinned = 0

    def queue_blocks(self, blocks: list[tuple[int, bytes]]) -> None:
        """(block id, name) pairs a step named in the prefix cache."""
        self.queued_blocks.extend(blocks)

    def queue_states(self, saved: list[tuple[bytes, int]]) -> None:
        """(block name, checkpoint slot) pairs a step saved (ignored for a dense model)."""
        if self.checkpoints is not None:
            self.queued_states.extend(saved)

    def take_prepare(self) -> tuple[list[tuple[int, bytes]], list[tuple[bytes, int]]]:
        """The queued stores to prepare, pinned now; the queues are emptied. A block renamed
        or freed since its step named it (e.g. reset_prefix_cache in between) holds other
        bytes, or none: it is not stored and never pinned (a pin on a free block would let it
        be handed out twice); likewise a checkpoint slot evicted or forgotten since its save."""
        blocks = [(blk, h) for blk, h in self.queued_blocks if self.pins.is_named(blk, h)]
        ck = self.checkpoints
        states = [(h, slot) for h, slot in self.queued_states if ck is not None and ck.holds(slot, h)]
        self.queued_blocks, self.queued_states = [], []
        for blk, _ in blocks:
            self.pins.pin_for_store(blk)
        for _, slot in states:
            assert ck is not None
            ck.pin(slot)
        self.num_pinned += len(blocks) + len(states)
        return blocks, states

    def prepared(self, blocks: list[tuple[int, bytes]], slots: list[int],
                 states: list[tuple[bytes, int]], state_slots: list[int]) -> None:
        """The store's answer to a KVPrepareStore of `blocks` and `states`: pool slots
        (-1: not stored, unpinned now)."""
        for (blk, _), slot in zip(blocks, slots + [-1] * (len(blocks) - len(slots))):
            if slot >= 0:
                self.ready_blocks.append((blk, slot))
            else:
                self._unpin_block(blk)
        for (_, ck_slot), slot in zip(states, state_slots + [-1] * (len(states) - len(state_slots))):
            if slot >= 0:
                self.ready_states.append((ck_slot, slot))
            else:
                self._unpin_state(ck_slot)

    def has_ready(self) -> bool:
        """Whether prepared stores wait for a plan."""
        return bool(self.ready_blocks or self.ready_states)

    def take_ready(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(kv_stores, state_stores) for the plan being built."""
        out = self.ready_blocks, self.ready_states
        self.ready_blocks, self.ready_states = [], []
        return out

    def done(self, kv_stores: list[tuple[int, int]], state_stores: list[tuple[int, int]]) -> None:
        """A plan's stores came back (copied or not): unpin their blocks and checkpoint slots."""
        for blk, _ in kv_stores:
            self._unpin_block(blk)
        for slot, _ in state_stores:
            self._unpin_state(slot)

    def unpin_prepared(self, blocks: list[tuple[int, bytes]], states: list[tuple[bytes, int]]) -> None:
        """A KVPrepareStore that will get no answer (the store is lost): unpin its entries."""
        for blk, _ in blocks:
            self._unpin_block(blk)
        for _, slot in states:
            self._unpin_state(slot)

    def lost(self) -> None:
        """The store is gone: unpin the ready stores, drop the queued ones."""
        self.done(self.ready_blocks, self.ready_states)
        self.ready_blocks, self.ready_states = [], []
        self.clear_queued()

    def clear_queued(self) -> None:
        """Forget the queued stores (nothing is pinned for them)."""
        self.queued_blocks, self.queued_states = [], []

    def _unpin_block(self, blk: int) -> None:
        self.pins.unpin_store(blk)
        self.num_pinned -= 1

    def _unpin_state(self, slot: int) -> None:
        assert self.checkpoints is not None  # state stores exist only for a hybrid model
        self.checkpoints.unpin(slot)
        self.num_pinned -= 1
