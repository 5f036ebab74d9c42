"""The kvstore calls a `KVStoreConnector` waits on, one small record per kind
(docs/ARCHITECTURE.md §4 "Tiers"). `sent` is time.monotonic() when the call went out: a
call unanswered past the connector's limit (`load_timeout_s` for a reservation, which may
wait for disk promotions; `reply_timeout_s` for the others) means the store is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from services.engine.request import Request


@dataclass(slots=True)
class TierCall:
    """A call waiting for its reply. kind names it in logs."""

    kind: ClassVar[str] = "call"
    sent: float


@dataclass(slots=True)
class PingCall(TierCall):
    """KVStats sent while idle: a store that does not answer it is lost."""

    kind: ClassVar[str] = "ping"


@dataclass(slots=True)
class AckCall(TierCall):
    """KVCompleteLoad / KVCompleteStore: only a KVAck comes back."""

    kind: ClassVar[str] = "ack"


@dataclass(slots=True)
class LookupCall(TierCall):
    """KVLookup of `hashes` = request.block_hashes[first:...] (the blocks past its local hit)
    and, for a hybrid model, of the checkpoints after blocks state_first .. (from the end of
    its locally checkpointed hit to the last block it may take)."""

    kind: ClassVar[str] = "lookup"
    request: Request
    first: int
    hashes: list[bytes]
    state_first: int = 0


@dataclass(slots=True)
class ReserveCall(TierCall):
    """KVReserveLoad of the hit run: blocks first .. first + len(tiers) of request, and for a
    hybrid model the checkpoint after block state_index (-1: none) from state_tier.
    slots, state_slots: set by a KVLoadReserved that is not ready yet (disk promotions
    run), until the KVLoadReady that says how many of them hold their entry."""

    kind: ClassVar[str] = "reserve"
    request: Request
    first: int
    tiers: list[str]
    slots: list[int] | None = None
    state_index: int = -1
    state_tier: str = ""
    state_slots: list[int] | None = None


@dataclass(slots=True)
class PrepareCall(TierCall):
    """KVPrepareStore of `blocks` ((block id, name) pairs, store-pinned meanwhile) and of
    `states` ((block name, checkpoint slot) pairs, their slots pinned meanwhile)."""

    kind: ClassVar[str] = "prepare"
    blocks: list[tuple[int, bytes]]
    states: list[tuple[bytes, int]] = field(default_factory=list)
