"""The step pipeline: plans from the engine core to an executor, results back.

docs/ARCHITECTURE.md §5. With async scheduling the next plan is submitted before the result
of the one in flight is awaited, so that the workers find it waiting when they finish: the
scheduling, the result handling and the outputs of the engine process overlap the GPU, and
decodes feed `PENDING_TOKEN` (the worker substitutes the token it sampled last). Without it
(or when `EngineCore.can_plan_ahead` says no) each step is planned after the last one's
result. When nothing runs and KV tier stores are ready, a transfer-only plan goes out.
"""

from __future__ import annotations

from services.engine.core import EngineCore
from services.engine.executor import NO_WAIT, Executor, WaitHook
from services.engine.outputs import Emitted
from services.engine.scheduler import SchedulerOutput


class StepPipeline:
    """Sequences the steps of `core` on `executor` (module doc).

    async_scheduling: plan step N+1 while step N runs. hook: served while a result is
    awaited (the engine process; NO_WAIT in process).
    inflight: the plan submitted and not yet finished (async scheduling only), or None.
    """

    def __init__(self, core: EngineCore, executor: Executor, async_scheduling: bool,
                 hook: WaitHook = NO_WAIT):
        self.core = core
        self.executor = executor
        self.async_scheduling = async_scheduling
        self.hook = hook
        self.inflight: SchedulerOutput | None = None

    def busy(self) -> bool:
        """Whether `advance` has something to do."""
        return self.inflight is not None or self.core.has_work()

    def advance(self) -> Emitted | None:
        """One turn: plan and submit the next step when allowed, finish the one due (its
        result awaited through the executor). Returns that step's outputs, or None.
        Raises what `Executor.result` raises."""
        core, ex = self.core, self.executor
        prev = self.inflight
        out = None
        if prev is None or (self.async_scheduling and core.can_plan_ahead()):
            out = core.plan_step()
            if out is not None:
                ex.submit(out.plan)
        self.inflight = out if self.async_scheduling else None
        emitted = None
        if prev is not None:
            emitted = core.finish_step(prev, ex.result(prev.plan.step_id, self.hook))
        if out is not None and not self.async_scheduling:
            emitted = core.finish_step(out, ex.result(out.plan.step_id, self.hook))
        elif out is None and prev is None:
            plan = core.plan_transfer()
            if plan is not None:
                ex.submit(plan)
                core.finish_transfer(plan, ex.result(plan.step_id, self.hook))
        return emitted
