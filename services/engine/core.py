"""The engine core: the loop that takes requests in, plans steps, and sends tokens out.

Sockets (DESIGN §2):
- ROUTER bound at cfg.engine_address: frontends (DEALER) send `FrontendToEngine` messages
  and receive `EngineToFrontend` messages routed by their ZMQ identity.
- PULL bound at cfg.worker_address: workers send `WorkerToEngine` messages.
- shm ring `kestrel-<instance>-plan`: the engine writes each `StepPlan`; every worker reads it.

A step is synchronous: write the plan, wait for worker rank 0's `StepResult`, apply it.
While waiting, frontend messages are still read: new requests join the waiting queue at
once; aborts are applied after the step (their blocks are in use by it).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from dataclasses import dataclass

import msgspec
import zmq

from services.engine.block_manager import BlockManager
from services.engine.request import Request
from services.engine.scheduler import Scheduler, SchedulerOutput
from shared import protocol as P
from shared.config import KestrelConfig, ring_name
from shared.hashing import model_identity_hash
from shared.model_info import load_model_info
from shared.procutil import die_with_parent, set_title, setup_logging
from shared.shm_ring import ShmRingWriter
from shared.zmq_utils import make_socket, safe_decode

log = logging.getLogger("kestrel.engine")

FRONTEND_TIMEOUT_S = 5.0  # a frontend silent this long is dead: its requests are aborted
WORKER_TIMEOUT_S = 60.0  # no message from a worker this long during a step: the step failed


@dataclass
class FrontendState:
    name: str
    last_seen: float


class EngineCore:
    """One engine process: scheduler + block manager + sockets + plan ring."""

    def __init__(self, cfg: KestrelConfig, num_workers: int = 1):
        self.cfg = cfg
        self.info = load_model_info(cfg.model)
        self.max_model_len = cfg.max_model_len or min(self.info.max_position_embeddings, 8192)
        self.num_workers = num_workers
        self.ctx = zmq.Context()
        self.enc = P.encoder()
        self.dec_frontend = P.decoder(P.FrontendToEngine)
        self.dec_worker = P.decoder(P.WorkerToEngine)
        self.worker_sock = make_socket(self.ctx, zmq.PULL, cfg.worker_address, bind=True)
        self.ring = ShmRingWriter(ring_name(cfg.instance_id, "plan"), n_readers=num_workers,
                                  n_chunks=cfg.ring_chunks, chunk_size=cfg.ring_chunk_bytes,
                                  runtime_dir=cfg.runtime_dir, instance_id=cfg.instance_id)
        self.router: zmq.Socket | None = None
        self.scheduler: Scheduler | None = None
        self.frontends: dict[bytes, FrontendState] = {}
        self.pending_aborts: list[tuple[str, str]] = []
        self.stopping = False
        self.last_worker_msg = time.monotonic()
        self.engine_id = f"{cfg.instance_id}-{os.getpid()}"
        self.rng = random.Random(cfg.seed ^ os.getpid())
        self.num_steps = 0

    # ------------------------------------------------------------------ startup

    def wait_for_workers(self, timeout: float) -> list[P.WorkerReady]:
        """Block until every worker sent `WorkerReady`. Raises TimeoutError."""
        ready: dict[int, P.WorkerReady] = {}
        deadline = time.monotonic() + timeout
        while len(ready) < self.num_workers:
            left = deadline - time.monotonic()
            if left <= 0 or self.stopping:
                raise TimeoutError(f"{len(ready)}/{self.num_workers} workers ready after {timeout:.0f} s")
            if self.worker_sock.poll(min(left, 0.5) * 1000):
                msg = safe_decode(self.dec_worker, self.worker_sock.recv(), "worker")
                if isinstance(msg, P.WorkerReady):
                    ready[msg.rank] = msg
                    log.info("worker %d ready: pid %d, %d KV blocks of %d tokens, %s", msg.rank,
                             msg.pid, msg.num_blocks, msg.block_size, msg.report)
        return list(ready.values())

    def start(self) -> None:
        workers = self.wait_for_workers(self.cfg.startup_timeout_s)
        num_blocks = min(w.num_blocks for w in workers)
        # The KV dtype is the model dtype until KV dtypes arrive (DESIGN §4); one rank for now.
        root = model_identity_hash(self.info.path, self.cfg.dtype, self.cfg.dtype,
                                   self.cfg.block_size, tensor_parallel_size=1)
        bm = BlockManager(num_blocks, self.cfg.block_size,
                          enable_prefix_caching=self.cfg.enable_prefix_caching, root_hash=root)
        kv_tokens = num_blocks * self.cfg.block_size
        if self.max_model_len > kv_tokens:
            raise SystemExit(f"max_model_len {self.max_model_len} exceeds the KV cache "
                             f"({kv_tokens} tokens); raise --kv-cache-gib or lower --max-model-len")
        self.scheduler = Scheduler(bm, self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens,
                                   self.max_model_len, list(self.info.eos_token_ids))
        self.router = make_socket(self.ctx, zmq.ROUTER, self.cfg.engine_address, bind=True)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        log.info("engine ready: %d KV blocks (%d tokens), max_model_len %d, listening at %s",
                 num_blocks, kv_tokens, self.max_model_len, self.cfg.engine_address)

    # ------------------------------------------------------------------ frontend messages

    def _send(self, ident: bytes, msg) -> None:
        try:
            self.router.send_multipart([ident, self.enc.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # frontend gone: its requests get aborted by liveness
            log.debug("send to %r failed: %s", ident, e)

    def _drain_frontends(self, in_step: bool) -> None:
        while self.router.poll(0):
            ident, data = self.router.recv_multipart()
            msg = safe_decode(self.dec_frontend, data, ident)
            if msg is None:
                continue
            fe = self.frontends.get(ident)
            if fe is not None:
                fe.last_seen = time.monotonic()
            if isinstance(msg, P.Hello):
                self._on_hello(ident, msg)
            elif ident not in self.frontends:
                log.warning("message from unknown frontend %r dropped (no hello)", ident)
            elif isinstance(msg, P.AddRequest):
                self._on_add(ident, msg)
            elif isinstance(msg, P.Abort):
                for rid in msg.request_ids:
                    self.pending_aborts.append((rid, "abort"))
            elif isinstance(msg, P.UtilityCall):
                self._send(ident, self._on_utility(msg))
            elif isinstance(msg, P.Heartbeat):
                self._send(ident, P.Heartbeat(time.time()))
        if not in_step:
            self._apply_aborts()

    def _on_hello(self, ident: bytes, msg: P.Hello) -> None:
        for old_ident, fe in list(self.frontends.items()):
            if fe.name == msg.frontend_id and old_ident != ident:
                log.info("frontend %s reconnected with a new identity: aborting its old requests",
                         msg.frontend_id)
                self._drop_frontend(old_ident)
        self.frontends[ident] = FrontendState(msg.frontend_id, time.monotonic())
        log.info("frontend %s (pid %d) attached", msg.frontend_id, msg.pid)
        self._send(ident, P.EngineInfo(
            engine_id=self.engine_id, model_name=self.cfg.served_model_name,
            model_path=self.info.path, max_model_len=self.max_model_len,
            block_size=self.cfg.block_size, num_blocks=self.scheduler.bm.num_blocks,
            eos_token_ids=list(self.info.eos_token_ids)))

    def _on_add(self, ident: bytes, msg: P.AddRequest) -> None:
        sp = msg.sampling
        error = None
        n = len(msg.prompt_token_ids)
        if n == 0:
            error = "empty prompt"
        elif n + max(sp.max_tokens, 1) > self.max_model_len:
            error = f"prompt ({n} tokens) + max_tokens ({sp.max_tokens}) exceeds max_model_len {self.max_model_len}"
        elif any(t < 0 or t >= self.info.vocab_size for t in msg.prompt_token_ids):
            error = "prompt token id out of range"
        elif msg.request_id in self.scheduler.requests:
            error = "duplicate request id"
        if error:
            self._send(ident, P.Outputs([P.RequestOutput(msg.request_id, [], n, "error", error=error)]))
            return
        if sp.seed is None:
            sp.seed = self.rng.getrandbits(63)
        self.scheduler.add(Request(msg.request_id, ident, msg.prompt_token_ids, sp, msg.arrival_time))

    def _on_utility(self, msg: P.UtilityCall) -> P.UtilityResult:
        s = self.scheduler
        if msg.method in ("stats", "ping"):
            return P.UtilityResult(msg.call_id, {
                "num_blocks": s.bm.num_blocks, "num_free_blocks": s.bm.num_free_blocks,
                "kv_usage": s.bm.usage(), "num_running": len(s.running),
                "num_waiting": len(s.waiting), "num_steps": self.num_steps,
                "num_frontends": len(self.frontends), **s.bm.stats()})
        if msg.method == "reset_prefix_cache":
            # False while any request holds blocks (BlockManager.reset_prefix_cache).
            ok = s.bm.reset_prefix_cache()
            log.info("reset_prefix_cache: %s", "done" if ok else "refused, blocks in use")
            return P.UtilityResult(msg.call_id, {"ok": ok})
        return P.UtilityResult(msg.call_id, error=f"unknown utility method {msg.method!r}")

    def _drop_frontend(self, ident: bytes) -> None:
        self.frontends.pop(ident, None)
        for req in list(self.scheduler.requests.values()):
            if req.frontend == ident:
                self.pending_aborts.append((req.request_id, "abort"))

    def _check_frontends(self) -> None:
        now = time.monotonic()
        for ident, fe in list(self.frontends.items()):
            if now - fe.last_seen > FRONTEND_TIMEOUT_S:
                log.warning("frontend %s silent for %.1f s: aborting its requests", fe.name,
                            now - fe.last_seen)
                self._drop_frontend(ident)

    def _apply_aborts(self) -> None:
        if not self.pending_aborts:
            return
        aborts, self.pending_aborts = self.pending_aborts, []
        for rid, reason in aborts:
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            self.scheduler.finish(req, reason)
            if req.frontend in self.frontends:
                self._send(req.frontend, P.Outputs([self._output(req)]))

    # ------------------------------------------------------------------ steps

    def _output(self, req: Request) -> P.RequestOutput:
        new = req.output_token_ids[req.sent_tokens:]
        req.sent_tokens = len(req.output_token_ids)
        return P.RequestOutput(req.request_id, new, req.num_prompt_tokens, req.finish_reason,
                               req.stop_token_id,
                               num_cached_tokens=max(req.num_cached_tokens, 0))

    def _wait_result(self, step_id: int) -> P.StepResult:
        """Wait for rank 0's result of `step_id`, serving frontends meanwhile.

        Raises TimeoutError when no worker message arrives for WORKER_TIMEOUT_S.
        """
        poller = zmq.Poller()
        poller.register(self.worker_sock, zmq.POLLIN)
        poller.register(self.router, zmq.POLLIN)
        last = time.monotonic()
        while True:
            events = dict(poller.poll(100))
            if self.router in events:
                self._drain_frontends(in_step=True)
            if self.worker_sock in events:
                while self.worker_sock.poll(0):
                    msg = safe_decode(self.dec_worker, self.worker_sock.recv(), "worker")
                    last = time.monotonic()
                    if isinstance(msg, P.StepResult) and msg.step_id == step_id:
                        return msg
            if time.monotonic() - last > WORKER_TIMEOUT_S:
                raise TimeoutError(f"no word from the workers for {WORKER_TIMEOUT_S:.0f} s in step {step_id}")

    def step(self, out: SchedulerOutput) -> None:
        self.ring.write(self.enc.encode(out.plan), msg_type="step")
        result = self._wait_result(out.plan.step_id)
        self.num_steps += 1
        if result.error:
            log.error("step %d failed in the worker: %s", out.plan.step_id, result.error)
            for req in out.requests:
                self.scheduler.finish(req, "error")
            self._emit(out.requests, error=f"internal error in the model worker: {result.error}")
            return
        changed = self.scheduler.update(out, result.sampled_token_ids)
        self._emit(changed)

    def _emit(self, reqs: list[Request], error: str | None = None) -> None:
        by_frontend: dict[bytes, list[P.RequestOutput]] = {}
        for req in reqs:
            o = self._output(req)
            if error:
                o.error = error
            by_frontend.setdefault(req.frontend, []).append(o)
        for ident, outs in by_frontend.items():
            if ident in self.frontends:
                self._send(ident, P.Outputs(outs))

    # ------------------------------------------------------------------ main loop

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.worker_sock, zmq.POLLIN)
        last_check = time.monotonic()
        while not self.stopping:
            busy = self.scheduler.has_work()
            events = dict(poller.poll(0 if busy else 100))
            if self.router in events:
                self._drain_frontends(in_step=False)
            if self.worker_sock in events:
                while self.worker_sock.poll(0):
                    if safe_decode(self.dec_worker, self.worker_sock.recv(), "worker") is not None:
                        self.last_worker_msg = time.monotonic()
            now = time.monotonic()
            if now - last_check > 1.0:
                self._check_frontends()
                self._apply_aborts()
                last_check = now
            if busy:
                out = self.scheduler.schedule()
                if out is not None:
                    self.step(out)
                    self._apply_aborts()

    def shutdown(self, reason: str = "engine stopping") -> None:
        """Fail what is in flight, stop the workers, unlink the ring, close sockets."""
        if self.scheduler is not None and self.router is not None:
            reqs = list(self.scheduler.requests.values())
            for req in reqs:
                self.scheduler.finish(req, "error")
            self._emit(reqs, error=reason)
        try:
            self.ring.write(self.enc.encode(P.WorkerShutdown(reason)), msg_type="shutdown", timeout=1.0)
        except Exception as e:  # a dead worker cannot drain the ring
            log.debug("could not send shutdown to workers: %s", e)
        self.ring.close()
        self.ctx.destroy(linger=0)


def run_engine(cfg: KestrelConfig) -> int:
    """Entry point of `kestrel engine`. Returns the process exit code."""
    set_title("kestrel:engine")
    die_with_parent()
    setup_logging("engine", cfg.log_level)
    engine = EngineCore(cfg)

    def on_term(signum, frame):
        engine.stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    code = 0
    try:
        engine.start()
        engine.run()
    except TimeoutError as e:
        log.error("%s", e)
        code = 1
    except SystemExit as e:
        log.error("%s", e.code)
        code = 2
    except Exception:
        log.exception("engine failed")
        code = 1
    finally:
        engine.shutdown()
    log.info("engine stopped")
    return code
