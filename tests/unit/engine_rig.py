"""Engine cores built for tests: a config, model facts, and a driver loop.

`core_config` builds a KestrelConfig for a toy model; `toy_info` its ModelSpec; `drive`
runs an EngineCore's step pipeline until nothing is left, as the engine process's loop
does between frontend messages, and collects every output sent per request id;
`RingWorkerThread` is worker rank 0 on a thread, reading the real plan ring.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import zmq

from services.engine.core import EngineCore
from services.engine.executor import Executor
from services.engine.outputs import Emitted
from services.engine.pipeline import StepPipeline
from shared import protocol as P
from shared.config import KestrelConfig, build_config, ring_name
from shared.model_spec import ModelSpec, default_max_model_len
from shared.shm_ring import ShmRingReader


def core_config(**settings) -> KestrelConfig:
    """A config for cores on the CPU: the test model's folder, then `settings`."""
    cli = {"model": "models/SmolLM2-135M-Instruct", "device": "cpu"}
    cli.update(settings)
    return build_config(cli=cli, env={})


def toy_info(vocab_size: int, eos: int, max_model_len: int | None = None,
             max_position_embeddings: int = 4096) -> ModelSpec:
    """Model facts of a toy model (no folder). max_model_len: the setting (None: the default
    for max_position_embeddings), as `shared.model_spec.load_model_spec` resolves it."""
    return ModelSpec(path="/nonexistent/toy", architecture="Toy", model_type="toy", num_layers=1,
                     hidden_size=8, intermediate_size=16, num_heads=1, num_kv_heads=1, head_dim=8,
                     vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                     tie_word_embeddings=False, num_experts=1, moe_intermediate_size=16,
                     eos_token_ids=(eos,), bos_token_id=None, dtype="float32", kv_dtype="float32",
                     max_model_len=max_model_len or default_max_model_len(max_position_embeddings),
                     hf_config={})


class Outbox:
    """Every output a core emitted, per request id, in order."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[P.RequestOutput]] = {}

    def take(self, em: Emitted | None) -> None:
        if em is None:
            return
        for _, o in em.outputs():
            self.outputs.setdefault(o.request_id, []).append(o)

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.new_token_ids]

    def final(self, rid: str) -> P.RequestOutput:
        return self.outputs[rid][-1]


def drive(core: EngineCore, executor: Executor, async_scheduling: bool, outbox: Outbox,
          timeout_s: float = 30.0) -> StepPipeline:
    """Run `core` on `executor` until no work is left (the engine loop's order: admit
    compiled grammars, read the executor, advance, apply aborts). Raises AssertionError on
    a stall."""
    pipeline = StepPipeline(core, executor, async_scheduling)
    deadline = time.monotonic() + timeout_s
    while pipeline.busy() or core.num_compiling:
        assert time.monotonic() < deadline, "engine loop stalled"
        if core.num_compiling:
            outbox.take(core.admit_compiled({b"fe"}))
        executor.drain()
        if pipeline.busy():
            outbox.take(pipeline.advance())
        else:
            time.sleep(0.005)  # only compiles are left
        outbox.take(core.apply_aborts())
    return pipeline


class RingWorkerThread:
    """Worker rank 0 on a thread: reads each plan from the shm plan ring of `cfg`, runs it
    on `execute` (a toy model's: plan -> sampled token ids) and pushes its StepResult to the
    engine's worker socket, until WorkerShutdown (its reason kept in `shutdown_reason`).

    ctx: the ZMQ context of the push socket (None: its own, destroyed by `close`).
    ready_blocks: when given, a WorkerReady with this many blocks is sent first (what
        `RingExecutor.wait_ready` waits for). step_s: seconds each step sleeps first.
    heartbeat: push a WorkerHeartbeat after each result.
    error: what ended the loop other than WorkerShutdown, or None.
    """

    def __init__(self, cfg: KestrelConfig, execute: Callable[[P.StepPlan], list[int]], *,
                 ctx: zmq.Context | None = None, ready_blocks: int | None = None,
                 step_s: float = 0.0, heartbeat: bool = False):
        self.reader = ShmRingReader(ring_name(cfg.instance_id, "plan"), 0, cfg.runtime_dir)
        self._own_ctx = ctx is None
        self.ctx = zmq.Context() if ctx is None else ctx
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(cfg.worker_address)
        self.execute = execute
        self.step_s, self.heartbeat = step_s, heartbeat
        self.shutdown_reason: str | None = None
        self.error: BaseException | None = None
        self.enc, self.dec = P.encoder(), P.decoder(P.EngineToWorker)
        if ready_blocks is not None:
            self.push.send(self.enc.encode(P.WorkerReady(0, os.getpid(), ready_blocks, cfg.block_size,
                                                         "cpu", {"kv_block_bytes": 64})))
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:
            while True:
                data = self.reader.read(timeout=0.1)
                if data is None:
                    continue
                msg = self.dec.decode(data)
                if isinstance(msg, P.WorkerShutdown):
                    self.shutdown_reason = msg.reason
                    return
                if self.step_s:
                    time.sleep(self.step_s)  # a step that takes time on the "device"
                self.push.send(self.enc.encode(P.StepResult(msg.step_id, self.execute(msg))))
                if self.heartbeat:
                    self.push.send(self.enc.encode(P.WorkerHeartbeat(0, time.time())))
        except BaseException as e:  # reported by the test
            self.error = e

    def close(self) -> None:
        """Wait for the loop to end (after WorkerShutdown), close the ring and the socket."""
        self.thread.join(5)
        self.reader.close()
        if self._own_ctx:
            self.ctx.destroy(linger=0)
        else:
            self.push.close(linger=0)
