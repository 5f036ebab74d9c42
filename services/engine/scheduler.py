"""Continuous batching under a per-step token budget, with chunked prefill and preemption.

Each step (docs/ARCHITECTURE.md §5):
1. Running requests in decode go first (one token each, or more later with spec decode).
2. Running requests still in prefill get chunks of what is left of the budget. While
   decodes are in the batch, prefill tokens are capped at `prefill_cap_with_decodes` so
   that inter-token latency stays bounded.
3. Waiting requests are admitted in arrival order while the budget, `max_num_seqs` and
   free blocks allow. An admitted request first takes its longest cached prefix from the
   block manager's prefix cache (docs/ARCHITECTURE.md §4): it starts with
   num_computed_tokens = the hit length and the hit blocks at the head of its table, and
   its first chunk starts there (ScheduledSeq.start_pos = hit length). Hit tokens cost no
   budget.
KV tiers (docs/ARCHITECTURE.md §4): a `KVConnector` (services/engine/kv_connector.py says
when each of its methods is called; None without tiers). The scheduler asks it and applies
its answers; the connector never edits the queues or the requests. A request whose lookup
the connector must ask its store about waits in `waiting_for_kv` (WAITING_FOR_KV), off the
step, until `kv_lookup_done` puts it back at the front of the queue. At admission the local
hit blocks are referenced first (no longer evictable), then fresh blocks are allocated for
the loaded run and the chunk; loaded tokens cost no budget. A request recomputing from
token 0 after preemption is asked about again, and registers (so stores) its blocks again.
A hybrid model (state_slots.py, docs/ARCHITECTURE.md §4.7): the hit, local and loaded,
ends at the last block with a state checkpoint, local or the connector's
(`tier_checkpoint`, brought into a checkpoint slot by the plan's state_loads); the
checkpoints a plan fills become readable at its result (`update`, which hands the saved ones
to the connector to store) or are dropped when its step failed (`step_failed`).
A step whose tier loads failed in the workers (nothing ran) sends its requests back to
recompute (`loads_failed`, docs/ARCHITECTURE.md §4.5); a plan made before that result came
back is void for them (`Request.void_epoch`), and those whose loads failed never load again.

Under memory pressure the newest running request is preempted: its blocks are freed (the
full ones stay cached until evicted) and it goes back to the front of the waiting queue to
recompute from token 0, taking whatever of its prefix is still cached when re-admitted.

After the worker returns the sampled tokens, `update` appends them one by one with the stop
conditions (services/engine/stop_conditions.py) and registers the blocks that became full
in the prefix cache.

Speculative decoding (docs/ARCHITECTURE.md §5.5; `spec`, None when off): a decode holding
drafts verifies k of them (n-gram drafts are looked up here at plan time, the engine-side
drafter; the worker's proposers' come back with a result, a sampled seq asking for them,
services/engine/draft_schedule.py); `update` walks the emitted tokens with the stop checks,
then rolls the request back to its accepted positions. A request whose seq in flight
verifies or proposes is never planned ahead, nor, while one is in flight, a step after a
lookup that found a match in a request's known tokens (`Request.lookup_due`).

The scheduled requests become the step's `StepPlan` in services/engine/step_plan.py
(`build_plan`: tokens, table increments, pending tokens, per-request extras). A request with
a grammar advances it with each accepted token, and its termination ends the request
("stop"); `max_tokens == 0` (score the prompt only): the last prefill chunk samples nothing
and the request finishes with "length". A request with prompt logprobs skips the prefix
cache (the worker must run every prompt position to score it).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from services.engine.block_manager import BlockManager
from services.engine.draft_schedule import DraftScheduler
from services.engine.kv_connector import KVConnector
from services.engine.request import Request, RequestStatus
from services.engine.spec_policy import SpecPolicy
from services.engine.state_slots import StateSlots
from services.engine.stop_conditions import stop_reason
from services.engine.step_plan import SeqWork, build_plan, sampled_counts
from shared.protocol import FinishReason, StepPlan, TokenLogprob


@dataclass
class SchedulerOutput:
    """What one step runs: the plan for the workers and the requests in plan order.

    num_tokens: tokens per request id (drafts included); total_tokens: their sum.
    speculative: a seq verifies or proposes drafts. has_prefill: a seq is a prefill
    chunk. planned_at: the engine core's clock
    when the plan was made; planned_ahead: another plan was in flight then (the engine
    core times the steps with both, services/engine/step_cost.py)."""

    plan: StepPlan
    requests: list[Request]
    num_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)  # each request's epoch when planned
    total_tokens: int = 0
    speculative: bool = False
    has_prefill: bool = False  # a seq is a prefill chunk (the step cost's "mixed" curve)
    planned_at: float = 0.0
    planned_ahead: bool = False


class Scheduler:
    """Owns the waiting and running queues and the block manager.

    max_num_seqs: requests running at once. max_num_batched_tokens: tokens per step.
    max_model_len: prompt + output tokens of one request. eos_token_ids: ids that end a
    request (unless ignore_eos). connector: the KV tiers (module doc), or None.
    spec: the speculative decoding policy (module doc), or None (off).
    state_slots: the recurrent-state slots of a hybrid model (`state_slots.py`; at least
    max_num_seqs of them), or None: a running request holds one (`Request.state_slot`).
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, eos_token_ids: list[int],
                 connector: KVConnector | None = None, spec: SpecPolicy | None = None,
                 state_slots: StateSlots | None = None):
        if state_slots is not None and state_slots.num_slots < max_num_seqs:
            raise ValueError(f"{state_slots.num_slots} state slots for max_num_seqs {max_num_seqs}")
        self.slots = state_slots
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.prefill_cap_with_decodes = max(block_manager.block_size, max_num_batched_tokens // 2)
        self.max_model_len = max_model_len
        self.eos = set(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._num_sync_running = 0  # running requests with penalties or a grammar (`_needs_sync`)
        self.requests: dict[str, Request] = {}
        self.step_id = 0
        self.num_preemptions = 0  # cumulative
        self.num_generated_tokens = 0  # cumulative output tokens
        self.spec = spec
        self.drafts = DraftScheduler(spec, block_manager, max_model_len) if spec is not None else None
        self.worker_forget: list[str] = []  # ended requests the next plan names (plan.forget)
        # KV tiers (module doc): requests parked until the connector answers their lookup.
        self.waiting_for_kv: dict[str, Request] = {}
        self.connector: KVConnector | None = None
        if connector is not None:
            self.attach_connector(connector)

    def attach_connector(self, connector: KVConnector) -> None:
        """Use `connector` for the KV tiers from now on (bound to this block manager and
        `kv_lookup_done`)."""
        connector.bind(self.bm, self.kv_lookup_done, self.slots)
        self.connector = connector

    # ------------------------------------------------------------------ queue management

    def add(self, request: Request) -> None:
        """Admit a request to the waiting queue. Raises ValueError on a duplicate id."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request (any state): free its blocks and drop it from the queues."""
        if request.is_finished:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request.worker_blocks:  # the next plan tells the workers to drop its table
            self.worker_forget.append(request.request_id)
            request.worker_blocks = 0
        self.bm.free(request)
        self._give_back_slot(request)
        if self.connector is not None:
            self.connector.release(request)
        if request in self.running:
            self.running.remove(request)
            self._num_sync_running -= self._needs_sync(request)
        elif self.waiting_for_kv.pop(request.request_id, None) is not None:
            pass  # a reservation that comes later goes back (the connector sees it finished)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.requests.pop(request.request_id, None)

    def has_work(self) -> bool:
        """Whether a step could run now (requests waiting on the kvstore do not count)."""
        return bool(self.waiting or self.running)

    def kv_lookup_done(self, request: Request) -> None:
        """The connector settled the lookup of a parked request (a reservation it holds,
        or nothing to load: a miss, or the store went away): back from WAITING_FOR_KV to
        the front of the waiting queue. A request no longer parked is released."""
        if self.waiting_for_kv.pop(request.request_id, None) is None or request.is_finished:
            if self.connector is not None:
                self.connector.release(request)
            return
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput | None:
        """Plan the next step. Returns None when nothing can run."""
        budget = self.budget
        scheduled: list[SeqWork] = []
        preempted: list[Request] = []
        decodes = [r for r in self.running if r.num_computed_tokens >= r.num_tokens + r.inflight - 1]
        prefills = [r for r in self.running if r.num_computed_tokens < r.num_tokens + r.inflight - 1]
        drafts = self.drafts
        ks = self._choose_drafts(drafts, decodes, prefills) if drafts is not None else {}

        taken: set[str] = set()
        for req in decodes:
            if req.status != RequestStatus.RUNNING or budget <= 0:
                continue
            end = req.num_tokens + req.inflight
            if end <= req.num_computed_tokens:
                continue  # nothing to run: its last chunk sampled nothing (max_tokens 0)
            if req.inflight and (self._must_sync(req) or self._at_limit(req)):
                continue  # its pending token decides (or is its last): wait for it
            work = None  # (drafts.decode's first test, inlined: the common decode holds no drafts)
            if drafts is not None and (req.draft_token_ids or drafts.drafter is None):
                work = drafts.decode(req, end, ks.get(req.request_id, 0), budget)
            if work is None:
                if not self._allocate_or_preempt(req, end, taken, preempted):
                    continue
                work = SeqWork(req, end - req.num_computed_tokens)
            req.draft_token_ids = []
            scheduled.append(work)
            taken.add(req.request_id)
            budget -= work.num_tokens + len(work.drafts)

        num_decodes = len(scheduled)
        prefill_budget = min(budget, self.prefill_cap_with_decodes) if scheduled else budget
        for req in prefills:
            if req.status != RequestStatus.RUNNING or prefill_budget <= 0:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, prefill_budget)
            n, save = self._checkpoint_cut(req, req.num_computed_tokens, n)
            end = req.num_computed_tokens + n
            p = drafts.prefill(req, end) if drafts else 0
            if not (p and self.bm.allocate(req, end + p)):
                p = 0
                if not self._allocate_or_preempt(req, end, taken, preempted):
                    continue
            scheduled.append(SeqWork(req, n, num_propose=p, state_save=self._checkpoint_slot(save)))
            taken.add(req.request_id)
            prefill_budget -= n

        connector = self.connector if self.bm.enable_prefix_caching else None
        while self.waiting and prefill_budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.inflight:  # preempted with a token still coming back: take it first
                break
            # A waiting request holds no blocks and has computed nothing (new or preempted).
            hit_blocks: list[int]
            num_load = 0  # blocks the connector loads past the local hit
            restore, from_tier = -1, False  # a hybrid's checkpoint to resume from; loaded from the tier
            if req.wants_prompt_logprobs:  # every prompt position must run to be scored
                hit_blocks, hit_tokens = [], 0
                req.prompt_logprobs = []  # a preempted request scores its prompt again
                if self.connector is not None:
                    self.connector.release(req)
            else:
                hit_blocks, hit_tokens = self.bm.get_computed_blocks(req)
                if connector is not None and not req.no_tier_loads:  # (a failed load: recompute)
                    answer = connector.lookup(req, len(hit_blocks))
                    if answer is None:  # asked: it waits off the step for the answer
                        self.waiting.popleft()
                        req.status = RequestStatus.WAITING_FOR_KV
                        self.waiting_for_kv[req.request_id] = req
                        continue
                    num_load = answer
                if (hit_blocks or num_load) and self.slots is not None:  # a hybrid resumes from a checkpoint
                    tier_ck = (connector.tier_checkpoint(req)
                               if connector is not None and not req.no_tier_loads else None)
                    hit_blocks, num_load, restore, from_tier = self._checkpointed_hit(
                        req, hit_blocks, num_load, tier_ck)
                    hit_tokens = len(hit_blocks) * self.bm.block_size
            computed = hit_tokens + num_load * self.bm.block_size
            n = min(req.num_tokens - computed, prefill_budget)
            n, save = self._checkpoint_cut(req, computed, n)
            p = drafts.prefill(req, computed + n) if drafts else 0
            # Two phases: the hit blocks are referenced first, then blocks for load + chunk.
            if not (p and self.bm.allocate(req, computed + n + p, computed_blocks=hit_blocks)):
                p = 0
                if not self.bm.allocate(req, computed + n, computed_blocks=hit_blocks):
                    break
            if from_tier:  # the tier's checkpoint is loaded into a checkpoint slot, restored from there
                restore = self._checkpoint_slot(self.bm.block_name(req, computed // self.bm.block_size - 1))
                assert restore >= 0, "_checkpointed_hit saw a checkpoint slot free"
            if connector is not None:
                first = len(hit_blocks)
                connector.on_allocated(req, req.block_ids[first:first + num_load], restore if from_tier else -1)
            req.num_computed_tokens = computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = computed
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if self.slots is not None:
                req.state_slot = self.slots.take()
            if req.first_scheduled is None:
                req.first_scheduled = time.time()
            self.running.append(req)
            self._num_sync_running += self._needs_sync(req)
            scheduled.append(SeqWork(req, n, num_propose=p, state_restore=restore if computed else -1,
                                     state_save=self._checkpoint_slot(save)))
            prefill_budget -= n

        if not scheduled:
            return None
        self.step_id += 1
        forget, self.worker_forget = self.worker_forget, []
        plan = build_plan(self.step_id, scheduled, forget)  # advances the requests
        if self.connector is not None:
            self._add_transfers(plan)
        num_tokens = {w.request.request_id: w.num_tokens + len(w.drafts) for w in scheduled}
        speculative = any(s.num_draft or s.num_propose for s in plan.seqs)
        if speculative and self.spec is not None:
            self.spec.num_spec_steps += 1
        return SchedulerOutput(plan=plan, requests=[w.request for w in scheduled],
                               num_tokens=num_tokens, preempted=preempted,
                               epochs=[w.request.epoch for w in scheduled],
                               total_tokens=sum(num_tokens.values()),
                               speculative=speculative, has_prefill=len(scheduled) > num_decodes)

    def _choose_drafts(self, drafts: DraftScheduler, decodes: list[Request],
                       prefills: list[Request]) -> dict[str, int]:
        """k per request id for the decodes holding drafts (`DraftScheduler.choose`), from
        the step's expected size: the decodes, then prefill tokens up to their budget."""
        demand = sum(r.num_tokens - r.num_computed_tokens for r in prefills)
        seats = self.max_num_seqs - len(self.running)
        for i, r in enumerate(self.waiting):
            if i >= seats:
                break
            demand += r.num_tokens
        left = self.budget - len(decodes)
        cap = min(left, self.prefill_cap_with_decodes) if decodes else left
        async_ok = not self._num_sync_running  # (a count kept, not a pass over the running requests)
        prefill = max(0, min(demand, cap))
        return drafts.choose(decodes, len(decodes) + prefill, async_ok, self.budget, mixed=prefill > 0)

    def _add_transfers(self, plan: StepPlan) -> None:
        """Put the connector's copies for this step into `plan`."""
        assert self.connector is not None
        t = self.connector.take_transfers()
        if t is not None:
            plan.kv_loads, plan.kv_stores = t.loads, t.stores
            plan.kv_pool, plan.kv_pool_pid = t.pool, t.pool_pid
            plan.state_loads, plan.state_stores, plan.state_pool = t.state_loads, t.state_stores, t.state_pool

    def transfer_plan(self) -> StepPlan | None:
        """A plan with the connector's copies alone (no seqs: nothing else runs), or None
        when it has none waiting. It takes the next step id."""
        if self.connector is None or not self.connector.has_stores():
            return None
        self.step_id += 1
        plan = StepPlan(step_id=self.step_id, seqs=[])
        self._add_transfers(plan)
        return plan

    def transfers_done(self, plan: StepPlan, store_ok: bool) -> None:
        """The result of `plan` came back (or its step failed): the connector completes
        its loads and stores. store_ok: the workers copied the stores."""
        if self.connector is not None and (plan.kv_loads or plan.kv_stores or plan.state_loads
                                           or plan.state_stores):
            self.connector.step_done(plan, store_ok)

    @staticmethod
    def _needs_sync(req: Request) -> bool:
        """Whether every seq of req needs its previous result on the engine's side
        (penalties, a grammar: fixed while it runs)."""
        return req.has_penalty or req.grammar is not None

    @staticmethod
    def _must_sync(req: Request) -> bool:
        """Whether req's next seq needs its previous result on the engine's side: penalties
        count its token, a grammar's mask follows from it, and after a seq that verified
        drafts (or asked the worker's proposer for some) the next one's tokens and position
        depend on what was accepted and proposed (docs/ARCHITECTURE.md §5.5; n-gram
        lookups never ask the worker)."""
        return req.spec_inflight or req.has_penalty or req.grammar is not None

    def _at_limit(self, req: Request) -> bool:
        """Whether the pending tokens already reach max_tokens or max_model_len."""
        return (len(req.output_token_ids) + req.inflight >= req.sampling.max_tokens
                or req.num_tokens + req.inflight >= self.max_model_len)

    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be planned before the results of the plans in flight
        (async scheduling): False while a running request that needs its previous result
        on this side (penalties, a grammar, a seq verifying or proposing drafts, an n-gram
        match to look up again with its tokens known, `lookup_due`) still waits for one, so
        that it is not left out of a step."""
        return not any(r.inflight and (self._must_sync(r) or r.lookup_due) for r in self.running)

    def _allocate_or_preempt(self, req: Request, num_tokens: int, taken: set[str],
                             preempted: list[Request]) -> bool:
        """Grow req's blocks to `num_tokens`, preempting the newest running request not yet
        scheduled this step while blocks are short. If no other request can give blocks
        back, req itself is preempted. Returns True when req can run."""
        while not self.bm.allocate(req, num_tokens):
            others = [r for r in self.running if r is not req and r.request_id not in taken]
            victim = max(others, key=lambda r: r.arrival_time) if others else req
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, victim: Request) -> None:
        """Free the victim's blocks and put it first in line to recompute from token 0."""
        self.running.remove(victim)
        self._num_sync_running -= self._needs_sync(victim)
        self.bm.free(victim)
        self._give_back_slot(victim)  # it recomputes from token 0 into the slot it gets next
        victim.worker_blocks = 0  # its next seq sends a new whole table (replacing the old)
        victim.draft_token_ids = []  # they follow a position it no longer holds
        victim.lookup_due = False
        victim.num_computed_tokens = 0
        victim.epoch += 1  # (its lookup ended at admission: the connector is asked again)
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    # ------------------------------------------------------------------ state checkpoints

    def _checkpointed_hit(self, req: Request, hit_blocks: list[int], num_load: int,
                          tier_ck: int | None) -> tuple[list[int], int, int, bool]:
        """A hybrid model's prefix hit: the longest head of the local hit `hit_blocks` and
        the `num_load` tier blocks after it whose last block has a state checkpoint, local or
        the tier's (the block index `tier_ck`, None: none; taken only when a checkpoint slot
        can receive it). Returns (the local hit blocks kept, the tier blocks kept, the local
        checkpoint's slot or -1, whether the tier's checkpoint ends the hit); ([], 0, -1,
        False) without one."""
        assert self.slots is not None
        local = len(hit_blocks)
        for j in range(local + num_load, 0, -1):
            name = req.block_hashes[j - 1]
            slot = self.slots.checkpoint_of(name)
            if slot is not None:
                return hit_blocks[:j], max(0, j - local), slot, False
            if tier_ck == j - 1 and self.slots.can_add_checkpoint(name):
                return hit_blocks[:j], max(0, j - local), -1, True
        return [], 0, -1, False

    def _checkpoint_cut(self, req: Request, start: int, n: int) -> tuple[int, bytes | None]:
        """For a hybrid model with the prefix cache: a prefill chunk [start, start + n) that
        passes the prompt's last full-block boundary B ends there instead, and a chunk ending
        at B names the block whose checkpoint it saves (state_slots.py). Returns (n, the
        block name or None)."""
        if self.slots is None or not self.slots.num_checkpoints or not self.bm.enable_prefix_caching:
            return n, None
        bs = self.bm.block_size
        boundary = (req.num_prompt_tokens - 1) // bs * bs
        if boundary <= start or start + n < boundary:
            return n, None
        return boundary - start, self.bm.block_name(req, boundary // bs - 1)

    def _checkpoint_slot(self, name: bytes | None) -> int:
        """The checkpoint slot a chunk saves into for block `name` (-1: none, or the block
        has a checkpoint already)."""
        if name is None or self.slots is None:
            return -1
        slot = self.slots.new_checkpoint(name)
        return -1 if slot is None else slot

    def _checkpoints_back(self, plan: StepPlan, ok: bool, void: frozenset[int] = frozenset()) -> None:
        """`plan`'s result came back (ok) or its step failed: the checkpoints it filled (its
        saves and tier loads) become readable, or are dropped (their bytes are unreliable).
        void: indexes of seqs whose results are dropped (a failed tier load under them):
        their saves are dropped too. The saved ones go to the connector to be stored."""
        if self.slots is None:
            return
        for i in void:
            if plan.seqs[i].state_save >= 0:
                self.slots.drop(plan.seqs[i].state_save)
        saves = [s.state_save for i, s in enumerate(plan.seqs) if s.state_save >= 0 and i not in void]
        loads = [c for _, c in plan.state_loads]
        if not ok:
            for slot in saves + loads:
                self.slots.drop(slot)
            return
        for slot in loads:
            self.slots.commit(slot)
        saved = [(name, slot) for slot in saves if (name := self.slots.commit(slot)) is not None]
        if saved and self.connector is not None:
            self.connector.on_checkpoints(saved)

    def step_failed(self, plan: StepPlan) -> None:
        """`plan`'s step failed in the workers (its requests are failed by the caller): the
        checkpoints it was filling are dropped."""
        self._checkpoints_back(plan, ok=False)

    def loads_failed(self, out: SchedulerOutput) -> list[Request]:
        """The workers could not copy `out`'s tier loads and ran nothing (kv_load_failure_policy
        "recompute", docs/ARCHITECTURE.md §4.5): the checkpoints the step was filling are
        dropped (`step_failed`), and every unfinished request of the step goes back to the
        front of the waiting queue to recompute from token 0 as a preempted one does (blocks
        freed, state slot given back, outputs kept). The blocks the loads filled were never
        named, so none of them enters the prefix cache. Results of plans made before this
        one came back (async scheduling) are dropped for these requests (`void_epoch`).
        The requests whose blocks or checkpoint the loads were filling never load from the
        tiers again (`no_tier_loads`). Returns the requests sent back."""
        self.step_failed(out.plan)
        plan = out.plan
        loaded = {b for _, b in plan.kv_loads}
        ck_loaded = {c for _, c in plan.state_loads}
        back: list[Request] = []
        for req, seq in zip(out.requests, plan.seqs):
            if seq.sample:
                req.inflight = max(0, req.inflight - 1)
            if seq.num_draft or seq.num_propose:
                req.spec_inflight = False
            if req.is_finished:
                continue
            if (seq.state_restore >= 0 and seq.state_restore in ck_loaded) or not loaded.isdisjoint(req.block_ids):
                req.no_tier_loads = True
                if self.connector is not None:
                    self.connector.release(req)
            if req.status == RequestStatus.RUNNING:
                self._preempt(req)
            req.void_epoch = req.epoch
            back.append(req)
        # _preempt put them first in reverse order: keep the step's order at the front
        if back:
            ids = {id(r) for r in back}
            rest = [r for r in self.waiting if id(r) not in ids]
            self.waiting = deque([r for r in back if r.status == RequestStatus.WAITING] + rest)
        return back

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block name and, for a hybrid model, every state checkpoint
        (`BlockManager.reset_prefix_cache`; False, and nothing dropped, while a block is in
        use)."""
        if not self.bm.reset_prefix_cache():
            return False
        if self.slots is not None:
            self.slots.forget_checkpoints()
        return True

    def _give_back_slot(self, req: Request) -> None:
        if req.state_slot >= 0 and self.slots is not None:
            self.slots.give_back(req.state_slot)
        req.state_slot = -1

    # ------------------------------------------------------------------ after the step

    def update(self, out: SchedulerOutput, sampled: list[int],
               logprobs: list[TokenLogprob | None] | None = None,
               prompt_logprobs: dict[str, list[TokenLogprob]] | None = None,
               num_sampled: list[int] | None = None,
               draft_token_ids: dict[str, list[int]] | None = None) -> list[Request]:
        """Apply a step's results. Returns the requests that got new tokens or finished.

        sampled: the tokens of the seqs that sample (a prefill's last chunk, a decode, a
        verify), in plan order; num_sampled: how many each seq emitted (1..num_draft + 1;
        None or empty: one each). logprobs: aligned with sampled, or empty/None.
        prompt_logprobs: request id -> logprobs of the prompt tokens scored this step, in
        position order. draft_token_ids: request id -> drafts proposed for its next seq
        (StepResult's fields of the same names). Each seq's tokens are appended one by one
        with the stop checks; those after a stop are dropped (module doc).
        Raises ValueError if the counts do not match the plan.
        """
        logprobs = logprobs or []
        prompt_logprobs = prompt_logprobs or {}
        drafts = draft_token_ids or {}
        counts = sampled_counts(out.plan, len(sampled), num_sampled or None)
        epochs = out.epochs or [r.epoch for r in out.requests]
        void = frozenset(i for i, (r, e) in enumerate(zip(out.requests, epochs)) if e < r.void_epoch)
        self._checkpoints_back(out.plan, ok=True, void=void)
        changed = []
        pos = j = 0
        for req, seq, epoch in zip(out.requests, out.plan.seqs, epochs):
            n = 0
            if seq.sample:
                n = counts[j] if counts else 1
                j += 1
                req.inflight = max(0, req.inflight - 1)
            first, pos = pos, pos + n
            spec = bool(seq.num_draft or seq.num_propose)
            if spec:
                req.spec_inflight = False
                if self.spec is not None and epoch >= req.void_epoch:
                    self.spec.observe_result(req, seq.num_draft, n - 1, seq.num_propose,
                                             len(drafts.get(req.request_id, ())))
            if req.is_finished or epoch < req.void_epoch:
                continue  # a decode planned before its previous token ended the request; or
                # planned on top of a step whose tier loads failed: built on garbage, dropped
            current = epoch == req.epoch and req.status == RequestStatus.RUNNING
            done = seq.start_pos + len(seq.token_ids)  # prompt/context tokens computed by this plan
            # Prompt logprobs of a plan made before a preemption still count while the
            # request waits (it rescores from scratch only when re-admitted): its kept
            # token may end it, prompt logprobs complete.
            live = current or req.status == RequestStatus.WAITING
            if live and req.wants_prompt_logprobs and req.request_id in prompt_logprobs:
                req.prompt_logprobs.extend(prompt_logprobs[req.request_id])
            # Tokens sampled before a preemption are still the right ones: they are kept,
            # and the recompute runs them as context (the drafts that came back are not).
            reason = None
            for i in range(first, pos):
                tok = sampled[i]
                req.output_token_ids.append(tok)
                self.num_generated_tokens += 1
                lp = logprobs[i] if i < len(logprobs) else None
                if req.sampling.logprobs is not None and lp is not None:
                    req.output_logprobs.append(lp)
                reason = stop_reason(req, tok, self.eos, self.max_model_len)
                if reason is not None:
                    break  # the tokens after a stop are dropped
            accepted = n - 1 if n else 0  # drafts whose KV this step wrote and kept
            if current:  # register full blocks whose KV holds accepted tokens, before a finish frees them
                upto = done - seq.num_draft + accepted
                if reason is not None:  # as without drafts: the KV of the last token is not kept
                    upto = min(upto, req.num_tokens - 1)
                new = self.bm.cache_full_blocks(req, upto=upto)
                if new and self.connector is not None:
                    self.connector.on_cached(new)
            if live and not seq.sample and req.sampling.max_tokens == 0 and done >= req.num_prompt_tokens:
                self.finish(req, FinishReason.LENGTH)  # scored the prompt (with or without logprobs); nothing to generate
                changed.append(req)
            if n == 0:
                continue
            changed.append(req)
            if reason is not None:
                self.finish(req, reason)
            elif current and spec and self.drafts is not None:
                self.drafts.after_step(req, done - seq.num_draft + accepted, seq.num_propose,
                                       drafts.get(req.request_id, ()))
        return changed
