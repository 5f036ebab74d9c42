"""Every message that crosses a process boundary in Kestrel.

Encoding: msgspec MessagePack. Each direction is a tagged union, so a receiver decodes with
one typed decoder and dispatches on the type. No pickle anywhere. A message that fails to
decode is logged with the peer's identity and dropped (see `shared.zmq_utils.safe_decode`).

Directions:
- frontend -> engine (ZMQ DEALER -> ROUTER): `FrontendToEngine`
- engine -> frontend (same socket pair, routed by frontend identity): `EngineToFrontend`
- engine -> workers (shm ring broadcast): `EngineToWorker`
- worker rank 0 -> engine (ZMQ PUSH -> PULL): `WorkerToEngine`
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import msgspec

PROTOCOL_VERSION = 3  # 2: state checkpoints in the kvstore (docs/ARCHITECTURE.md §4.5); 3: no context_token_ids
# ScheduledSeq.token_ids entry for a token the workers sampled in the previous plan and the
# engine has not seen yet (async scheduling: plan N+1 is sent while step N runs).
PENDING_TOKEN = -1


# ---------------------------------------------------------------- shared pieces


class FinishReason(StrEnum):
    """Why a request ended (`RequestOutput.finish_reason`). Members are str: they encode as
    these plain strings and compare equal to them."""

    STOP = "stop"        # EOS or a stop token (a stop string is the frontend's: it aborts)
    LENGTH = "length"    # max_tokens or max_model_len
    ABORT = "abort"      # aborted by the frontend, or by the engine for a dropped frontend
    ERROR = "error"      # failed: `RequestOutput.error` says why, `error_kind` whose fault


class ErrorKind(StrEnum):
    """Whose fault a failed request is (`RequestOutput.error_kind`); each API maps it to its
    status. Members are str, as FinishReason's."""

    INVALID = "invalid"          # the request's own fault: 400
    OVERLOADED = "overloaded"    # the waiting queue is full: 503 + Retry-After
    INTERNAL = "internal"        # a fault inside Kestrel: 500
    UNAVAILABLE = "unavailable"  # the engine went away (restart, shutdown): 503 + Retry-After


class StructuredSpec(msgspec.Struct, array_like=True, omit_defaults=True):
    """A constraint on the generated text, compiled by the engine (xgrammar).

    kind: "json_schema" (spec = the schema as JSON text), "json_object" (spec unused),
    "regex" (spec = the pattern) or "grammar" (spec = EBNF/GBNF text).
    """

    kind: str
    spec: str = ""


class TokenLogprob(msgspec.Struct, array_like=True, omit_defaults=True):
    """Log-probability of one token (the chosen one) and the top alternatives at its position.

    logprob: natural log of the probability under the model's distribution after
    temperature-free softmax of the raw logits (as OpenAI reports). rank: 1 = argmax.
    top_ids / top_logprobs: the k most likely tokens at this position, best first.
    """

    token_id: int
    logprob: float
    rank: int = 0
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True):
    """Per-request sampling and stopping parameters.

    Sampling (used by the worker): temperature (0 = greedy), top_p in (0, 1], top_k
    (0 = off), min_p in [0, 1), seed (always set by the engine: a request without a seed gets
    a random one at admission, so that recompute after preemption samples the same tokens).
    Stopping (used by the engine): max_tokens (generated tokens), min_tokens, stop_token_ids,
    ignore_eos. Stop *strings* are checked by the frontend on text, which then aborts.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives per output token (0: chosen token only)
    prompt_logprobs: int | None = None  # same for prompt tokens (echo with logprobs)
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0  # OpenAI semantics, over output tokens
    repetition_penalty: float = 1.0  # CTRL (Keskar et al. 2019), over prompt + output tokens
    logit_bias: dict[int, float] = {}  # token id -> added to the logit
    structured: StructuredSpec | None = None


# ---------------------------------------------------------------- frontend -> engine


class Hello(msgspec.Struct, tag="hello", array_like=True):
    """First message of a frontend. A new identity with the same name means a restart:
    the engine aborts every request of the earlier identity."""

    frontend_id: str
    pid: int
    protocol_version: int = PROTOCOL_VERSION


class AddRequest(msgspec.Struct, tag="add", array_like=True, omit_defaults=True):
    """A new request for the engine. Token ids are prompt tokens."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float  # seconds, time.time() on the frontend


class Abort(msgspec.Struct, tag="abort", array_like=True):
    """Abort requests (client gone, stop string matched). Unknown ids are ignored."""

    request_ids: list[str]


class Heartbeat(msgspec.Struct, tag="hb", array_like=True):
    """Liveness beat from a frontend, and the engine's answer. Time in seconds (time.time()).

    In the engine's answer: progress counts the engine's completed steps, busy says whether
    it has requests to run. A busy engine whose progress stands still is stuck (/health).
    """

    time: float
    progress: int = 0
    busy: bool = False


class UtilityCall(msgspec.Struct, tag="call", array_like=True):
    """A control call (stats, reset_prefix_cache, debug hooks). The reply is a
    `UtilityResult` with the same call_id."""

    call_id: int
    method: str
    args: dict[str, Any] = {}


FrontendToEngine = Hello | AddRequest | Abort | Heartbeat | UtilityCall


# ---------------------------------------------------------------- engine -> frontend


class EngineInfo(msgspec.Struct, tag="info", array_like=True):
    """The engine's facts, sent in answer to `Hello`. max_num_waiting: the waiting-queue
    bound (0: none given); one HTTP request opens at most this many engine requests, or a
    request that could never be admitted whole would get 503 on every retry."""

    engine_id: str
    model_name: str
    model_path: str
    max_model_len: int
    block_size: int
    num_blocks: int
    eos_token_ids: list[int]
    max_num_waiting: int = 0


class RequestOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request since the last output.

    finish_reason: None while running, else a `FinishReason` ("error": `error` says why).
    stop_token_id: the token that ended the request on "stop", if any.
    error_kind: with finish_reason "error", an `ErrorKind`.
    """

    request_id: str
    new_token_ids: list[int]
    num_prompt_tokens: int
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    error_kind: ErrorKind | None = None
    logprobs: list[TokenLogprob] = []  # one per new token when sampling.logprobs is set
    prompt_logprobs: list[TokenLogprob | None] = []  # first output only; None for token 0


class Outputs(msgspec.Struct, tag="out", array_like=True):
    """A batch of request outputs, one engine step's worth, for one frontend."""

    outputs: list[RequestOutput]


class UtilityResult(msgspec.Struct, tag="callres", array_like=True, omit_defaults=True):
    """Answer to a `UtilityCall`. `error` is set when the call failed."""

    call_id: int
    result: dict[str, Any] = {}
    error: str | None = None


class NotAttached(msgspec.Struct, tag="notattached", array_like=True):
    """The engine's answer to a non-Hello message from an identity it does not know (it
    dropped that frontend after a silence, or it restarted). The frontend must fail every
    request it has in flight (the engine has none of them) and send Hello again."""

    reason: str


EngineToFrontend = EngineInfo | Outputs | UtilityResult | Heartbeat | NotAttached


# ---------------------------------------------------------------- engine -> worker


class ScheduledSeq(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's share of a step.

    token_ids: the tokens to run now (a prefill chunk, or the last sampled token for decode).
        A decode's one token may be PENDING_TOKEN: the token the workers sampled for this
        request in the previous plan with sampled seqs (the engine scheduled this step
        before that result came back); the workers take it from their own copy, on the GPU.
    start_pos: the position of token_ids[0]; tokens [0, start_pos) are already in the KV
        cache. The KV of token_ids is written at positions start_pos .. start_pos+len-1.
    block_table: the request's KV block ids from index `table_start` on; with the entries
        the workers already hold (`shared.plan_state`), the whole table covers at least
        start_pos + len(token_ids) tokens (block b holds positions [b*block_size,
        (b+1)*block_size)). table_start 0: the whole table (a request's first seq, or the
        first after a preemption); tables only grow while a request runs.
    sample: True when a token is sampled after this chunk (last prefill chunk, or decode).
    sampling: the request's parameters in its first seq (table_start 0); None after that
        (the workers keep them). Sending tables and parameters once per request instead of
        every step halves the plan's decode time at 256 decodes (shared.plan_state).
    output_index: index of the token to be sampled among the request's outputs (0 for the
        first; a pending token counts). Seeded sampling draws from (seed, output_index), so
        recompute is exact.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    sampling: SamplingParams | None
    output_index: int = 0
    # Only when penalties are set: the tokens they count (prompt + outputs so far).
    penalty_token_ids: list[int] = []
    num_prompt_tokens: int = 0
    # Only for structured output: allowed next tokens, a packed little-endian int32 bitmask
    # of ceil(vocab/32) words (xgrammar's layout); bit t set = token t allowed.
    allowed_token_bitmask: bytes | None = None
    table_start: int = 0
    # Speculative decoding (docs/ARCHITECTURE.md §5.5). num_draft: the last num_draft
    # entries of token_ids are draft tokens (token_ids = [last token, d1..dk]); with sample
    # True the workers sample at the last num_draft + 1 positions (output indexes
    # output_index .. output_index + num_draft) and return 1..num_draft+1 tokens: the
    # accepted drafts, then one recovered or bonus token (StepResult.num_sampled). With
    # structured output, allowed_token_bitmask then holds num_draft + 1 masks, one per
    # position, back to back; with penalties, position i counts penalty_token_ids plus
    # d1..di. num_propose: drafts the workers' proposer (the model-based methods; n-gram
    # drafts are the engine's) proposes for this request after this step (0: none); they
    # come back in StepResult.draft_token_ids. The block table covers
    # start_pos + len(token_ids) + num_propose tokens (a drafter writes its KV there).
    num_draft: int = 0
    num_propose: int = 0
    # A model with recurrent layers (gated DeltaNet; docs/ARCHITECTURE.md §4.7): the
    # request's state slot (services/engine/state_slots.py), -1 for a model without. The
    # seq continues from the slot's state when start_pos > 0; at start_pos 0 (a new or
    # preempted request) the workers start it from zeros.
    state_slot: int = -1
    # Prefix caching of a hybrid model (services/engine/state_slots.py): a checkpoint slot
    # whose state the workers copy into state_slot before running this seq (a prefix hit
    # resumes from it), and one they copy state_slot's state into after it (the seq ends at
    # its prompt's last full-block boundary); -1 for none.
    state_restore: int = -1
    state_save: int = -1


class StepPlan(msgspec.Struct, tag="step", array_like=True):
    """The plan of one engine step, broadcast to every worker over the shm ring.

    KV tier transfers (docs/ARCHITECTURE.md §4 "Tiers"; empty unless the kvstore is on):
    kv_loads: (pool slot, KV block id) pairs; each worker copies the slot into the block
        before running `seqs` (the step that first reads the block).
    kv_stores: (KV block id, pool slot) pairs; each worker copies the block into the slot
        after running `seqs`. The engine never reuses such a block before this step's
        result has come back.
    kv_pool: the pool segment's /dev/shm name and kv_pool_pid the pid of the kvstore that
        created it (the worker maps it again when the pid changes); set with any transfer.
    A plan may carry transfers and no seqs (a transfer-only step: no tokens come back).
    The slot byte layout is `services.worker.kv_transfer`'s.
    forget: ids of requests that ended since the last plan; the workers drop what they keep
    for them (`shared.plan_state`).
    A hybrid model's state checkpoints (docs/ARCHITECTURE.md §4.7) move through the
    kvstore's second pool, `state_pool` (same kvstore, kv_pool_pid): state_loads are
    (state pool slot, checkpoint slot) pairs copied before the step (before any
    `state_restore` reads the checkpoint), state_stores (checkpoint slot, state pool slot)
    pairs copied after it.
    """

    step_id: int
    seqs: list[ScheduledSeq]
    kv_loads: list[tuple[int, int]] = []
    kv_stores: list[tuple[int, int]] = []
    kv_pool: str = ""
    kv_pool_pid: int = 0
    forget: list[str] = []
    state_loads: list[tuple[int, int]] = []
    state_stores: list[tuple[int, int]] = []
    state_pool: str = ""


class WorkerShutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Tells the workers to exit cleanly."""

    reason: str = ""


EngineToWorker = StepPlan | WorkerShutdown


# ---------------------------------------------------------------- worker -> engine


class WorkerReady(msgspec.Struct, tag="ready", array_like=True):
    """Sent once by each worker after loading weights and sizing the KV cache."""

    rank: int
    pid: int
    num_blocks: int  # KV blocks the worker allocated (the engine uses the minimum)
    block_size: int
    device: str
    report: dict[str, Any] = {}


class StepResult(msgspec.Struct, tag="result", array_like=True, omit_defaults=True):
    """The sampled tokens of one step, from worker rank 0.

    sampled_token_ids: one token per ScheduledSeq with sample=True, in plan order.
    error: set when the step failed; the engine fails the step's requests.
    """

    step_id: int
    sampled_token_ids: list[int]
    error: str | None = None
    cpu_time: float = 0.0  # seconds the worker spent on this step
    # Aligned with sampled_token_ids when any request asked for logprobs (None otherwise).
    logprobs: list[TokenLogprob | None] = []
    # request_id -> logprobs of the prompt tokens scored this step, in position order: the
    # chunk's tokens after its first, plus its first (scored by the previous chunk's last row).
    prompt_logprobs: dict[str, list[TokenLogprob]] = {}
    # Set when the step's kv_stores could not be copied (the pool is unavailable): the
    # engine drops those stores. A failed load is `kv_load_error` below.
    kv_store_error: str = ""
    # Speculative decoding (docs/ARCHITECTURE.md §5.5). num_sampled: one count per seq with
    # sample=True (plan order), 1..num_draft+1, when any seq of the plan had drafts;
    # sampled_token_ids (and logprobs) are then flat, each seq's tokens back to back; empty:
    # one token per seq. draft_token_ids: request id -> the drafts proposed for its next
    # step (0..num_propose tokens, following the seq's last sampled token).
    num_sampled: list[int] = []
    draft_token_ids: dict[str, list[int]] = {}
    # Triton compiles and CUDA graph captures the worker met during this step, after it was
    # ready (services/worker/jit_watch.py): such a step's duration is not its cost.
    jit_compiles: int = 0
    # Set when the step's tier loads (kv_loads or state_loads) could not be copied: the
    # worker ran no forward and sampled nothing (a later plan's pending tokens of this step's
    # seqs read a dummy draw). The engine emits nothing for the step and sends its requests
    # back to recompute (docs/ARCHITECTURE.md §4.5, vLLM's kv_load_failure_policy "recompute").
    kv_load_error: str = ""


class WorkerHeartbeat(msgspec.Struct, tag="whb", array_like=True):
    """Liveness beat of a worker while idle."""

    rank: int
    time: float


WorkerToEngine = WorkerReady | StepResult | WorkerHeartbeat


# ---------------------------------------------------------------- codecs


def encoder() -> msgspec.msgpack.Encoder:
    """One encoder for every message type (msgspec encoders are not thread-safe)."""
    return msgspec.msgpack.Encoder()


def decoder(union: Any) -> msgspec.msgpack.Decoder:
    """A typed decoder for one direction's union, e.g. `decoder(FrontendToEngine)`."""
    return msgspec.msgpack.Decoder(union)


# ---------------------------------------------------------------- engine <-> kvstore
# Engine (ZMQ DEALER, one per client session) -> kvstore ROUTER at `kvstore_address`, and
# the replies back. Block names are the 32-byte chained hashes of `shared.hashing`; slots are
# indices into the kvstore's shm pool (layout in `shared.kv_pool`). Every request
# carries a client-chosen req_id that its reply repeats. A request before a successful
# KVHello is answered with KVError. Tiers are "cpu" (a pool slot) or "disk" (a file).
# A store for a hybrid model keeps a second namespace: the recurrent-state checkpoints
# (docs/ARCHITECTURE.md §4.7), each named by the block it follows and held in a slot of the
# second pool (`state_*` fields; empty for a dense model). Checkpoints and blocks are
# indexed, evicted and tiered independently: a checkpoint is a lookup of its own name.


class KVHello(msgspec.Struct, tag="kv_hello", array_like=True):
    """First message of a client. model_identity (32 bytes) and block_bytes (bytes of one
    block across all layers and ranks) must equal the store's, or it is refused; so must
    state_identity and state_bytes (a hybrid model's `shared.state_layout.StateLayout`;
    b"" and 0 for a dense model). A hello with a known client_id and a new session releases
    the old session's pins and slots (the client restarted). Answer: KVInfo."""

    client_id: str
    session: str
    pid: int
    model_identity: bytes
    block_bytes: int
    protocol_version: int = PROTOCOL_VERSION
    state_identity: bytes = b""
    state_bytes: int = 0


class KVLookup(msgspec.Struct, tag="kv_lookup", array_like=True):
    """Which of `hashes` (a chain, first block first) the store holds, and which of the
    checkpoints named `state_hashes` (each on its own). Answer: KVLookupResult."""

    req_id: int
    hashes: list[bytes]
    state_hashes: list[bytes] = []


class KVReserveLoad(msgspec.Struct, tag="kv_reserve", array_like=True):
    """Pin a pool slot for each block of the longest available run from hashes[0], and a
    state pool slot for each checkpoint of the longest available run from state_hashes[0]
    (the engine asks for one); disk blocks and checkpoints are promoted into their slot.
    Answer: KVLoadReserved (then KVLoadReady when it is not ready)."""

    req_id: int
    hashes: list[bytes]
    state_hashes: list[bytes] = []


class KVCompleteLoad(msgspec.Struct, tag="kv_loaded", array_like=True):
    """The client has copied these reserved slots (and state slots) out: unpin them (one pin
    each). Answer: KVAck."""

    req_id: int
    slots: list[int]
    state_slots: list[int] = []


class KVPrepareStore(msgspec.Struct, tag="kv_prepare", array_like=True):
    """Slots to write `hashes` into (for blocks the store lacks), and state slots to write
    the checkpoints `state_hashes` into. Answer: KVStorePrepared."""

    req_id: int
    hashes: list[bytes]
    state_hashes: list[bytes] = []


class KVCompleteStore(msgspec.Struct, tag="kv_stored", array_like=True):
    """The client wrote these prepared slots and state slots (ok: they become valid) or gave
    up (not ok: the slots are freed). Answer: KVAck."""

    req_id: int
    slots: list[int]
    ok: bool = True
    state_slots: list[int] = []


class KVStats(msgspec.Struct, tag="kv_stats", array_like=True):
    """Ask for the store's counters. Answer: KVAck with stats."""

    req_id: int


class KVBye(msgspec.Struct, tag="kv_bye", array_like=True):
    """The client session ends: release its pins and slots being written. Answer: KVAck."""

    req_id: int


EngineToKVStore = (KVHello | KVLookup | KVReserveLoad | KVCompleteLoad | KVPrepareStore
                   | KVCompleteStore | KVStats | KVBye)


class KVInfo(msgspec.Struct, tag="kv_info", array_like=True, omit_defaults=True):
    """Answer to KVHello. ok False: refused, `error` says why (other fields unset).

    pool_name: the shm segment (/dev/shm/<pool_name>); slot i starts at byte
    header_bytes + i * slot_stride and holds slot_bytes bytes. disk_tier: a disk tier is on.
    state_pool_name, state_n_slots, state_slot_bytes: the state checkpoints' pool, laid out
    the same way ("" and 0 for a dense model).
    """

    ok: bool
    error: str = ""
    store_pid: int = 0
    pool_name: str = ""
    n_slots: int = 0
    slot_bytes: int = 0
    slot_stride: int = 0
    header_bytes: int = 0
    disk_tier: bool = False
    state_pool_name: str = ""
    state_n_slots: int = 0
    state_slot_bytes: int = 0


class KVLookupResult(msgspec.Struct, tag="kv_lookup_res", array_like=True):
    """tiers[i] is the tier of hashes[i] for the longest run of hits from hashes[0]
    (len(tiers) is the hit count); state_tiers[i] the tier of checkpoint state_hashes[i], ""
    when the store lacks it. A lookup reserves nothing: blocks may leave before a
    KVReserveLoad."""

    req_id: int
    tiers: list[str]
    state_tiers: list[str] = []


class KVLoadReserved(msgspec.Struct, tag="kv_reserved", array_like=True):
    """slots[i] (pinned) will hold hashes[i] for i < len(slots) (the available run, which
    can be shorter than the lookup said), state_slots[i] checkpoint state_hashes[i] alike.
    ready: every slot holds its block now; else a KVLoadReady with the same req_id follows
    when the disk reads finish."""

    req_id: int
    slots: list[int]
    ready: bool
    state_slots: list[int] = []


class KVLoadReady(msgspec.Struct, tag="kv_ready", array_like=True):
    """The disk blocks of a reservation are in their slots. num_ok: slots[:num_ok] are valid;
    slots[num_ok:] were released by the store (a corrupt or missing file) and must not be
    read or completed. state_ok: the same for state_slots."""

    req_id: int
    num_ok: int
    state_ok: int = 0


class KVStorePrepared(msgspec.Struct, tag="kv_prepared", array_like=True):
    """slots[i]: where to write hashes[i], or -1 (already stored, being stored, or no room);
    state_slots[i] the same for state_hashes[i]. The client completes every slot it got with
    KVCompleteStore. evicted: blocks that left the store entirely to make room (demoted
    blocks are not listed)."""

    req_id: int
    slots: list[int]
    evicted: list[bytes] = []
    state_slots: list[int] = []


class KVAck(msgspec.Struct, tag="kv_ack", array_like=True, omit_defaults=True):
    """Answer to KVCompleteLoad / KVCompleteStore / KVBye (count: slots affected) and
    KVStats (stats: the store's counters)."""

    req_id: int
    count: int = 0
    stats: dict[str, Any] = {}


class KVError(msgspec.Struct, tag="kv_error", array_like=True):
    """A request the store refused (no hello yet, or invalid arguments)."""

    req_id: int
    error: str


KVStoreToEngine = (KVInfo | KVLookupResult | KVLoadReserved | KVLoadReady | KVStorePrepared
                   | KVAck | KVError)
