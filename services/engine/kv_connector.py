"""The seam between the scheduler and a KV cache outside the GPU (docs/ARCHITECTURE.md §4
"Tiers"): the scheduler asks, the connector answers, and neither edits the other's state.

Modelled on the scheduler role of vLLM V1's `KVConnectorBase_V1`
(`get_num_new_matched_tokens`, `update_state_after_alloc`, `build_connector_meta`,
`request_finished`), with our names. The scheduler calls, in the order of a request's life:

- `lookup(request, num_local_blocks)` each time a waiting request could be admitted, with
  its GPU-local prefix hit in blocks. None: the connector asked its store now and answers
  later (the scheduler parks the request in WAITING_FOR_KV); the answer arrives as a call
  of the scheduler's `kv_lookup_done(request)`, given at `bind`. An int n >= 0: blocks
  num_local_blocks .. num_local_blocks + n can be loaded now (0: none, or not asked).
- `on_allocated(request, block_ids)` once the request is admitted: the fresh blocks that
  receive the n loadable blocks (possibly none). It ends the request's lookup: a request
  that waits again (preempted) is asked about again.
- `on_cached(blocks)` after a step: blocks newly named in the prefix cache (candidates to
  store). The connector store-pins them through `StorePins` while their copy is in flight.
- `take_transfers()` when the scheduler builds a plan: the step's loads and stores.
- `step_done(plan, store_ok)` when that plan's result came back.
- `release(request)`: the request finished (or must compute every position itself): hand
  back whatever the connector holds for it.
The engine loop calls `service()` (replies, timeouts, reconnects; never blocks) whenever
`socket` is readable or the loop turns, `has_stores()` (a transfer-only step is worth
running), `stats()` and `close()`.

No connector is `None` in the scheduler (one attribute test per call site).

Cache groups (issue 16): a request will hold one block table per cache group (paged KV and
recurrent state slots). The interface grows by giving `on_allocated` and `on_cached` block
ids per group (a tuple of lists, group order) and `KVTransfers` a group per copy; `lookup`
stays in blocks of the attention group, the unit of a prefix hit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from services.engine.request import Request
from shared.protocol import StepPlan

if TYPE_CHECKING:  # the core imports this module and stays free of zmq
    import zmq


@dataclass(slots=True)
class KVLoad:
    """A ready reservation in the store for one request's blocks past its local hit.

    first: index (in request.block_hashes) of the first reserved block. slots: the store's
    pool slots holding blocks first, first+1, ... (pinned by the store until handed back).
    tiers: the tier each block came from ("cpu" or "disk"), aligned with slots.
    """

    first: int
    slots: list[int]
    tiers: list[str]


@dataclass(slots=True)
class KVTransfers:
    """One step's tier copies, as `StepPlan` carries them.

    loads: (pool slot, KV block id): copied into the block before the step runs.
    stores: (KV block id, pool slot): copied into the slot after the step ran.
    pool / pool_pid: the pool segment's /dev/shm name and the pid of the store that made it.
    """

    loads: list[tuple[int, int]]
    stores: list[tuple[int, int]]
    pool: str
    pool_pid: int


class StorePins(Protocol):
    """What a connector may do to the block manager: keep blocks out of reuse while their
    store is in flight (`services.engine.block_manager.BlockManager` implements it)."""

    block_size: int

    def pin_for_store(self, blk: int) -> None: ...

    def unpin_store(self, blk: int) -> None: ...

    def is_named(self, blk: int, name: bytes) -> bool: ...


_UNBOUND = "KV connector used before Scheduler.attach_connector bound it"


def _unbound(request: Request) -> None:
    raise RuntimeError(_UNBOUND)


class _UnboundPins:
    """Stands in for the block manager until `bind`: any use is a wiring bug."""

    block_size = 0

    def pin_for_store(self, blk: int) -> None:
        raise RuntimeError(_UNBOUND)

    def unpin_store(self, blk: int) -> None:
        raise RuntimeError(_UNBOUND)

    def is_named(self, blk: int, name: bytes) -> bool:
        raise RuntimeError(_UNBOUND)


class KVConnector(ABC):
    """A KV cache outside the GPU, as the scheduler sees it (module doc).

    `bind` is called once by `Scheduler.attach_connector`: pins is the scheduler's block
    manager, on_lookup_done the scheduler method that takes a parked request back (call it
    once per lookup that returned None, also when the store went away: the request then
    loads nothing). A connector never edits the scheduler's queues or request states.
    """

    def __init__(self) -> None:
        self._pins: StorePins = _UnboundPins()
        self._on_lookup_done: Callable[[Request], None] = _unbound

    def bind(self, pins: StorePins, on_lookup_done: Callable[[Request], None]) -> None:
        """Connect to one scheduler's block manager and its lookup-done callback."""
        self._pins, self._on_lookup_done = pins, on_lookup_done

    # ------------------------------------------------------------ scheduler role
    @abstractmethod
    def lookup(self, request: Request, num_local_blocks: int) -> int | None:
        """Blocks loadable past the local hit now (>= 0), or None: asked, answer later."""

    @abstractmethod
    def on_allocated(self, request: Request, block_ids: Sequence[int]) -> None:
        """request was admitted; block_ids receive the blocks `lookup` said were loadable."""

    @abstractmethod
    def on_cached(self, blocks: list[tuple[int, bytes]]) -> None:
        """(block id, name) pairs newly registered in the prefix cache by a step."""

    @abstractmethod
    def release(self, request: Request) -> None:
        """The scheduler will load nothing for request: hand back what is held for it."""

    @abstractmethod
    def take_transfers(self) -> KVTransfers | None:
        """The copies the plan being built carries (None: none)."""

    @abstractmethod
    def step_done(self, plan: StepPlan, store_ok: bool) -> None:
        """plan's result came back; store_ok: the workers copied its stores."""

    # ------------------------------------------------------------ engine loop
    @property
    @abstractmethod
    def socket(self) -> zmq.Socket | None:
        """The socket to poll next to the engine's others (None: none; may change)."""

    @abstractmethod
    def service(self) -> None:
        """Read replies, check timeouts, send what is queued. Never blocks."""

    @abstractmethod
    def has_stores(self) -> bool:
        """Whether stores wait for a plan (worth a transfer-only step when idle)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters merged into the engine's `stats` (names start with kv_tier_)."""

    @abstractmethod
    def close(self) -> None:
        """End the connection; the connector is not used afterwards."""
