"""The engine core: the loop that takes requests in, plans steps, and sends tokens out.

Sockets (DESIGN §2):
- ROUTER bound at cfg.engine_address: frontends (DEALER) send `FrontendToEngine` messages
  and receive `EngineToFrontend` messages routed by their ZMQ identity.
- PULL bound at cfg.worker_address: workers send `WorkerToEngine` messages.
- shm ring `kestrel-<instance>-plan`: the engine writes each `StepPlan`; every worker reads it.

A step is synchronous: write the plan, wait for worker rank 0's `StepResult`, apply it.
While waiting, frontend messages are still read: new requests join the waiting queue at
once; aborts are applied after the step (their blocks are in use by it).

An AddRequest is refused with an error output when the waiting queue holds
cfg.max_num_waiting requests (error_kind "overloaded": the frontend answers 503), when it
is invalid (empty, too long, token ids out of range, bad logprobs counts, a grammar that
fails to compile: "invalid", 400). A worker fault fails the step's requests ("internal").
Structured-output grammars are compiled at add time (`services.engine.structured`); a new
one in a thread, its request admitted by the loop when it is ready (`_finish_compiles`).

KV tiers (kv_offload_cpu_gib > 0 with the prefix cache on): the scheduler's KV connector
(`services.engine.kv_tiers.KVStoreConnector`) talks to the kvstore on this loop (its
socket is polled next to the others, also while a step runs). Plans carry the tier copies
(`StepPlan.kv_loads` / `kv_stores`, put in by the scheduler); stores that are ready while
nothing else runs go out in a transfer-only plan (`Scheduler.transfer_plan`).

This module holds construction, startup, the main loop (`run`), shutdown and `run_engine`;
the frontend side is in `services.engine.frontends`, the step pipeline in
`services.engine.steps`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time

import zmq

from services.engine.block_manager import BlockManager
from services.engine.frontends import (DEBUG_SLEEP_MAX_S, FRONTEND_TIMEOUT_S, FrontendLink,
                                       FrontendState)
from services.engine.kv_connector import KVConnector
from services.engine.kv_tiers import KVStoreConnector
from services.kvstore.settings import ConfigError, derive_block_bytes, store_identity
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.engine.steps import STEP_LIMIT_FACTOR, EngineStopping, StepPipeline
from services.engine.structured import StructuredOutputManager
from shared import protocol as P
from shared.config import KestrelConfig, ring_name
from shared.model_info import load_model_info
from shared.liveness import Beacon
from shared.procutil import CONFIG_REFUSED, EXIT_CONFIG, die_with_parent, on_stop_signals, set_title, setup_logging
from shared.shm_ring import ShmRingWriter
from shared.zmq_utils import make_socket, safe_decode

log = logging.getLogger("kestrel.engine")
COMPILE_POLL_MS = 5  # the loop's poll timeout while grammars compile and nothing else runs

# Names that moved to frontends.py / steps.py, still importable from here. The constants are
# read where they are defined now: a test that patches one patches it in that module.
__all__ = ["EngineCore", "EngineStopping", "FrontendState", "run_engine", "FRONTEND_TIMEOUT_S",
           "STEP_LIMIT_FACTOR", "DEBUG_SLEEP_MAX_S"]


class EngineCore(FrontendLink, StepPipeline):
    """One engine process: scheduler + block manager + sockets + plan ring.

    Construction, startup, the main loop and shutdown live here; the frontend side
    (messages, liveness, aborts, outputs) in `FrontendLink` (services.engine.frontends), the
    step pipeline (plans out, results in) in `StepPipeline` (services.engine.steps).
    """

    tiers: KVConnector | None = None  # class default: tests build engines without __init__
    inflight: SchedulerOutput | None = None  # the plan sent and not yet finished (async)
    early_results: dict | None = None  # step id -> StepResult that came before awaited
    _structured_thread: threading.Thread | None = None  # the startup build of the compiler

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
        # (request id, finish reason, error message or None). An error message means the
        # engine aborts on its own (frontend dropped): the output goes to the frontend anyway.
        self.pending_aborts: list[tuple[str, str, str | None]] = []
        self.stopping = False
        self.last_worker_msg = time.monotonic()
        self.engine_id = f"{cfg.instance_id}-{os.getpid()}"
        self.rng = random.Random(cfg.seed ^ os.getpid())
        self.num_steps = 0
        self.worker_timeout_s = float(cfg.worker_timeout_s or 10.0)
        self.debug_sleep_s = 0.0  # set by the debug_sleep utility; slept in the next step
        self.beacon = Beacon(cfg.runtime_dir, "engine")  # watchdog progress + stack dumps
        self._structured: StructuredOutputManager | None = None  # built at start (thread)
        self.tiers: KVConnector | None = None  # the scheduler's KV connector, when offload is on

    def structured(self) -> StructuredOutputManager:
        """The grammar compiler. `start` builds it in a background thread (0.2 s+: reads the
        tokenizer's vocabulary) so that the first structured request does not stall the
        loop (and the frontends' heartbeat answers); this waits for that build, and builds
        it here if the build failed or never ran. Raises FileNotFoundError without
        tokenizer.json."""
        thread = self._structured_thread
        if thread is not None:
            thread.join()
            self._structured_thread = None
        if self._structured is None:
            self._structured = StructuredOutputManager(self.info.path, self.info.vocab_size,
                                                       list(self.info.eos_token_ids))
        return self._structured

    def _prepare_structured(self) -> None:
        """Start building the grammar compiler in a daemon thread (see `structured`). A
        failure is logged; the first structured request then retries and reports it."""

        def build() -> None:
            try:
                self._structured = StructuredOutputManager(
                    self.info.path, self.info.vocab_size, list(self.info.eos_token_ids))
            except Exception as e:
                log.warning("structured output not prepared at start: %s", e)

        self._structured_thread = threading.Thread(target=build, name="xgrammar-prepare",
                                                   daemon=True)
        self._structured_thread.start()

    # ------------------------------------------------------------------ startup

    def wait_for_workers(self, timeout: float) -> list[P.WorkerReady]:
        """Block until every worker sent `WorkerReady`. Raises TimeoutError."""
        ready: dict[int, P.WorkerReady] = {}
        deadline = time.monotonic() + timeout
        while len(ready) < self.num_workers:
            left = deadline - time.monotonic()
            self.beacon.beat()
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
        t0 = time.monotonic()
        self._prepare_structured()  # overlaps the workers' startup
        workers = self.wait_for_workers(self.cfg.startup_timeout_s)
        t_workers = time.monotonic() - t0
        num_blocks = min(w.num_blocks for w in workers)
        # The KV dtype is the model dtype until KV dtypes arrive (DESIGN §4); one rank for now.
        # The same root as the kvstore's (services.kvstore.settings.store_identity).
        root = store_identity(self.cfg)
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
        if (self.cfg.kv_offload_cpu_gib or 0) > 0 and self.cfg.enable_prefix_caching:
            self._start_tiers(workers)
        log.info("engine ready: %d KV blocks (%d tokens), max_model_len %d, listening at %s",
                 num_blocks, kv_tokens, self.max_model_len, self.cfg.engine_address)
        self._startup_report(workers, num_blocks, kv_tokens,
                             {"engine wait for workers": t_workers,
                              "engine ready": time.monotonic() - t0})

    def _start_tiers(self, workers: list[P.WorkerReady]) -> None:
        """Start the kvstore client; block bytes as the workers lay them out in a slot."""
        try:
            block_bytes = int(workers[0].report.get("kv_block_bytes") or derive_block_bytes(self.cfg))
        except ConfigError as e:
            log.error("KV tiers off: %s", e)
            return
        self.tiers = KVStoreConnector(self.cfg.kvstore_address, self.scheduler.bm.root_hash,
                                      block_bytes, self.ctx)
        self.scheduler.attach_connector(self.tiers)
        log.info("KV tiers: kvstore at %s, %d bytes per block", self.cfg.kvstore_address,
                 block_bytes)

    def _poller(self, *socks) -> zmq.Poller:
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        if self.tiers is not None and self.tiers.socket is not None:
            poller.register(self.tiers.socket, zmq.POLLIN)
        return poller

    def _startup_report(self, workers: list[P.WorkerReady], num_blocks: int, kv_tokens: int,
                        phases: dict[str, float]) -> None:
        """Log the startup report (DESIGN §8) and write it to
        `<runtime_dir>/startup_report.json` (mode 0600) for the supervisor to print.
        phases: seconds since this engine started, per phase. Never raises."""
        from shared.profile import detect_device

        try:
            report = {
                "device": detect_device().describe(),
                "workers": [dict(w.report, rank=w.rank, pid=w.pid)
                            for w in sorted(workers, key=lambda w: w.rank)],
                "num_blocks": num_blocks, "block_size": self.cfg.block_size,
                "kv_tokens": kv_tokens, "max_model_len": self.max_model_len,
                "phases": {k: round(v, 3) for k, v in phases.items()}}
            # One line here; the supervisor prints it formatted once the server is ready.
            log.info("startup report: %s", json.dumps(report, default=str))
            path = os.path.join(self.cfg.runtime_dir, "startup_report.json")
            tmp = f"{path}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump(report, fh, default=str)
            os.replace(tmp, path)
        except Exception as e:  # the report must never stop the engine
            log.warning("startup report failed: %s", e)

    # ------------------------------------------------------------------ main loop

    def run(self) -> None:
        poller = self._poller(self.router, self.worker_sock)
        tier_sock = self.tiers.socket if self.tiers is not None else None
        last_check = time.monotonic()
        while not self.stopping:
            self.beacon.beat()
            if self.debug_sleep_s:
                self._debug_sleep_in_step()
            if self.tiers is not None:
                self.tiers.service()
                if self.tiers.socket is not tier_sock:
                    poller, tier_sock = self._poller(self.router, self.worker_sock), self.tiers.socket
            busy = (self.scheduler.has_work() or self.inflight is not None
                    or (self.tiers is not None and self.tiers.has_stores()))
            if self._compiling:  # grammars compiling in threads: admit the ready ones
                self._finish_compiles()
            events = dict(poller.poll(0 if busy else (COMPILE_POLL_MS if self._compiling else 100)))
            if self.router in events:
                self._drain_frontends(in_step=False)
            if self.worker_sock in events:
                self._drain_workers()
            now = time.monotonic()
            if now - last_check > 1.0:
                self._check_frontends()
                self._apply_aborts()
                last_check = now
            if busy:
                self._advance()
                self._apply_aborts()

    def shutdown(self, reason: str = "the engine stopped before the request finished") -> None:
        """Fail what is in flight with `reason`, stop the workers, unlink the ring, close
        sockets (the frontends get up to 1 s to receive the failed outputs)."""
        if self.scheduler is not None and self.router is not None:
            reqs = list(self.scheduler.requests.values())
            for req in reqs:
                self.scheduler.finish(req, "error")
            self._emit(reqs, error=reason)
            for _, ident, msg in (self._compiling or {}).values():
                self._refuse(ident, msg, "internal", reason)
        if self._compile_pool is not None:
            self._compile_pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.ring.write(self.enc.encode(P.WorkerShutdown(reason)), msg_type="shutdown", timeout=1.0)
        except Exception as e:  # a dead worker cannot drain the ring
            log.debug("could not send shutdown to workers: %s", e)
        self.ring.close()
        if self.tiers is not None:
            self.tiers.close()
        if self.router is not None:
            self.router.close(linger=1000)
        self.ctx.destroy(linger=0)


def run_engine(cfg: KestrelConfig) -> int:
    """Entry point of `kestrel engine`. Returns the process exit code."""
    set_title("kestrel:engine")
    die_with_parent()
    setup_logging("engine", cfg.log_level)
    engine = EngineCore(cfg)

    def on_term(signum, frame):
        engine.stopping = True

    on_stop_signals(on_term)  # SIGTERM; SIGINT too unless supervised
    code = 0
    reason = "the engine stopped (server shutdown or restart) before the request finished"
    try:
        engine.start()
        engine.run()
    except EngineStopping as e:
        log.info("%s", e)
    except TimeoutError as e:
        log.error("%s: failing the requests in flight and exiting for a restart", e)
        reason = f"the model worker stopped answering ({e}); the engine is restarting"
        code = 1
    except SystemExit as e:  # a configuration the engine refuses (start): no restart
        log.error("%s", e.code)
        code = EXIT_CONFIG
        try:
            with open(os.path.join(cfg.runtime_dir, CONFIG_REFUSED), "w") as fh:
                fh.write(f"{e.code}\n")
        except OSError as err:
            log.warning("could not record the refused configuration: %s", err)
    except Exception:
        log.exception("engine failed")
        code = 1
    finally:
        engine.shutdown(reason)
    log.info("engine stopped (exit code %d)", code)
    return code
