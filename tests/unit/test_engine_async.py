"""The engine core's async scheduling loop against a toy worker that answers each plan at
once, so that every result is already waiting when the engine turns to it (on a GPU the
step is often shorter than the engine's own work). The truth is the scheduler run
synchronously with the same toy model: outputs must match token for token, and no result
may be lost (a lost one hangs the engine until its step timeout)."""

from __future__ import annotations

import random
import time

import pytest
import zmq

from services.engine.block_manager import BlockManager
from services.engine.core import EngineCore, FrontendState
from services.engine.request import Request
from services.engine.scheduler import Scheduler
from shared import protocol as P
from shared.config import build_config
from tests.unit.test_scheduler import EOS, VOCAB, ToyModel, run


class InstantWorker:
    """Stands in for the plan ring: each written plan runs on the toy model at once and its
    StepResult is pushed to the engine's worker socket, plus a heartbeat after it."""

    def __init__(self, ctx: zmq.Context, address: str, block_size: int):
        self.push = ctx.socket(zmq.PUSH)
        self.push.connect(address)
        self.model = ToyModel(block_size)
        self.enc, self.dec = P.encoder(), P.decoder(P.EngineToWorker)
        self.plans = 0

    def write(self, data: bytes, msg_type: str = "step") -> None:
        plan = self.dec.decode(data)
        self.plans += 1
        self.push.send(self.enc.encode(P.StepResult(plan.step_id, self.model.execute(plan))))
        self.push.send(self.enc.encode(P.WorkerHeartbeat(0, time.time())))


def _requests(seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"r{i}", b"fe", [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 40))],
                    P.SamplingParams(temperature=0, max_tokens=rng.randrange(1, 30)), arrival_time=float(i))
            for i in range(8)]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_loop_outputs_equal_the_synchronous_scheduler(async_scheduling, tmp_path):
    cfg = build_config(cli={"model": "models/SmolLM2-135M-Instruct", "device": "cpu",
                            "async_scheduling": async_scheduling}, env={})
    ctx = zmq.Context()
    core = EngineCore.__new__(EngineCore)
    try:
        core.cfg = cfg
        core.enc, core.dec_worker = P.encoder(), P.decoder(P.WorkerToEngine)
        addr = f"ipc://{tmp_path}/w.sock"
        core.worker_sock = ctx.socket(zmq.PULL)
        core.worker_sock.bind(addr)
        core.router = ctx.socket(zmq.ROUTER)
        core.router.bind(f"ipc://{tmp_path}/r.sock")
        core.ring = InstantWorker(ctx, addr, block_size=4)
        core.scheduler = Scheduler(BlockManager(1000, 4), 8, 16, 200, [EOS])
        core.frontends = {b"fe": FrontendState("frontend-0", time.monotonic())}
        core.pending_aborts, core.stopping, core.num_steps = [], False, 0
        core.worker_timeout_s = 5.0
        core.beacon = type("B", (), {"beat": lambda self: None})()
        got: dict[str, list[int]] = {}
        core._send = lambda ident, msg: [got.setdefault(o.request_id, []).extend(o.new_token_ids)
                                         for o in msg.outputs]
        reqs = _requests(3)
        for r in reqs:
            core.scheduler.add(r)
        deadline = time.monotonic() + 20
        while core.scheduler.has_work() or core.inflight is not None:
            assert time.monotonic() < deadline, "engine loop stalled"
            core._advance()
            time.sleep(0.001)  # the worker's next result lands before the next turn
            if core.worker_sock.poll(0):
                core._drain_workers()  # as run() does between turns
        truth = run(_requests(3), num_blocks=1000, budget=16)
        assert {r.request_id: (r.output_token_ids, r.finish_reason) for r in reqs} == truth
        assert got == {k: v[0] for k, v in truth.items()}
        assert core.ring.model.pending_fed > 0 if async_scheduling else core.ring.model.pending_fed == 0
    finally:
        ctx.destroy(linger=0)
