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
- `tier_checkpoint(request)` (a hybrid model, right after `lookup` answered n): the index
  of the block whose recurrent-state checkpoint the store holds for the request, within
  the local hit and the n loadable blocks (None: none).
- `on_allocated(request, block_ids, state_slot)` once the request is admitted: the fresh
  blocks that receive the first len(block_ids) of the n loadable blocks (possibly none;
  the others go back), and the checkpoint slot that receives the tier's checkpoint (-1:
  not used). It ends the request's lookup: a request that waits again (preempted) is
  asked about again.
- `on_cached(blocks)` after a step: blocks newly named in the prefix cache (candidates to
  store). The connector store-pins them through `StorePins` while their copy is in flight.
- `on_checkpoints(saved)` after a step: the state checkpoints it saved (a hybrid model;
  candidates to store). The connector pins their slots through `CheckpointPins`.
- `take_transfers()` when the scheduler builds a plan: the step's loads and stores.
- `step_done(plan, store_ok)` when that plan's result came back.
- `release(request)`: the request finished (or must compute every position itself): hand
  back whatever the connector holds for it.
The engine loop calls `service()` (replies, timeouts, reconnects; never blocks) whenever
`socket` is readable or the loop turns, `has_stores()` (a transfer-only step is worth
running), `stats()` and `close()`.

No connector is `None` in the scheduler (one attribute test per call site).

Cache groups (docs/ARCHITECTURE.md §4.7): a hybrid model's recurrent state is not paged; a
prefix hit also needs the state checkpoint after its last block. The scheduler binds its
`StateSlots` (as `CheckpointPins`); the connector then also looks up and loads the store's
checkpoints with the block run, and stores the checkpoints the steps save. `lookup` stays in
blocks of the attention group, the unit of a prefix hit; the scheduler trims the hit to the
longest prefix whose last block has a checkpoint, local or in the tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from services.engine.request import Request
from shared.protocol import StepPlan

if TYPE_CHECKING:  # the core imports this module and stays free of zmq
    import zmq


@dataclass(slots=True)
class StateLoad:
    """A reserved state checkpoint of a hybrid model: the state after block `index` (of
    request.block_hashes), pinned in the store's state pool `slot`, from `tier`."""

    index: int
    slot: int
    tier: str


@dataclass(slots=True)
class KVLoad:
    """A ready reservation in the store for one request's blocks past its local hit.

    first: index (in request.block_hashes) of the first reserved block. slots: the store's
    pool slots holding blocks first, first+1, ... (pinned by the store until handed back).
    tiers: the tier each block came from ("cpu" or "disk"), aligned with slots.
    state: a hybrid model's reserved state checkpoint (None: none).
    """

    first: int
    slots: list[int]
    tiers: list[str]
    state: StateLoad | None = None


@dataclass(slots=True)
class KVTransfers:
    """One step's tier copies, as `StepPlan` carries them.

    loads: (pool slot, KV block id): copied into the block before the step runs.
    stores: (KV block id, pool slot): copied into the slot after the step ran.
    pool / pool_pid: the pool segment's /dev/shm name and the pid of the store that made it.
    state_loads: (state pool slot, checkpoint slot), before the step; state_stores:
    (checkpoint slot, state pool slot), after it; state_pool: that pool's name.
    """

    loads: list[tuple[int, int]]
    stores: list[tuple[int, int]]
    pool: str
    pool_pid: int
    state_loads: list[tuple[int, int]] = field(default_factory=list)
    state_stores: list[tuple[int, int]] = field(default_factory=list)
    state_pool: str = ""


class StorePins(Protocol):
    """What a connector may do to the block manager: keep blocks out of reuse while their
    store is in flight (`services.engine.block_manager.BlockManager` implements it)."""

    block_size: int

    def pin_for_store(self, blk: int) -> None: ...

    def unpin_store(self, blk: int) -> None: ...

    def is_named(self, blk: int, name: bytes) -> bool: ...


class CheckpointPins(Protocol):
    """What a connector may ask of and do to a hybrid model's state checkpoints: which blocks
    have one, and keep a slot from eviction while its copy into the store is in flight
    (`services.engine.state_slots.StateSlots` implements it)."""

    def has_checkpoint(self, name: bytes) -> bool: ...

    def holds(self, slot: int, name: bytes) -> bool: ...

    def pin(self, slot: int) -> None: ...

    def unpin(self, slot: int) -> None: ...


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
    loads nothing), checkpoints the scheduler's state slots (a hybrid model; None for a
    dense one). A connector never edits the scheduler's queues or request states.
    """

    def __init__(self) -> None:
        self._pins: StorePins = _UnboundPins()
        self._on_lookup_done: Callable[[Request], None] = _unbound
        self._checkpoints: CheckpointPins | None = None

    def bind(self, pins: StorePins, on_lookup_done: Callable[[Request], None],
             checkpoints: CheckpointPins | None = None) -> None:
        """Connect to one scheduler's block manager, its lookup-done callback and (a hybrid
        model) its state checkpoints."""
        self._pins, self._on_lookup_done, self._checkpoints = pins, on_lookup_done, checkpoints

    # ------------------------------------------------------------ scheduler role
    @abstractmethod
    def lookup(self, request: Request, num_local_blocks: int) -> int | None:
        """Blocks loadable past the local hit now (>= 0), or None: asked, answer later."""

    def tier_checkpoint(self, request: Request) -> int | None:
        """The block index whose state checkpoint the store holds for request (module doc);
        None: none (a connector without checkpoints)."""
        return None

    @abstractmethod
    def on_allocated(self, request: Request, block_ids: Sequence[int], state_slot: int = -1) -> None:
        """request was admitted; block_ids receive the first of the blocks `lookup` said
        were loadable, state_slot the checkpoint of `tier_checkpoint` (-1: not used)."""

    @abstractmethod
    def on_cached(self, blocks: list[tuple[int, bytes]]) -> None:
        """(block id, name) pairs newly registered in the prefix cache by a step."""

    def on_checkpoints(self, saved: list[tuple[bytes, int]]) -> None:
        """(block name, checkpoint slot) of the state checkpoints a step saved (a hybrid
        model); a connector without checkpoints ignores them."""
        return None

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
