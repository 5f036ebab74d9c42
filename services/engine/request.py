"""The engine's view of one request: its tokens, progress, blocks and state machine.

States: WAITING (admitted, not scheduled, or preempted) -> RUNNING -> FINISHED, with
WAITING -> WAITING_FOR_KV -> WAITING while the KV connector asks its store for the blocks
after the request's GPU-local prefix hit (a lookup, then a reservation of pool slots); such
a request sits in the scheduler's `waiting_for_kv`, out of the step's way. What the
connector learns (the reservation) stays in the connector (services/engine/kv_loads.py).
A preempted request goes back to WAITING with num_computed_tokens = 0 and recomputes
prompt + outputs so far (recompute preemption, as in vLLM); on re-admission it first takes
whatever of that prefix is still in the prefix cache, like any new request.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from shared.protocol import FinishReason, SamplingParams, TokenLogprob

if TYPE_CHECKING:  # xgrammar is imported only where grammars are compiled
    from services.engine.spec_policy import SpecState
    from services.engine.structured import RequestGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One generation request inside the engine.

    prompt_token_ids / output_token_ids: token ids. num_computed_tokens: tokens whose KV is
    in the cache. block_ids: the request's block table (KV block ids, in order).
    frontend: ZMQ identity of the frontend that owns the request (outputs go there).
    block_hashes: chained names (shared.hashing) of the full blocks of prompt + outputs,
    filled lazily by the block manager; they depend only on the tokens, so they survive
    preemption. num_registered_blocks: leading blocks of block_ids already offered to the
    prefix cache (reset when the blocks are freed). num_cached_tokens: prefix cache hit of
    the first admission, in tokens (-1 before it is admitted).
    output_logprobs: one TokenLogprob per output token when sampling.logprobs is set.
    prompt_logprobs: logprobs of prompt tokens 1.. gathered over prefill chunks (when
    sampling.prompt_logprobs is set); sent once, with the first output
    (prompt_logprobs_sent). grammar: the structured-output matcher
    (`services.engine.structured.RequestGrammar`) or None.
    worker_blocks: how many leading entries of block_ids the workers already hold
    (`shared.plan_state`); 0 = the next seq carries the whole table and the parameters.
    Async scheduling: num_computed_tokens counts the tokens of plans already sent (their
    KV is written before any later plan runs); inflight is the number of sampling seqs of
    those plans whose tokens have not come back yet (the next decode feeds PENDING_TOKEN; a
    verify seq counts one, and nothing is planned past it);
    epoch counts preemptions, so a result of a plan made before one only adds its tokens.
    Speculative decoding (docs/ARCHITECTURE.md §5.5): draft_token_ids are the drafts for its
    next seq (proposed by the workers after its last seq, or found at plan time by the
    engine-side drafter; current epoch only; cleared when its next seq is planned and on
    preemption); spec_inflight is True while a seq that verified or proposed drafts is in
    flight (the next plan must wait for its result); lookup_due: the engine-side drafter
    found a match in its known tokens while a token was in flight, so the next plan waits
    for that result and looks up again; drafter_state: that drafter's index; spec is the
    speculation policy's per-request state (`services.engine.spec_policy.SpecState`), None
    while speculation is off.
    KV tier load failures (docs/ARCHITECTURE.md §4.5): void_epoch is the epoch from which
    results count; a plan made before a failed load's step returned (older epoch) was
    built on garbage for this request and its results are dropped. no_tier_loads: a load of
    this request failed; it never loads from the tiers again (it recomputes instead).
    """

    __slots__ = ("request_id", "frontend", "prompt_token_ids", "output_token_ids", "sampling",
                 "arrival_time", "num_computed_tokens", "block_ids", "status", "finish_reason",
                 "stop_token_id", "num_preemptions", "first_scheduled", "sent_tokens",
                 "block_hashes", "num_registered_blocks", "num_cached_tokens",
                 "output_logprobs", "prompt_logprobs", "prompt_logprobs_sent", "grammar",
                 "worker_blocks", "inflight", "epoch", "draft_token_ids", "spec_inflight", "spec",
                 "lookup_due", "drafter_state", "state_slot", "void_epoch", "no_tier_loads")

    def __init__(self, request_id: str, frontend: bytes, prompt_token_ids: list[int],
                 sampling: SamplingParams, arrival_time: float | None = None):
        self.request_id = request_id
        self.frontend = frontend
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling = sampling
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_token_id: int | None = None
        self.num_preemptions = 0
        self.first_scheduled: float | None = None
        self.sent_tokens = 0  # output tokens already sent to the frontend
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.num_cached_tokens = -1
        self.output_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs_sent = False
        self.grammar: RequestGrammar | None = None
        self.worker_blocks = 0  # leading block_ids the workers hold (0: send all, with sampling)
        self.inflight = 0  # sampling seqs sent whose results have not come back (0 or 1)
        self.epoch = 0  # bumped by each preemption: results of older plans only add tokens
        self.draft_token_ids: list[int] = []  # drafts for the next seq (§5.5)
        self.spec_inflight = False  # a seq that verified or proposed is in flight
        self.spec: SpecState | None = None  # the speculation policy's state (spec_policy.py)
        self.lookup_due = False  # the engine-side drafter wants its next plan after this result
        self.drafter_state: Any = None  # the engine-side drafter's index (ngram_drafts.py)
        self.state_slot = -1  # a hybrid model's recurrent-state slot while running (state_slots.py)
        self.void_epoch = 0  # results of plans of an older epoch are dropped (a failed tier load)
        self.no_tier_loads = False  # a tier load of it failed: it recomputes, never loads again

    @property
    def has_penalty(self) -> bool:
        sp = self.sampling
        return sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while the prompt's logprobs are still to be computed and sent."""
        return self.sampling.prompt_logprobs is not None and not self.prompt_logprobs_sent

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens (those that came back; `inflight` not counted)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs, without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})")
