"""The engine's async step pipeline (plan step N+1 while step N runs) over both executors.

In process: the toy model runs each plan when it is submitted, so every result is already
waiting when the pipeline turns to it (on a GPU the step is often shorter than the engine's
own work). Over the shm ring: the real `RingExecutor`, with a worker thread that reads the
ring and pushes each result (and a heartbeat) back at once, so results arrive before they
are awaited and must be kept. The truth is the scheduler run synchronously with the same toy
model (tests/unit/test_scheduler.py): outputs must match token for token, and no result may
be lost (a lost one hangs the engine until its step timeout)."""

from __future__ import annotations

import random
import time
import uuid

import pytest
import zmq

from services.engine.core import EngineCore
from services.engine.executor import InProcessExecutor
from services.engine.request import Request
from services.engine.ring_executor import RingExecutor
from shared import protocol as P
from tests.unit.engine_rig import Outbox, RingWorkerThread, core_config, drive, toy_info
from tests.unit.test_scheduler import EOS, VOCAB, ToyModel, run


class ToyRunner:
    """The scheduler tests' ToyModel behind the runner's `execute(plan) -> StepResult`."""

    def __init__(self, block_size: int):
        self.model = ToyModel(block_size)

    def execute(self, plan: P.StepPlan) -> P.StepResult:
        return P.StepResult(plan.step_id, self.model.execute(plan))


def _prompts(seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 40))], rng.randrange(1, 30))
            for _ in range(8)]


def _truth(seed: int) -> dict[str, tuple[list[int], str]]:
    reqs = [Request(f"r{i}", b"fe", p, P.SamplingParams(temperature=0, max_tokens=n), float(i))
            for i, (p, n) in enumerate(_prompts(seed))]
    return run(reqs, num_blocks=1000, budget=16)


def _core(async_scheduling: bool, **settings) -> EngineCore:
    cfg = core_config(async_scheduling=async_scheduling, block_size=4, max_num_seqs=8,
                      max_num_batched_tokens=16, max_model_len=200, **settings)
    core = EngineCore(cfg, toy_info(VOCAB, EOS, cfg.max_model_len), num_blocks=1000)
    for i, (p, n) in enumerate(_prompts(3)):
        assert core.add(b"fe", P.AddRequest(f"r{i}", p, P.SamplingParams(temperature=0, max_tokens=n),
                                            float(i))) is None
    return core


def _check(outbox: Outbox) -> None:
    truth = _truth(3)
    assert {rid: (outbox.tokens(rid), outbox.final(rid).finish_reason) for rid in truth} == truth
    assert all(o.finish_reason is None for outs in outbox.outputs.values() for o in outs[:-1])


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_in_process_pipeline_outputs_equal_the_synchronous_scheduler(async_scheduling):
    core = _core(async_scheduling)
    runner = ToyRunner(block_size=4)
    outbox = Outbox()
    drive(core, InProcessExecutor(runner), async_scheduling, outbox)
    _check(outbox)
    assert runner.model.pending_fed > 0 if async_scheduling else runner.model.pending_fed == 0
    assert core.num_steps > 0 and not core.requests


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_ring_executor_keeps_results_that_arrive_before_they_are_awaited(async_scheduling, tmp_path):
    cfg = core_config(runtime_dir=str(tmp_path), instance_id="t" + uuid.uuid4().hex[:8],
                      worker_timeout_s=5.0)
    core = _core(async_scheduling)
    ctx = zmq.Context()
    executor = RingExecutor(cfg, ctx)
    worker = None
    try:
        model = ToyModel(block_size=4)
        worker = RingWorkerThread(cfg, model.execute, ctx=ctx, heartbeat=True)
        outbox = Outbox()

        def drain_late() -> None:  # the results land before the pipeline's next turn
            time.sleep(0.001)
            RingExecutor.drain(executor)

        kept: list[int] = []

        def keep(msg: P.StepResult) -> None:
            kept.append(msg.step_id)
            RingExecutor._keep(executor, msg)

        executor.drain = drain_late  # type: ignore[method-assign]
        executor._keep = keep  # type: ignore[method-assign]
        drive(core, executor, async_scheduling, outbox)
        _check(outbox)
        assert worker.error is None
        fed = model.pending_fed
        assert fed > 0 if async_scheduling else fed == 0
        assert len(kept) > 0 if async_scheduling else kept == []  # early results were used
        assert not executor._early and not executor._submitted  # nothing kept or lost
    finally:
        executor.shutdown("test over")
        if worker is not None:
            worker.close()
        ctx.destroy(linger=0)
