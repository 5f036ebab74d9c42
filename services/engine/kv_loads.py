"""A KV connector's book of lookup answers and the loads they turn into
(docs/ARCHITECTURE.md §4 "Tiers"). Socket-free: `KVStoreConnector`
(services/engine/kv_tiers.py) keeps one, and so can a test connector.

An answer is recorded per request id when its lookup is settled: a ready reservation
(`KVLoad`), or None (nothing to load: a miss, no full block past the local hit, or a store
that went away). It lasts until the request is admitted (`admit`) or released, so that a
request asked about once is not asked again while it waits.

At admission the reservation is cut to extend the request's current local hit (`usable`):
the loaded run starts where the local hit ends now; the slots of blocks the local hit has
covered since, and of blocks past the last one a request may take from a cache
((num_tokens - 1) // block_size: its last token is always computed), go back to the store
(`to_release`). A local hit shorter than where the run starts drops the whole reservation:
a gap cannot be loaded.

A hybrid model (docs/ARCHITECTURE.md §4.7; `checkpoints` set): a reservation may also hold
the state checkpoint after one block (`KVLoad.state`); it is kept while its block lies
within the local hit and the usable run, and handed back (`to_release_states`) otherwise or
when the scheduler does not use it. A local hit covering every block a request may take
settles the lookup only when the last of them also has a local checkpoint.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from services.engine.kv_connector import CheckpointPins, KVLoad
from services.engine.request import Request


class LoadBook:
    """Answers, slots to hand back, the loads of the plan being built, hit counts.

    block_size: tokens per block. Attributes: answers (request id -> KVLoad or None),
    to_release (pool slots the store must get back), step_loads ((pool slot, block id) of
    the admissions since `take_loads`), hit_tokens (tier -> tokens loaded from it); for a
    hybrid model checkpoints (the scheduler's, set at bind; None otherwise),
    to_release_states, step_state_loads ((state pool slot, checkpoint slot)) and
    state_hits (tier -> checkpoints loaded from it).
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.answers: dict[str, KVLoad | None] = {}
        self.to_release: list[int] = []
        self.step_loads: list[tuple[int, int]] = []
        self.hit_tokens: Counter[str] = Counter()
        self.checkpoints: CheckpointPins | None = None
        self.to_release_states: list[int] = []
        self.step_state_loads: list[tuple[int, int]] = []
        self.state_hits: Counter[str] = Counter()

    def _give_back(self, load: KVLoad) -> None:
        self.to_release.extend(load.slots)
        if load.state is not None:
            self.to_release_states.append(load.state.slot)

    def local_checkpoint_end(self, request: Request, num_local_blocks: int) -> int:
        """The longest head of the local hit whose last block has a local checkpoint, in
        blocks (0: none; num_local_blocks for a model without checkpoints)."""
        ck = self.checkpoints
        if ck is None:
            return num_local_blocks
        for j in range(num_local_blocks, 0, -1):
            if ck.has_checkpoint(request.block_hashes[j - 1]):
                return j
        return 0

    def answered(self, request_id: str) -> bool:
        """Whether the lookup of this request is settled (and not yet admitted)."""
        return request_id in self.answers

    def reservation(self, request_id: str) -> KVLoad | None:
        """The ready reservation of this request, if any."""
        return self.answers.get(request_id)

    def lookup(self, request: Request, num_local_blocks: int, available: bool) -> int | None:
        """The policy of `KVConnector.lookup`: a settled request gets its usable blocks;
        otherwise None (ask the store now) when the store is `available` and the request has
        full blocks past its local hit. With none past it the lookup is settled at once
        (0); with the store away nothing is settled (0: asked about once it is back)."""
        if request.request_id in self.answers:
            return self.usable(request, num_local_blocks)
        if not available:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        if num_local_blocks >= max_blocks and self.local_checkpoint_end(request, max_blocks) == max_blocks:
            self.answers[request.request_id] = None
            return 0
        return None

    def answer(self, request: Request, load: KVLoad | None) -> bool:
        """Record the settled lookup of `request`. A request that finished meanwhile only
        gives the slots back; returns False for it (nobody waits for the answer)."""
        if request.is_finished:
            if load is not None:
                self._give_back(load)
            return False
        old = self.answers.get(request.request_id)
        if old is not None:
            self._give_back(old)
        self.answers[request.request_id] = load
        return True

    def usable(self, request: Request, num_local_blocks: int) -> int:
        """Blocks of the reservation that extend the local hit of `num_local_blocks` blocks
        (module doc); the reservation is cut to them, the other slots are handed back."""
        rid = request.request_id
        load = self.answers.get(rid)
        if load is None:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        skip = num_local_blocks - load.first
        if 0 <= skip < len(load.slots):
            use = load.slots[skip:skip + max(0, max_blocks - num_local_blocks)]
            self.to_release.extend(load.slots[:skip] + load.slots[skip + len(use):])
            first, tiers = load.first + skip, load.tiers[skip:skip + len(use)]
        else:  # a gap, or nothing past the local hit: no block of the run is usable
            use, first, tiers = [], num_local_blocks, []
            self.to_release.extend(load.slots)
        state = load.state
        if state is not None and not state.index < min(num_local_blocks + len(use), max_blocks):
            self.to_release_states.append(state.slot)  # its block is neither local nor loadable
            state = None
        self.answers[rid] = KVLoad(first, use, tiers, state) if use or state is not None else None
        return len(use)

    def checkpoint_index(self, request: Request) -> int | None:
        """The block index of the state checkpoint in request's (cut) reservation, or None."""
        load = self.answers.get(request.request_id)
        return load.state.index if load is not None and load.state is not None else None

    def admit(self, request: Request, block_ids: Sequence[int], state_slot: int = -1) -> None:
        """`request` was admitted with `block_ids` for the head of its cut reservation (at
        most as many as `usable` returned) and `state_slot` the checkpoint slot for its state
        checkpoint (-1: not used): those copies join the next plan, the rest goes back; its
        answer is consumed."""
        load = self.answers.pop(request.request_id, None)
        if load is None:
            return
        n = len(block_ids)
        self.step_loads.extend(zip(load.slots[:n], block_ids))
        self.to_release.extend(load.slots[n:])  # none when the scheduler took them all
        for tier in load.tiers[:n]:
            self.hit_tokens[tier] += self.block_size
        if load.state is not None:
            if state_slot >= 0:
                self.step_state_loads.append((load.state.slot, state_slot))
                self.state_hits[load.state.tier] += 1
            else:
                self.to_release_states.append(load.state.slot)

    def release(self, request: Request) -> None:
        """Forget `request`'s answer; a reservation's slots go back to the store."""
        load = self.answers.pop(request.request_id, None)
        if load is not None:
            self._give_back(load)

    def store_lost(self) -> None:
        """The store went away, and its pins with it: drop every reservation without
        handing slots back (the answers stay: those requests are not asked about again)."""
        for rid, load in self.answers.items():
            if load is not None:
                self.answers[rid] = None
        self.to_release.clear()
        self.to_release_states.clear()

    def take_loads(self) -> list[tuple[int, int]]:
        """The loads of the admissions since the last call, for the plan being built."""
        loads, self.step_loads = self.step_loads, []
        return loads

    def take_state_loads(self) -> list[tuple[int, int]]:
        """The checkpoint loads ((state pool slot, checkpoint slot)) of the admissions since
        the last call, for the plan being built."""
        loads, self.step_state_loads = self.step_state_loads, []
        return loads


def hit_end(request: Request, checkpoints: CheckpointPins, upto: int, state_first: int,
            state_tiers: Sequence[str]) -> tuple[int, int]:
    """A hybrid model's hit end in blocks (docs/ARCHITECTURE.md §4.7): the largest j in
    (state_first, upto] whose block j - 1 has a state checkpoint, local (`checkpoints`) or
    in the store (state_tiers[j - 1 - state_first] not "", a `KVLookupResult`'s answer for
    the checkpoints after blocks state_first ..). Blocks up to upto are local or loadable.
    Returns (j, j - 1 when it is the store's checkpoint that ends the hit, else -1), or
    (0, -1) when no block in that range has one."""
    for j in range(upto, state_first, -1):
        if checkpoints.has_checkpoint(request.block_hashes[j - 1]):
            return j, -1
        i = j - 1 - state_first
        if i < len(state_tiers) and state_tiers[i]:
            return j, j - 1
    return 0, -1
