"""The engine process over real sockets, inside one test process: `EngineProcess` with its
ROUTER, the real `RingExecutor` (shm ring + PULL socket) and a worker thread that answers
each plan with the scheduler tests' toy model; a DEALER plays the frontend.

Truth: the scheduler run synchronously with the same toy model (tests/unit/test_scheduler.py)
gives every request's tokens; the frontend must receive exactly those. Also: Hello is
answered with the engine's facts, a heartbeat with the progress made, and shutdown fails the
request still running with the given reason and tells the worker to exit.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid

import pytest
import zmq

from services.engine.executor import EngineStopping
from services.engine.process import EngineProcess, StopFlag
from services.engine.request import Request
from services.engine.ring_executor import RingExecutor
from shared import protocol as P
from shared.liveness import Beacon
from tests.unit.engine_rig import RingWorkerThread, core_config, toy_info
from tests.unit.test_scheduler import EOS, VOCAB, ToyModel, run


@pytest.fixture()
def engine(tmp_path):
    """(EngineProcess running on a thread, its worker, a connected frontend DEALER)."""
    cfg = core_config(runtime_dir=str(tmp_path), instance_id="p" + uuid.uuid4().hex[:8],
                      block_size=4, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=200,
                      worker_timeout_s=5.0, startup_timeout_s=10.0)
    ctx = zmq.Context()
    stop = StopFlag()
    executor = RingExecutor(cfg, ctx)
    worker = RingWorkerThread(cfg, ToyModel(cfg.block_size).execute, ready_blocks=1000, step_s=0.002)
    try:
        proc = EngineProcess.start(cfg, ctx, executor, Beacon(cfg.runtime_dir, "engine"), stop,
                                   toy_info(VOCAB, EOS, cfg.max_model_len))
    except BaseException:  # nothing may outlive a failed start (a live socket hangs pytest's exit)
        executor.shutdown("start failed")
        worker.close()
        ctx.destroy(linger=0)
        raise
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            proc.run()
        except EngineStopping:
            pass
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    fe_ctx = zmq.Context()
    fe = fe_ctx.socket(zmq.DEALER)
    fe.setsockopt(zmq.IDENTITY, b"fe-test")
    fe.connect(cfg.engine_address)
    try:
        yield proc, worker, fe, stop, thread
    finally:
        stop.requested = True
        thread.join(10)
        assert not errors, errors
        fe_ctx.destroy(linger=0)
        worker.close()
        ctx.destroy(linger=0)


def _recv(fe: zmq.Socket, timeout_s: float = 10.0):
    assert fe.poll(int(timeout_s * 1000)), "no answer from the engine"
    return P.decoder(P.EngineToFrontend).decode(fe.recv())


def test_engine_process_serves_a_frontend_and_fails_in_flight_requests_at_shutdown(engine):
    proc, worker, fe, stop, thread = engine
    enc = P.encoder()
    fe.send(enc.encode(P.Hello("frontend-0", os.getpid())))
    info = _recv(fe)
    assert isinstance(info, P.EngineInfo)
    assert (info.max_model_len, info.block_size, info.num_blocks, info.eos_token_ids) == (200, 4, 1000, [EOS])

    rng = random.Random(5)
    prompts = [([rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 40))], rng.randrange(1, 30))
               for _ in range(6)]
    for i, (p, n) in enumerate(prompts):
        fe.send(enc.encode(P.AddRequest(f"r{i}", p, P.SamplingParams(temperature=0, max_tokens=n), 0.0)))
    got: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    while len(finish) < len(prompts):
        msg = _recv(fe)
        if isinstance(msg, P.Outputs):
            for o in msg.outputs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    finish[o.request_id] = o.finish_reason
    truth = run([Request(f"r{i}", b"fe", p, P.SamplingParams(temperature=0, max_tokens=n), float(i))
                 for i, (p, n) in enumerate(prompts)], num_blocks=1000, budget=16)
    assert {rid: (got[rid], finish[rid]) for rid in truth} == truth

    # the heartbeat carries the steps applied when it was answered (a step planned ahead of
    # the last output may still finish around it: read the count before and after)
    before = proc.core.num_steps
    fe.send(enc.encode(P.Heartbeat(time.time())))
    hb = _recv(fe)
    assert isinstance(hb, P.Heartbeat) and 0 < before <= hb.progress <= proc.core.num_steps

    fe.send(enc.encode(P.AddRequest("long", [1, 2, 3], P.SamplingParams(max_tokens=150, ignore_eos=True), 0.0)))
    deadline = time.monotonic() + 10
    while proc.core.requests.get("long") is None or not proc.core.requests["long"].output_token_ids:
        assert time.monotonic() < deadline, "the long request never ran"
        time.sleep(0.01)
    stop.requested = True
    thread.join(10)
    assert not thread.is_alive()
    proc.shutdown("the engine stopped (test)")
    last = None
    while last is None or last.finish_reason is None:
        msg = _recv(fe)
        if isinstance(msg, P.Outputs):
            last = msg.outputs[-1]
    assert (last.request_id, last.finish_reason, last.error_kind) == ("long", "error", "unavailable")
    assert last.error == "the engine stopped (test)"
    worker.thread.join(5)
    assert worker.shutdown_reason == "the engine stopped (test)" and worker.error is None
