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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from services.engine.kv_connector import KVLoad
from services.engine.request import Request


class LoadBook:
    """Answers, slots to hand back, the loads of the plan being built, hit counts.

    block_size: tokens per block. Attributes: answers (request id -> KVLoad or None),
    to_release (pool slots the store must get back), step_loads ((pool slot, block id) of
    the admissions since `take_loads`), hit_tokens (tier -> tokens loaded from it).
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.answers: dict[str, KVLoad | None] = {}
        self.to_release: list[int] = []
        self.step_loads: list[tuple[int, int]] = []
        self.hit_tokens: Counter[str] = Counter()

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
        if num_local_blocks >= (request.num_tokens - 1) // self.block_size:
            self.answers[request.request_id] = None
            return 0
        return None

    def answer(self, request: Request, load: KVLoad | None) -> bool:
        """Record the settled lookup of `request`. A request that finished meanwhile only
        gives the slots back; returns False for it (nobody waits for the answer)."""
        if request.is_finished:
            if load is not None:
                self.to_release.extend(load.slots)
            return False
        old = self.answers.get(request.request_id)
        if old is not None:
            self.to_release.extend(old.slots)
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
        if skip < 0 or skip >= len(load.slots):
            self.to_release.extend(load.slots)
            self.answers[rid] = None
            return 0
        use = load.slots[skip:skip + max(0, max_blocks - num_local_blocks)]
        self.to_release.extend(load.slots[:skip] + load.slots[skip + len(use):])
        self.answers[rid] = (KVLoad(load.first + skip, use, load.tiers[skip:skip + len(use)])
                             if use else None)
        return len(use)

    def admit(self, request: Request, block_ids: Sequence[int]) -> None:
        """`request` was admitted with `block_ids` for its cut reservation (as many as
        `usable` returned): those copies join the next plan; its answer is consumed."""
        load = self.answers.pop(request.request_id, None)
        if load is None:
            return
        n = len(block_ids)
        self.step_loads.extend(zip(load.slots[:n], block_ids))
        self.to_release.extend(load.slots[n:])  # none when the scheduler took them all
        for tier in load.tiers[:n]:
            self.hit_tokens[tier] += self.block_size

    def release(self, request: Request) -> None:
        """Forget `request`'s answer; a reservation's slots go back to the store."""
        load = self.answers.pop(request.request_id, None)
        if load is not None:
            self.to_release.extend(load.slots)

    def store_lost(self) -> None:
        """The store went away, and its pins with it: drop every reservation without
        handing slots back (the answers stay: those requests are not asked about again)."""
        for rid, load in self.answers.items():
            if load is not None:
                self.answers[rid] = None
        self.to_release.clear()

    def take_loads(self) -> list[tuple[int, int]]:
        """The loads of the admissions since the last call, for the plan being built."""
        loads, self.step_loads = self.step_loads, []
        return loads
