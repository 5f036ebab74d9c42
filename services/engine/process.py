"""The engine process: sockets, poller, liveness beacon, the main loop, startup, shutdown.

docs/ARCHITECTURE.md §2. Sockets:
- ROUTER bound at cfg.engine_address (after the workers are ready): frontends (DEALER) send
  `FrontendToEngine` messages and receive `EngineToFrontend` messages routed by their ZMQ
  identity (`FrontendLink`).
- The executor's (`RingExecutor`): the plan ring and the workers' PULL socket.
- The kvstore client's DEALER, when the KV tiers are on (`KVConnector.socket`, polled next to
  the others, also while a step runs).

One turn of the loop: beat, service the tiers, admit compiled grammars, poll, read the
frontends and the workers, drop silent frontends and log the periodic stats line
(`StatsLog`, services/engine/stats_log.py) every second, run the step pipeline
(`StepPipeline.advance`), apply the aborts. While a step's result is awaited the process
keeps serving (it is the executor's `WaitHook`): new requests join the waiting queue at
once, aborts are applied after the step (its blocks are in use).

`run_engine(cfg)` is the entry point of `kestrel engine`: exit code 0 after SIGTERM, 1 when
the workers stop answering or the engine fails, EXIT_CONFIG (no restart) when it refuses its
configuration.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import zmq

from services.engine.core import EngineConfigError, EngineCore
from services.engine.executor import EngineStopping, Executor, WorkerExecutor
from services.engine.frontend_link import FrontendLink
from services.engine.grammar_jobs import GrammarJobs
from services.engine.kv_tiers import KVStoreConnector
from services.engine.pipeline import StepPipeline
from services.engine.ring_executor import RingExecutor
from services.engine.startup_report import write_startup_report
from services.engine.stats_log import StatsLog
from shared import protocol as P
from shared.config import KestrelConfig
from shared.liveness import Beacon
from shared.kv_layout import KVLayout
from shared.model_spec import ModelSpec, model_spec_for
from shared.procutil import (CONFIG_REFUSED, EXIT_CONFIG, die_with_parent, freeze_gc, on_stop_signals, set_title,
                             setup_logging)
from shared.runtime_dir import write_private_file
from shared.state_layout import StateLayout
from shared.zmq_utils import make_socket, safe_decode

log = logging.getLogger("kestrel.engine")

COMPILE_POLL_MS = 5  # the loop's poll timeout while grammars compile and nothing else runs
IDLE_POLL_MS = 100   # the loop's poll timeout when idle
CHECK_S = 1.0        # how often silent frontends are looked for


class StopFlag:
    """Set by the stop signal handler; read by the loops."""

    def __init__(self) -> None:
        self.requested = False


class EngineProcess:
    """One running engine: the core, its step pipeline on an executor (the ring executor in
    production), the ROUTER socket and the frontend link (module doc). Built by `start`,
    once the workers are ready.

    Raises nothing itself; `run` raises TimeoutError (workers stopped answering) and
    EngineStopping (SIGTERM during a step).
    """

    def __init__(self, cfg: KestrelConfig, ctx: zmq.Context, core: EngineCore,
                 executor: Executor, router: zmq.Socket, beacon: Beacon, stop: StopFlag):
        self.cfg = cfg
        self.ctx = ctx
        self.core = core
        self.executor = executor
        self.router = router
        self.beacon = beacon
        self.stop = stop
        self.enc = P.encoder()
        self.dec_frontend = P.decoder(P.FrontendToEngine)
        self.engine_id = f"{cfg.instance_id}-{os.getpid()}"
        self.link = FrontendLink(core, self._send, cfg, self.engine_id)
        self.pipeline = StepPipeline(core, executor, bool(cfg.async_scheduling), hook=self)
        self.connector = core.connector  # its socket is polled here, and serviced each turn
        self._tier_sock = self.connector.socket if self.connector is not None else None

    # ------------------------------------------------------------------ startup

    @classmethod
    def start(cls, cfg: KestrelConfig, ctx: zmq.Context, executor: WorkerExecutor,
              beacon: Beacon, stop: StopFlag, info: ModelSpec) -> EngineProcess:
        """Wait for the workers, build the core (and the tiers client), bind the ROUTER,
        write the startup report. Raises TimeoutError (workers not ready in
        cfg.startup_timeout_s, or stop requested), EngineConfigError."""
        t0 = time.monotonic()
        grammars = GrammarJobs(info)
        grammars.prepare()  # overlaps the workers' startup
        workers = executor.wait_ready(cfg.startup_timeout_s, beacon.beat, lambda: stop.requested)
        t_workers = time.monotonic() - t0
        num_blocks = min(w.num_blocks for w in workers)
        layout = KVLayout.for_model(info, cfg.block_size)  # one rank for now
        connector = None
        if (cfg.kv_offload_cpu_gib or 0) > 0 and cfg.enable_prefix_caching:
            connector = _tier_connector(cfg, ctx, workers, layout, info)
        # The prefix-cache root is the kvstore's too (KVLayout.model_identity).
        core = EngineCore(cfg, info, num_blocks, root_hash=layout.model_identity, grammars=grammars,
                          connector=connector, seed=cfg.seed ^ os.getpid())
        router = make_socket(ctx, zmq.ROUTER, cfg.engine_address, bind=True)
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        kv_tokens = num_blocks * cfg.block_size
        log.info("engine ready: %d KV blocks (%d tokens), max_model_len %d, listening at %s",
                 num_blocks, kv_tokens, core.max_model_len, cfg.engine_address)
        write_startup_report(cfg, workers, num_blocks, kv_tokens, core.max_model_len,
                             {"engine wait for workers": t_workers,
                              "engine ready": time.monotonic() - t0})
        proc = cls(cfg, ctx, core, executor, router, beacon, stop)
        freeze_gc()  # startup's objects out of the serving loop's collections
        return proc

    # ------------------------------------------------------------------ sockets

    def _send(self, ident: bytes, msg: P.EngineToFrontend) -> None:
        try:
            self.router.send_multipart([ident, self.enc.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # frontend gone: its requests get aborted by liveness
            log.debug("send to %r failed: %s", ident, e)

    def _drain_frontends(self, in_step: bool) -> None:
        while self.router.poll(0):
            ident, data = self.router.recv_multipart()
            msg = safe_decode(self.dec_frontend, data, ident)
            if msg is not None:
                self.link.on_message(ident, msg)
        if not in_step:
            self.link.apply_aborts()

    def _poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        for sock in (self.router, *self.executor.sockets()):
            poller.register(sock, zmq.POLLIN)
        if self._tier_sock is not None:
            poller.register(self._tier_sock, zmq.POLLIN)
        return poller

    def _service_tiers(self) -> bool:
        """Replies, timeouts and stores of the kvstore client; True when its socket changed."""
        connector = self.connector
        if connector is None:
            return False
        connector.service()
        if connector.socket is self._tier_sock:
            return False
        self._tier_sock = connector.socket
        return True

    # ------------------------------------------------------------------ WaitHook (in a step)

    def sockets(self) -> Sequence[Any]:
        return (self.router,) if self._tier_sock is None else (self.router, self._tier_sock)

    def tick(self) -> None:
        self.beacon.beat()

    def stopping(self) -> bool:
        return self.stop.requested

    def serve(self, ready: Mapping[Any, int]) -> bool:
        changed = self._service_tiers()  # replies, timeouts and stores go on during a step
        if self.router in ready:
            self._drain_frontends(in_step=True)
        return changed

    # ------------------------------------------------------------------ main loop

    def run(self) -> None:
        """The main loop, until a stop signal (module doc)."""
        core, link, pipeline, executor = self.core, self.link, self.pipeline, self.executor
        worker_socks = executor.sockets()
        poller, polled_tier_sock = self._poller(), self._tier_sock
        last_check = time.monotonic()
        stats_log = StatsLog(core.stats, time.monotonic)
        while not self.stop.requested:
            self.beacon.beat()
            if link.debug_sleep_s:
                self._debug_sleep_in_step()
            self._service_tiers()
            if self._tier_sock is not polled_tier_sock:  # reconnected here or during a step
                poller, polled_tier_sock = self._poller(), self._tier_sock
            busy = pipeline.busy()
            if core.num_compiling:  # grammars compiling in threads: admit the ready ones
                link.admit_compiled()
            timeout = 0 if busy else (COMPILE_POLL_MS if core.num_compiling else IDLE_POLL_MS)
            events = dict(poller.poll(timeout))
            if self.router in events:
                self._drain_frontends(in_step=False)
            if any(s in events for s in worker_socks):
                executor.drain()
            now = time.monotonic()
            if now - last_check > CHECK_S:
                link.check_frontends()
                link.apply_aborts()
                stats_log.tick()
                last_check = now
            if busy:
                link.deliver(pipeline.advance())
                link.apply_aborts()

    def _debug_sleep_in_step(self) -> None:
        """The debug_sleep hang: block the engine's loop (no beats, no answers)."""
        secs, self.link.debug_sleep_s = self.link.debug_sleep_s, 0.0
        time.sleep(secs)
        log.warning("debug_sleep: woke up after %.1f s", secs)

    def shutdown(self, reason: str) -> None:
        """Fail what is in flight with `reason`, stop the workers, unlink the ring, close the
        tiers client and the ROUTER (the frontends get up to 1 s to receive the failed
        outputs). The caller destroys the context."""
        self.link.deliver(self.core.fail_all(reason))
        self.executor.shutdown(reason)
        if self.connector is not None:
            self.connector.close()
        self.router.close(linger=1000)


def _tier_connector(cfg: KestrelConfig, ctx: zmq.Context, workers: list[P.WorkerReady],
                    layout: KVLayout, info: ModelSpec) -> KVStoreConnector | None:
    """The kvstore's KV connector, or None (tiers off) when the workers lay out a block
    otherwise than `layout.slot_bytes` (what the kvstore's slots are sized for), or a
    hybrid model's state checkpoint otherwise than its `StateLayout` (§4.7)."""
    block_bytes = layout.slot_bytes
    reported = workers[0].report.get("kv_block_bytes")
    if reported is not None and int(reported) != block_bytes:
        log.error("KV tiers off: the workers lay out %s bytes per block, the KV layout says %d",
                  reported, block_bytes)
        return None
    try:
        state = StateLayout.for_model(info, layout)
    except ValueError as e:
        log.error("KV tiers off: %s", e)
        return None
    state_bytes = state.state_bytes if state is not None else 0
    reported = workers[0].report.get("state_checkpoint_bytes")
    if reported is not None and int(reported) != state_bytes:
        log.error("KV tiers off: the workers lay out %s bytes per state checkpoint, the state layout "
                  "says %d", reported, state_bytes)
        return None
    log.info("KV tiers: kvstore at %s, %d bytes per block%s", cfg.kvstore_address, block_bytes,
             f", {state_bytes} per state checkpoint" if state_bytes else "")
    return KVStoreConnector(cfg.kvstore_address, layout.model_identity, block_bytes, ctx,
                            state_identity=state.state_identity if state is not None else b"",
                            state_bytes=state_bytes)


def _record_refusal(cfg: KestrelConfig, why: object) -> None:
    """Write the refused configuration's reason where the supervisor looks for it (it is
    `kestrel serve`'s last line)."""
    try:
        write_private_file(cfg.runtime_dir, CONFIG_REFUSED, f"the engine refused its configuration: {why}\n")
    except OSError as err:
        log.warning("could not record the refused configuration: %s", err)


def run_engine(cfg: KestrelConfig) -> int:
    """Entry point of `kestrel engine`. Returns the process exit code (module doc)."""
    set_title("kestrel:engine")
    die_with_parent()
    setup_logging("engine", cfg.log_level)
    info = model_spec_for(cfg)
    ctx = zmq.Context()
    stop = StopFlag()
    executor = RingExecutor(cfg, ctx, num_workers=1)
    beacon = Beacon(cfg.runtime_dir, "engine")  # watchdog progress + stack dumps

    def on_term(signum, frame):
        stop.requested = True

    on_stop_signals(on_term)  # SIGTERM; SIGINT too unless supervised
    code = 0
    reason = "the engine stopped (server shutdown or restart) before the request finished"
    engine: EngineProcess | None = None
    try:
        engine = EngineProcess.start(cfg, ctx, executor, beacon, stop, info)
        engine.run()
    except EngineStopping as e:
        log.info("%s", e)
    except TimeoutError as e:
        log.error("%s: failing the requests in flight and exiting for a restart", e)
        reason = f"the model worker stopped answering ({e}); the engine is restarting"
        code = 1
    except (EngineConfigError, SystemExit) as e:  # a configuration the engine refuses: no restart
        why = e.code if isinstance(e, SystemExit) else str(e)
        log.error("%s", why)
        code = EXIT_CONFIG
        _record_refusal(cfg, why)
    except Exception:
        log.exception("engine failed")
        code = 1
    finally:
        if engine is not None:
            engine.shutdown(reason)
        else:
            executor.shutdown(reason)
        ctx.destroy(linger=0)
    log.info("engine stopped (exit code %d)", code)
    return code
