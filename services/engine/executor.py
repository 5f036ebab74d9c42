"""The seam between the engine and the model workers: an `Executor` runs step plans.

docs/ARCHITECTURE.md §2, §6. The engine submits each `StepPlan` (`submit`) and later asks
for its `StepResult` (`result`); with async scheduling the next plan is submitted before the
last one's result is asked for, so a result may come back before it is awaited: the
executor keeps it. A step that fails in the model comes back as a result with `error` set;
an executor that cannot get a result raises TimeoutError (workers gone or stuck).

Implementations:
- `services.engine.ring_executor.RingExecutor` (production): plans go out on the shm ring
  to every worker, results come back from worker rank 0 on a PULL socket.
- `InProcessExecutor` (tests, benchmarks): calls `execute(plan)` of any `StepRunner` in
  this process, e.g. a ModelRunner or a toy model.

While a result is awaited the engine keeps serving its frontends: `result` calls the
`WaitHook` it is given (the engine process; `NO_WAIT` when nothing needs serving).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from shared import protocol as P

log = logging.getLogger("kestrel.engine")


class EngineStopping(Exception):
    """The engine was asked to stop (SIGTERM) while it waited for a step's result."""


class WaitHook(Protocol):
    """What the engine does while an executor waits for a result.

    sockets(): extra ZMQ sockets to poll next to the executor's own (frontends, kvstore).
    tick(): called before each wait; the liveness beat.
    stopping(): True when the wait must end (the executor raises EngineStopping).
    serve(ready): after each poll, with the sockets that are readable (socket -> events);
        returns True when `sockets()` changed (the executor polls the new set).
    """

    def sockets(self) -> Sequence[Any]: ...

    def tick(self) -> None: ...

    def stopping(self) -> bool: ...

    def serve(self, ready: Mapping[Any, int]) -> bool: ...


class _NoWait:
    """A WaitHook with nothing to serve (in-process use)."""

    def sockets(self) -> Sequence[Any]:
        return ()

    def tick(self) -> None:
        pass

    def stopping(self) -> bool:
        return False

    def serve(self, ready: Mapping[Any, int]) -> bool:
        return False


NO_WAIT: WaitHook = _NoWait()


class Executor(Protocol):
    """Runs step plans for the engine (module doc)."""

    def submit(self, plan: P.StepPlan) -> None:
        """Start running `plan` (plans run in submission order)."""
        ...

    def result(self, step_id: int, hook: WaitHook) -> P.StepResult:
        """The result of the submitted plan `step_id`, waiting for it while calling `hook`.
        Raises TimeoutError when the workers stopped answering, EngineStopping when
        hook.stopping() turned True."""
        ...

    def sockets(self) -> Sequence[Any]:
        """ZMQ sockets the engine polls between steps; `drain` when one is readable."""
        ...

    def drain(self) -> None:
        """Read what arrived while no result was awaited (heartbeats, early results)."""
        ...

    def shutdown(self, reason: str) -> None:
        """Tell the workers to exit and release what this executor holds. Never raises."""
        ...


class WorkerExecutor(Executor, Protocol):
    """An executor over worker processes, which report ready once at startup (the ring
    executor; a tensor-parallel or multi-host executor takes this shape too)."""

    def wait_ready(self, timeout: float, beat: Callable[[], None],
                   stopping: Callable[[], bool]) -> list[P.WorkerReady]:
        """Block until every worker sent `WorkerReady`, calling `beat` meanwhile. Raises
        TimeoutError after `timeout` seconds, or at once when stopping() turns True."""
        ...


class StepRunner(Protocol):
    """Anything that runs a step in this process: a ModelRunner, a toy model."""

    def execute(self, plan: P.StepPlan) -> P.StepResult:
        """Run one step. Raises on a fault (the executor turns it into a failed result)."""
        ...


class InProcessExecutor:
    """An `Executor` that runs each plan at once in this process, on `runner`.

    A plan runs when submitted, so its result is always waiting when asked for (as a GPU
    step that is shorter than the engine's own work). An exception from the runner becomes
    a result with `error` "<type>: <message>", as the worker process reports it.
    runs: step ids run, in order (for tests).
    """

    def __init__(self, runner: StepRunner):
        self.runner = runner
        self._results: dict[int, P.StepResult] = {}
        self.runs: list[int] = []

    def submit(self, plan: P.StepPlan) -> None:
        self.runs.append(plan.step_id)
        try:
            result = self.runner.execute(plan)
        except Exception as e:
            log.error("step %d failed: %s", plan.step_id, e)
            result = P.StepResult(plan.step_id, [], error=f"{type(e).__name__}: {e}")
        self._results[plan.step_id] = result

    def result(self, step_id: int, hook: WaitHook = NO_WAIT) -> P.StepResult:
        """The result of `step_id`. Raises KeyError if it was never submitted."""
        return self._results.pop(step_id)

    def sockets(self) -> Sequence[Any]:
        return ()

    def drain(self) -> None:
        pass

    def shutdown(self, reason: str) -> None:
        self._results.clear()
