"""The engine core: requests in, step plans out, step results in, request outputs out.

`EngineCore` holds no socket and no thread of its own (docs/ARCHITECTURE.md §2, §5): the
scheduler and its block manager, structured output (`GrammarJobs`: the grammar compiler and
the compiles off the loop), the validation and admission of new requests, the aborts queued
for after a step, and the scheduler's KV connector (`KVConnector`, or None when the tiers
are off). Its verbs each return the outputs to send (`Emitted`, services/engine/outputs.py):

- `add(frontend, msg)`: validate and admit an `AddRequest` (or park it while its grammar
  compiles); a refusal is an output ("invalid": 400, "overloaded": 503, "internal": 500).
- `abort(request_ids)` / `drop_frontend(frontend, why)` queue aborts; `apply_aborts()` applies
  them (never while a step runs: the step's blocks are in use).
- `admit_compiled(attached)`: admit the requests whose grammar compiled.
- `plan_step()` -> the next `SchedulerOutput` (with its tier copies), `finish_step(out,
  result)` applies the workers' `StepResult`; a failed step fails its requests only.
  A step whose KV tier loads failed costs a recompute of its requests, never a failure.
  `plan_transfer()` / `finish_transfer()`: a plan with only tier stores.
- `fail_all(reason)`: fail everything (shutdown or restart: error_kind "unavailable").

What the process and its frontend link read, so that nothing outside this file reaches into
the scheduler, the block manager or the grammar jobs: `has_work()`, `has_requests_to_run()`,
`can_plan_ahead()`, `num_compiling`, `num_blocks`, `requests`, `stats()`,
`reset_prefix_cache()`, and `connector` (the process polls and services its socket).

The process around it (`services.engine.process`) owns the sockets, the loop and the
frontends' liveness; the executor (`services.engine.executor`) runs the plans; the step
pipeline (`services.engine.pipeline`) sequences them.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Container, Mapping
from typing import NamedTuple

from services.engine.admission import invalid_reason
from services.engine.block_manager import BlockManager
from services.engine.grammar_jobs import GrammarJobs
from services.engine.kv_connector import KVConnector
from services.engine.outputs import Emitted, emitted_for, refusal, request_output
from services.engine.request import Request
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.engine.spec_policy import SpecPolicy
from services.engine.state_slots import StateSlots
from services.engine.structured import GrammarError, RequestGrammar
from shared import protocol as P
from shared.config import KestrelConfig, state_checkpoint_slots
from shared.model_spec import ModelSpec

log = logging.getLogger("kestrel.engine")


class PendingAbort(NamedTuple):
    """An abort queued for after the step. error: None for a client's abort; a message when
    the engine aborts on its own (frontend dropped): the output goes to the frontend anyway."""

    request_id: str
    reason: P.FinishReason
    error: str | None


class EngineConfigError(ValueError):
    """A configuration the engine refuses (e.g. max_model_len over the KV cache)."""


class EngineCore:
    """The socket-free engine: scheduler, structured output, admission, KV connector (module doc).

    cfg: the settings (max_num_seqs, max_num_batched_tokens, block_size, max_num_waiting,
        enable_prefix_caching, max_model_len, seed). info: the model's facts.
    num_blocks: KV blocks of cfg.block_size tokens each (the smallest of the workers').
    root_hash: the prefix cache's root block name (the model identity; a default when None).
    grammars: the grammar compiler and compile jobs (built, not prepared, when None).
    connector: the KV connector the scheduler calls (services/engine/kv_connector.py); None:
        tiers off. Kept as `connector`: the process services its socket.
    seed: seeds the per-request seeds drawn for requests without one (cfg.seed when None).
    clock: seconds, monotonic; times the steps for the speculation policy's cost model
        (services/engine/step_cost.py); tests give a simulated one.
    Raises EngineConfigError when max_model_len exceeds the KV cache.
    """

    def __init__(self, cfg: KestrelConfig, info: ModelSpec, num_blocks: int, *,
                 root_hash: bytes | None = None, grammars: GrammarJobs | None = None,
                 connector: KVConnector | None = None,
                 seed: int | None = None, clock: Callable[[], float] = time.perf_counter):
        self.cfg = cfg
        self.info = info
        self.max_model_len: int = info.max_model_len  # the setting or the model's default (ModelSpec)
        kv_tokens = num_blocks * cfg.block_size
        if self.max_model_len > kv_tokens:
            raise EngineConfigError(
                f"max_model_len {self.max_model_len} exceeds the KV cache ({kv_tokens} tokens); "
                "raise --kv-cache-gib or lower --max-model-len")
        bm = BlockManager(num_blocks, cfg.block_size,
                          enable_prefix_caching=cfg.enable_prefix_caching, root_hash=root_hash)
        spec_cfg = cfg.speculative
        self.spec = SpecPolicy(spec_cfg, bool(cfg.async_scheduling)) if spec_cfg is not None else None
        slots = StateSlots(cfg.max_num_seqs, state_checkpoint_slots(cfg)) if info.has_recurrent_state else None
        self.scheduler = Scheduler(bm, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   self.max_model_len, list(info.eos_token_ids), spec=self.spec,
                                   state_slots=slots)
        if connector is not None:
            self.scheduler.attach_connector(connector)
        self.grammars = grammars if grammars is not None else GrammarJobs(info)
        self.connector: KVConnector | None = connector  # the process services its socket
        self.rng = random.Random(cfg.seed if seed is None else seed)
        self.pending_aborts: list[PendingAbort] = []
        self.num_steps = 0  # steps whose result was applied (transfer-only plans excluded)
        # Triton compiles / CUDA graph captures the worker reported after ready (StepResult.jit_compiles)
        self.num_jit_compiles = 0
        self.clock = clock
        self._last_result_at = 0.0  # when the last step's result was taken up
        self._busy_since: float | None = None  # a result taken up with work left (step_cost.py)
        self._in_flight = 0  # plans made whose results were not applied yet
        # plans made after a result with work left and nothing in flight: the pipeline waited
        # for that result (synchronous steps: async scheduling off, or it may not plan ahead)
        self.num_sync_plans = 0
        self.num_kv_load_failures = 0  # steps whose tier loads failed (their requests recomputed)

    # ------------------------------------------------------------------ requests in

    def add(self, frontend: bytes, msg: P.AddRequest) -> Emitted | None:
        """Validate and admit a request from `frontend`. One whose grammar is not compiled
        yet is parked while a thread compiles it (`admit_compiled` admits it). Returns the
        refusal, or None."""
        sp = msg.sampling
        kind, error = P.ErrorKind.INVALID, invalid_reason(msg, self.max_model_len, self.info.vocab_size)
        if error is None and (msg.request_id in self.scheduler.requests
                              or msg.request_id in self.grammars.compiling):
            error = "duplicate request id"
        waiting = len(self.scheduler.waiting) + len(self.grammars.compiling)
        if error is None and waiting >= self.cfg.max_num_waiting:
            kind, error = P.ErrorKind.OVERLOADED, f"waiting queue full ({self.cfg.max_num_waiting} requests)"
        grammar: RequestGrammar | None = None
        if error is None and sp.structured is not None:
            try:
                grammar = self.grammars.cached(sp.structured)
                if grammar is None:  # compiled off the loop: a big schema takes seconds
                    self.grammars.start(frontend, msg)
                    return None
            except Exception as e:  # no tokenizer.json, xgrammar fault: not the client's fault
                log.exception("request %s: structured output unavailable", msg.request_id)
                kind, error = P.ErrorKind.INTERNAL, f"structured output unavailable: {e}"
        if error:
            return Emitted(anyway=[(frontend, refusal(msg, kind, error))])
        self._admit(frontend, msg, grammar)
        return None

    def _admit(self, frontend: bytes, msg: P.AddRequest, grammar: RequestGrammar | None) -> None:
        sp = msg.sampling
        if sp.seed is None:
            sp.seed = self.rng.getrandbits(63)
        req = Request(msg.request_id, frontend, msg.prompt_token_ids, sp, msg.arrival_time)
        req.grammar = grammar
        self.scheduler.add(req)

    def admit_compiled(self, attached: Container[bytes]) -> Emitted | None:
        """Admit the parked requests whose grammar compiled, refuse those whose grammar
        failed (GrammarError: "invalid"; anything else: "internal"). A request whose
        frontend is not in `attached` any more is forgotten (its abort went out with the
        others). Returns the refusals, or None."""
        em = None
        for c in self.grammars.take_done():
            if c.frontend not in attached:
                continue
            rid = c.msg.request_id
            try:
                grammar = RequestGrammar(c.future.result(), self.info.vocab_size)
            except GrammarError as e:
                kind, error = P.ErrorKind.INVALID, str(e)
            except Exception as e:
                log.error("request %s: grammar compile failed: %r", rid, e)
                kind, error = P.ErrorKind.INTERNAL, f"structured output unavailable: {e}"
            else:
                self._admit(c.frontend, c.msg, grammar)
                continue
            em = em or Emitted()
            em.anyway.append((c.frontend, refusal(c.msg, kind, error)))
        return em

    # ------------------------------------------------------------------ aborts

    def abort(self, request_ids: list[str], reason: P.FinishReason = P.FinishReason.ABORT,
              error: str | None = None) -> None:
        """Queue aborts of `request_ids` for `apply_aborts` (unknown ids are ignored then)."""
        self.pending_aborts.extend(PendingAbort(rid, reason, error) for rid in request_ids)

    def drop_frontend(self, frontend: bytes, why: str) -> None:
        """Queue the abort of every request of `frontend` (running, waiting or compiling),
        each with error `why`: their last output still goes to that identity."""
        rids = [r.request_id for r in self.scheduler.requests.values() if r.frontend == frontend]
        rids += [rid for rid, c in self.grammars.compiling.items() if c.frontend == frontend]
        self.abort(rids, P.FinishReason.ABORT, why)

    def apply_aborts(self) -> Emitted | None:
        """End the requests of the queued aborts. A client's abort answers only an attached
        frontend; an abort with an error (error_kind "internal") answers the identity
        anyway. Returns the outputs, or None when nothing was queued."""
        if not self.pending_aborts:
            return None
        aborts, self.pending_aborts = self.pending_aborts, []
        em = Emitted()
        for rid, reason, error in aborts:
            req = self.scheduler.requests.get(rid)
            if req is None:
                compiling = self.grammars.compiling.pop(rid, None)
                if compiling is not None:  # its grammar is still compiling: it never ran
                    kind = P.ErrorKind.INTERNAL if error is not None else None
                    em.anyway.append((compiling.frontend,
                                      refusal(compiling.msg, kind, error, finish_reason=reason)))
                continue
            self.scheduler.finish(req, reason)
            out = request_output(req)
            if error is not None:
                out.error, out.error_kind = error, P.ErrorKind.INTERNAL
                em.anyway.append((req.frontend, out))
            else:
                em.add(req.frontend, out)
        return em

    # ------------------------------------------------------------------ steps

    def has_work(self) -> bool:
        """Whether a step could run now: requests to schedule, or KV tier stores ready."""
        return self.scheduler.has_work() or (self.connector is not None and self.connector.has_stores())

    def has_requests_to_run(self) -> bool:
        """Whether requests wait to be scheduled or are running (those waiting for the
        kvstore's answer, for their grammar, or tier stores do not count): the heartbeat's
        `busy`, next to the step count that only such steps advance."""
        return self.scheduler.has_work()

    def can_plan_ahead(self) -> bool:
        """Whether the next step may be planned before the last one's result is applied
        (async scheduling; `Scheduler.can_schedule_ahead`)."""
        return self.scheduler.can_schedule_ahead()

    def plan_step(self) -> SchedulerOutput | None:
        """The next step's plan (the scheduler puts the KV tier copies in), or None (nothing
        to run). With speculation on, the engine's time from the last result taken up to
        this plan goes to the policy's cost model (`StepCostModel.overhead`)."""
        out = self.scheduler.schedule()
        if out is not None:
            out.planned_at = now = self.clock()
            out.planned_ahead = self._in_flight > 0
            if not out.planned_ahead and self._busy_since is not None:
                self.num_sync_plans += 1
            self._in_flight += 1
            if self._busy_since is not None and self.spec is not None:
                self.spec.observe_overhead(now - self._busy_since)
            self._busy_since = None
        return out

    def finish_step(self, out: SchedulerOutput, result: P.StepResult) -> Emitted:
        """Apply a step's result. A failed step (result.error) fails its requests, with an
        "internal" error naming the worker's fault; the other requests are untouched. A step
        whose tier loads failed (result.kv_load_error: the workers ran nothing) emits nothing
        and sends its requests back to recompute (`Scheduler.loads_failed`; counted in
        `num_kv_load_failures`), once its loads and stores are completed with the connector.
        With speculation on, the step's duration goes to the policy's cost model: from its
        plan, or from the previous result when it was planned ahead of it, to now; a step
        planned with nothing in flight whose result is taken up only after a later plan went
        out is not timed (its result may have waited: an in-process executor runs a plan
        when it is submitted). Nor is a step in which the worker compiled a kernel or captured
        a graph (`result.jit_compiles`, counted in `num_jit_compiles`): its time is not its cost."""
        now = self.clock()
        self._in_flight = max(0, self._in_flight - 1)
        self.num_jit_compiles += result.jit_compiles
        if (self.spec is not None and not result.error and not result.jit_compiles and not result.kv_load_error
                and (out.planned_ahead or not self._in_flight)):
            self.spec.observe_step(out.total_tokens, now - max(out.planned_at, self._last_result_at),
                                   out.speculative, out.has_prefill)
        self._last_result_at = now
        self.num_steps += 1
        if self.connector is not None:
            if result.kv_store_error:
                log.warning("step %d: KV stores dropped: %s", out.plan.step_id,
                            result.kv_store_error)
            self.scheduler.transfers_done(out.plan, not result.error and not result.kv_store_error)
        if result.kv_load_error and not result.error:  # recompute, never fail (§4.5)
            back = self.scheduler.loads_failed(out)
            self.num_kv_load_failures += 1
            log.warning("step %d: KV tier loads failed (%s); %d requests recompute: %s",
                        out.plan.step_id, result.kv_load_error, len(back),
                        " ".join(r.request_id for r in back[:8]) + (" ..." if len(back) > 8 else ""))
            return Emitted()
        if result.error:
            log.error("step %d failed in the worker: %s", out.plan.step_id, result.error)
            self.scheduler.step_failed(out.plan)  # a hybrid's checkpoints it filled are dropped
            for req in out.requests:
                self.scheduler.finish(req, P.FinishReason.ERROR)
            return emitted_for(out.requests, error=f"internal error in the model worker: {result.error}")
        changed = self.scheduler.update(out, result.sampled_token_ids, result.logprobs,
                                        result.prompt_logprobs, result.num_sampled,
                                        result.draft_token_ids)
        self._busy_since = now if self.scheduler.has_work() else None
        return emitted_for(changed)

    def plan_transfer(self) -> P.StepPlan | None:
        """A plan with only KV tier stores when stores are ready (run it when nothing else
        runs), or None."""
        return self.scheduler.transfer_plan()

    def finish_transfer(self, plan: P.StepPlan, result: P.StepResult) -> None:
        """Complete a transfer-only plan's stores (dropped if the worker could not copy)."""
        assert self.connector is not None, "transfer plans exist only with tiers"
        self.num_jit_compiles += result.jit_compiles
        if result.kv_store_error or result.error:
            log.warning("transfer step %d: KV stores dropped: %s", plan.step_id,
                        result.kv_store_error or result.error)
        self.scheduler.transfers_done(plan, not result.error and not result.kv_store_error)

    # ------------------------------------------------------------------ state

    @property
    def requests(self) -> Mapping[str, Request]:
        """The admitted, unfinished requests (waiting, running, waiting for the kvstore) by
        id; read only (the scheduler's own table). Requests whose grammar compiles are not
        admitted yet (`num_compiling`)."""
        return self.scheduler.requests

    @property
    def num_compiling(self) -> int:
        """Requests parked by `add` while their grammar compiles (`admit_compiled` admits
        them): while any is, the process polls for the compiles."""
        return len(self.grammars.compiling)

    @property
    def num_blocks(self) -> int:
        """KV blocks of cfg.block_size tokens the block manager holds (the constructor's)."""
        return self.scheduler.bm.num_blocks

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block of the prefix cache, and a hybrid model's state
        checkpoints (the reset_prefix_cache utility). Returns False, and drops nothing, while
        any block is in use (`Scheduler.reset_prefix_cache`)."""
        return self.scheduler.reset_prefix_cache()

    def stats(self) -> dict:
        """Counters of the scheduler, the block manager, the tiers and speculative decoding
        (`SpecPolicy.stats`: vLLM's spec_decode_* counters, the policy's inputs and choice),
        for the stats utility."""
        s = self.scheduler
        return {"num_blocks": s.bm.num_blocks, "num_free_blocks": s.bm.num_free_blocks,
                "kv_usage": s.bm.usage(), "num_running": len(s.running),
                "num_waiting": len(s.waiting), "num_steps": self.num_steps,
                "num_preemptions": s.num_preemptions,
                "num_generated_tokens": s.num_generated_tokens,
                "num_sync_plans": self.num_sync_plans,
                "worker_jit_compiles": self.num_jit_compiles,
                "kv_load_failures": self.num_kv_load_failures, **s.bm.stats(),
                **(self.connector.stats() if self.connector is not None else {}),
                **(self.spec.stats() if self.spec is not None else {})}

    def fail_all(self, reason: str) -> Emitted:
        """Fail every request (running, waiting, compiling) with error `reason`, error_kind
        "unavailable" (the engine is going away, for a restart or a shutdown: the client may
        retry, 503 + Retry-After), and stop the compile threads."""
        reqs = list(self.scheduler.requests.values())
        for req in reqs:
            self.scheduler.finish(req, P.FinishReason.ERROR)
        em = emitted_for(reqs, error=reason, kind=P.ErrorKind.UNAVAILABLE)
        for c in self.grammars.compiling.values():
            em.anyway.append((c.frontend, refusal(c.msg, P.ErrorKind.UNAVAILABLE, reason)))
        self.grammars.shutdown()
        return em
