"""The engine's worker side: the step pipeline (plan out through the ring, result back on
the PULL socket, result applied to the scheduler).

`StepPipeline` owns sending a `StepPlan` (`_send_plan`, `_transfer_step` for plans with only
KV tier stores), waiting for worker rank 0's `StepResult` with the worker timeouts
(`_wait_result`, `STEP_LIMIT_FACTOR`), results that arrive before they are awaited (async
scheduling), and applying a result (`_finish_step`, `_advance`).

It is a mixin of `services.engine.core.EngineCore` and keeps no state of its own.
"""

from __future__ import annotations

import logging
import time

from services.engine.scheduler import SchedulerOutput
from shared import protocol as P
from shared.zmq_utils import safe_decode

log = logging.getLogger("kestrel.engine")

# cfg.worker_timeout_s: no message from a worker this long during a step: the step failed.
# A step running longer than this many worker timeouts is stuck even while the workers'
# heartbeat threads still beat (e.g. a collective that never returns).
STEP_LIMIT_FACTOR = 6


class EngineStopping(Exception):
    """SIGTERM arrived while the engine waited for a step's result."""


class StepPipeline:
    """The worker half of `EngineCore`: send plans, await and apply their results.

    Expects from the class that mixes it in (set by `EngineCore.__init__` / `start`):
    cfg, ring (the plan ring writer), enc, dec_worker, worker_sock (the PULL socket),
    router, scheduler, beacon, stopping, worker_timeout_s, num_steps, last_worker_msg,
    debug_sleep_s, tiers, inflight and early_results (None by default), and the methods
    `_poller`, `_drain_frontends` and `_emit` (FrontendLink).
    """

    # ------------------------------------------------------------------ steps

    def _wait_result(self, step_id: int) -> P.StepResult:
        """Wait for rank 0's result of `step_id`, serving frontends meanwhile.

        Raises TimeoutError when no worker message arrives for cfg.worker_timeout_s seconds,
        or the step runs longer than cfg.step_timeout_s; EngineStopping on SIGTERM.
        """
        early = self.early_results.pop(step_id, None) if self.early_results else None
        if early is not None:  # it came back while the loop was between steps
            return early
        poller = self._poller(self.worker_sock, self.router)
        tier_sock = self.tiers.socket if self.tiers is not None else None
        last = started = time.monotonic()
        limit = float(self.cfg.step_timeout_s or self.worker_timeout_s * STEP_LIMIT_FACTOR)
        while True:
            self.beacon.beat()
            if self.stopping:
                raise EngineStopping(f"stopped while waiting for step {step_id}")
            events = dict(poller.poll(100))
            if self.tiers is not None:  # replies, timeouts and stores go on during a step
                self.tiers.service()
                if self.tiers.socket is not tier_sock:
                    poller, tier_sock = self._poller(self.worker_sock, self.router), self.tiers.socket
            if self.router in events:
                self._drain_frontends(in_step=True)
            if self.worker_sock in events:
                while self.worker_sock.poll(0):
                    msg = safe_decode(self.dec_worker, self.worker_sock.recv(), "worker")
                    last = time.monotonic()
                    if isinstance(msg, P.StepResult):
                        if msg.step_id == step_id:
                            return msg
                        self._keep_result(msg)
            now = time.monotonic()
            if now - last > self.worker_timeout_s:
                raise TimeoutError(f"no word from the workers for {self.worker_timeout_s:.0f} s "
                                   f"in step {step_id}")
            if now - started > limit:
                raise TimeoutError(f"step {step_id} still running after {limit:.0f} s")

    def _drain_workers(self) -> None:
        """Read what the workers sent while no step was awaited: heartbeats, and with async
        scheduling the result of the plan in flight, kept for `_wait_result`."""
        while self.worker_sock.poll(0):
            msg = safe_decode(self.dec_worker, self.worker_sock.recv(), "worker")
            if msg is not None:
                self.last_worker_msg = time.monotonic()
            if isinstance(msg, P.StepResult):
                self._keep_result(msg)

    def _keep_result(self, msg: P.StepResult) -> None:
        """Keep a result that came before it was awaited (only plans in flight can have one;
        older ids are stale and dropped)."""
        if self.inflight is not None and msg.step_id == self.inflight.plan.step_id:
            if self.early_results is None:
                self.early_results = {}
            self.early_results[msg.step_id] = msg

    def _debug_sleep_in_step(self) -> None:
        """The debug_sleep hang: block the engine's loop (no beats, no answers)."""
        secs, self.debug_sleep_s = self.debug_sleep_s, 0.0
        time.sleep(secs)
        log.warning("debug_sleep: woke up after %.1f s", secs)

    def step(self, out: SchedulerOutput) -> None:
        """Run one planned step to its end: send the plan, wait for the result, apply it."""
        self._send_plan(out)
        self._finish_step(out)

    def _send_plan(self, out: SchedulerOutput) -> None:
        self.ring.write(self.enc.encode(out.plan), msg_type="step")

    def _finish_step(self, out: SchedulerOutput) -> None:
        """Wait for a sent plan's result, apply it to the scheduler and send the outputs."""
        result = self._wait_result(out.plan.step_id)
        self.num_steps += 1
        if self.tiers is not None:
            if result.kv_store_error:
                log.warning("step %d: KV stores dropped: %s", out.plan.step_id,
                            result.kv_store_error)
            self.scheduler.transfers_done(out.plan, not result.error and not result.kv_store_error)
        if result.error:
            log.error("step %d failed in the worker: %s", out.plan.step_id, result.error)
            for req in out.requests:
                self.scheduler.finish(req, "error")
            self._emit(out.requests, error=f"internal error in the model worker: {result.error}")
            return
        changed = self.scheduler.update(out, result.sampled_token_ids, result.logprobs,
                                        result.prompt_logprobs)
        self._emit(changed)

    def _advance(self) -> None:
        """One turn of the step pipeline. With async scheduling the next plan is sent
        before the result of the one in flight is awaited, so that the workers find it
        waiting when they finish (the scheduling, the result handling and the outputs of
        this process overlap the GPU); decodes then feed PENDING_TOKEN. Without it (or when
        `Scheduler.can_schedule_ahead` says no) each step is planned after the last one's
        result."""
        prev = self.inflight
        out = None
        if prev is None or (self.cfg.async_scheduling and self.scheduler.can_schedule_ahead()):
            out = self.scheduler.schedule()
            if out is not None:
                self._send_plan(out)
        self.inflight = out if self.cfg.async_scheduling else None
        if prev is not None:
            self._finish_step(prev)
        if out is not None and not self.cfg.async_scheduling:
            self._finish_step(out)
        elif out is None and prev is None and self.tiers is not None and self.tiers.has_stores():
            self._transfer_step()

    def _transfer_step(self) -> None:
        """A plan with only KV tier stores (nothing else runs, stores are ready)."""
        plan = self.scheduler.transfer_plan()
        if plan is None:
            return
        self.ring.write(self.enc.encode(plan), msg_type="step")
        result = self._wait_result(plan.step_id)
        if result.kv_store_error or result.error:
            log.warning("transfer step %d: KV stores dropped: %s", plan.step_id,
                        result.kv_store_error or result.error)
        self.scheduler.transfers_done(plan, not result.error and not result.kv_store_error)
