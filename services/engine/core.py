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
Structured-output grammars are compiled at add time (`services.engine.structured`).

KV tiers (kv_offload_cpu_gib > 0 with the prefix cache on): `services.engine.kv_tiers`
talks to the kvstore on this loop (its socket is polled next to the others, also while a
step runs). Plans carry the tier copies (`StepPlan.kv_loads` / `kv_stores`); stores that
are ready while nothing else runs go out in a transfer-only plan.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass

import zmq

from services.engine.block_manager import BlockManager
from services.engine.kv_tiers import KVTiers
from services.kvstore.settings import ConfigError, derive_block_bytes, store_identity
from services.engine.request import Request
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.engine.structured import GrammarError, StructuredOutputManager
from shared import protocol as P
from shared.config import KestrelConfig, ring_name
from shared.model_info import load_model_info
from shared.liveness import Beacon
from shared.procutil import die_with_parent, on_stop_signals, set_title, setup_logging
from shared.shm_ring import ShmRingWriter
from shared.zmq_utils import make_socket, safe_decode

log = logging.getLogger("kestrel.engine")

FRONTEND_TIMEOUT_S = 5.0  # a frontend silent this long is dead: its requests are aborted
# cfg.worker_timeout_s: no message from a worker this long during a step: the step failed.
# A step running longer than this many worker timeouts is stuck even while the workers'
# heartbeat threads still beat (e.g. a collective that never returns).
STEP_LIMIT_FACTOR = 6
DEBUG_SLEEP_MAX_S = 600.0


class EngineStopping(Exception):
    """SIGTERM arrived while the engine waited for a step's result."""


@dataclass
class FrontendState:
    name: str
    last_seen: float


class EngineCore:
    """One engine process: scheduler + block manager + sockets + plan ring."""

    tiers: KVTiers | None = None  # class default: tests build engines without __init__
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
        self.tiers: KVTiers | None = None  # the kvstore client, when offload is on

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
        self.tiers = KVTiers(self.cfg.kvstore_address, self.scheduler.bm.root_hash, block_bytes,
                             self.scheduler, self.ctx)
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
                self._on_unknown(ident, msg)
            elif isinstance(msg, P.AddRequest):
                self._on_add(ident, msg)
            elif isinstance(msg, P.Abort):
                for rid in msg.request_ids:
                    self.pending_aborts.append((rid, "abort", None))
            elif isinstance(msg, P.UtilityCall):
                self._send(ident, self._on_utility(msg))
            elif isinstance(msg, P.Heartbeat):
                # progress/busy let the frontend tell a stuck engine from an idle one
                self._send(ident, P.Heartbeat(time.time(), progress=self.num_steps,
                                              busy=self.scheduler.has_work()))
        if not in_step:
            self._apply_aborts()

    def _on_unknown(self, ident: bytes, msg) -> None:
        """A message from an identity without a Hello (dropped after a silence, or sent to
        an earlier engine): refuse what needs an answer, and tell it to say Hello again."""
        reason = "this frontend is not attached to the engine (dropped or engine restarted)"
        log.warning("%s from unknown frontend %r: asking it to re-attach", type(msg).__name__,
                    ident)
        if isinstance(msg, P.AddRequest):
            self._send(ident, P.Outputs([P.RequestOutput(
                msg.request_id, [], len(msg.prompt_token_ids), "error", error=reason,
                error_kind="overloaded")]))
        elif isinstance(msg, P.UtilityCall):
            self._send(ident, P.UtilityResult(msg.call_id, error=reason))
        self._send(ident, P.NotAttached(reason))

    def _on_hello(self, ident: bytes, msg: P.Hello) -> None:
        for old_ident, fe in list(self.frontends.items()):
            if fe.name == msg.frontend_id and old_ident != ident:
                log.info("frontend %s reconnected with a new identity: aborting its old requests",
                         msg.frontend_id)
                self._drop_frontend(old_ident, "the frontend reconnected with a new identity")
        known = ident in self.frontends  # a repeated hello (the frontend saw us silent)
        self.frontends[ident] = FrontendState(msg.frontend_id, time.monotonic())
        (log.debug if known else log.info)("frontend %s (pid %d) attached", msg.frontend_id,
                                           msg.pid)
        self._send(ident, P.EngineInfo(
            engine_id=self.engine_id, model_name=self.cfg.served_model_name,
            model_path=self.info.path, max_model_len=self.max_model_len,
            block_size=self.cfg.block_size, num_blocks=self.scheduler.bm.num_blocks,
            eos_token_ids=list(self.info.eos_token_ids)))

    def _validate(self, msg: P.AddRequest) -> str | None:
        """Why an AddRequest is invalid (the client's fault), or None."""
        sp = msg.sampling
        n = len(msg.prompt_token_ids)
        vocab = self.info.vocab_size
        if n == 0:
            return "empty prompt"
        if n + max(sp.max_tokens, 1) > self.max_model_len:
            return f"prompt ({n} tokens) + max_tokens ({sp.max_tokens}) exceeds max_model_len {self.max_model_len}"
        if any(t < 0 or t >= vocab for t in msg.prompt_token_ids):
            return "prompt token id out of range"
        if sp.max_tokens < 0 or sp.min_tokens < 0:
            return "max_tokens and min_tokens must be >= 0"
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(sp, name)
            if k is not None and not 0 <= k <= 20:
                return f"{name} must be in 0..20"
        if any(t < 0 or t >= vocab for t in list(sp.logit_bias) + list(sp.stop_token_ids)):
            return "logit_bias / stop_token_ids token id out of range"
        if sp.repetition_penalty <= 0:
            return "repetition_penalty must be > 0"
        if msg.request_id in self.scheduler.requests:
            return "duplicate request id"
        return None

    def _on_add(self, ident: bytes, msg: P.AddRequest) -> None:
        sp = msg.sampling
        n = len(msg.prompt_token_ids)
        kind, error = "invalid", self._validate(msg)
        if error is None and len(self.scheduler.waiting) >= self.cfg.max_num_waiting:
            kind, error = "overloaded", f"waiting queue full ({self.cfg.max_num_waiting} requests)"
        grammar = None
        if error is None and sp.structured is not None:
            try:
                grammar = self.structured().grammar_for(sp.structured)
            except GrammarError as e:
                error = str(e)
            except Exception as e:  # no tokenizer.json, xgrammar fault: not the client's fault
                log.exception("request %s: structured output unavailable", msg.request_id)
                kind, error = "internal", f"structured output unavailable: {e}"
        if error:
            self._send(ident, P.Outputs([P.RequestOutput(msg.request_id, [], n, "error", error=error,
                                                         error_kind=kind)]))
            return
        if sp.seed is None:
            sp.seed = self.rng.getrandbits(63)
        req = Request(msg.request_id, ident, msg.prompt_token_ids, sp, msg.arrival_time)
        req.grammar = grammar
        self.scheduler.add(req)

    def _on_utility(self, msg: P.UtilityCall) -> P.UtilityResult:
        s = self.scheduler
        if msg.method in ("stats", "ping"):
            return P.UtilityResult(msg.call_id, {
                "num_blocks": s.bm.num_blocks, "num_free_blocks": s.bm.num_free_blocks,
                "kv_usage": s.bm.usage(), "num_running": len(s.running),
                "num_waiting": len(s.waiting), "num_steps": self.num_steps,
                "num_frontends": len(self.frontends), "num_preemptions": s.num_preemptions,
                **s.bm.stats(),
                **(self.tiers.stats() if self.tiers is not None else {})})
        if msg.method == "debug_sleep":
            # Debug only (--debug-utilities): the engine sleeps inside its next step for
            # args["seconds"] (<= DEBUG_SLEEP_MAX_S), as a hang for watchdog/liveness tests.
            if not self.cfg.debug_utilities:
                return P.UtilityResult(msg.call_id, error="debug utilities are off "
                                       "(start with --debug-utilities)")
            try:
                secs = float(msg.args.get("seconds", 0))
            except (TypeError, ValueError):
                secs = -1.0
            if not 0 < secs <= DEBUG_SLEEP_MAX_S:
                return P.UtilityResult(msg.call_id, error=f"seconds must be in (0, {DEBUG_SLEEP_MAX_S:.0f}]")
            self.debug_sleep_s = secs
            log.warning("debug_sleep: the engine will sleep %.1f s inside its next step", secs)
            return P.UtilityResult(msg.call_id, {"ok": True, "seconds": secs})
        if msg.method == "reset_prefix_cache":
            # False while any request holds blocks (BlockManager.reset_prefix_cache).
            ok = s.bm.reset_prefix_cache()
            log.info("reset_prefix_cache: %s", "done" if ok else "refused, blocks in use")
            return P.UtilityResult(msg.call_id, {"ok": ok})
        return P.UtilityResult(msg.call_id, error=f"unknown utility method {msg.method!r}")

    def _drop_frontend(self, ident: bytes, why: str) -> None:
        """Forget a frontend and abort its requests. Each aborted request's last output
        (finish_reason "abort", error `why`) is still sent to that identity: if the
        frontend is alive after all (its loop was blocked), its clients get an error, not
        a stream that never ends."""
        self.frontends.pop(ident, None)
        for req in list(self.scheduler.requests.values()):
            if req.frontend == ident:
                self.pending_aborts.append((req.request_id, "abort", why))

    def _check_frontends(self) -> None:
        now = time.monotonic()
        for ident, fe in list(self.frontends.items()):
            silent = now - fe.last_seen
            if silent > FRONTEND_TIMEOUT_S:
                log.warning("frontend %s silent for %.1f s: aborting its requests", fe.name,
                            silent)
                self._drop_frontend(ident, f"the engine dropped this frontend after "
                                           f"{silent:.0f} s of silence")

    def _apply_aborts(self) -> None:
        if not self.pending_aborts:
            return
        aborts, self.pending_aborts = self.pending_aborts, []
        for rid, reason, error in aborts:
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            self.scheduler.finish(req, reason)
            if error is not None:
                out = self._output(req)
                out.error, out.error_kind = error, "internal"
                self._send(req.frontend, P.Outputs([out]))
            elif req.frontend in self.frontends:
                self._send(req.frontend, P.Outputs([self._output(req)]))

    # ------------------------------------------------------------------ steps

    def _output(self, req: Request) -> P.RequestOutput:
        """New tokens since the last output, their logprobs (aligned), and once, when the
        whole prompt is scored, the prompt logprobs ([None] for token 0, then tokens 1..)."""
        sent = req.sent_tokens
        new = req.output_token_ids[sent:]
        req.sent_tokens = len(req.output_token_ids)
        o = P.RequestOutput(req.request_id, new, req.num_prompt_tokens, req.finish_reason,
                            req.stop_token_id, num_cached_tokens=max(req.num_cached_tokens, 0))
        if req.sampling.logprobs is not None:
            o.logprobs = req.output_logprobs[sent:sent + len(new)]
        if req.wants_prompt_logprobs and len(req.prompt_logprobs) >= req.num_prompt_tokens - 1:
            o.prompt_logprobs = [None] + req.prompt_logprobs[:req.num_prompt_tokens - 1]
            req.prompt_logprobs_sent = True
            req.prompt_logprobs = []
        if req.finish_reason == "error":
            o.error_kind = "internal"
            o.error = "internal error"
        return o

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
        if self.tiers is not None:
            self.tiers.attach_to_plan(out.plan)
        self.ring.write(self.enc.encode(out.plan), msg_type="step")

    def _finish_step(self, out: SchedulerOutput) -> None:
        """Wait for a sent plan's result, apply it to the scheduler and send the outputs."""
        result = self._wait_result(out.plan.step_id)
        self.num_steps += 1
        if self.tiers is not None:
            if result.kv_store_error:
                log.warning("step %d: KV stores dropped: %s", out.plan.step_id,
                            result.kv_store_error)
            self.tiers.after_step(out.plan, not result.error and not result.kv_store_error)
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
        self.scheduler.step_id += 1
        plan = P.StepPlan(step_id=self.scheduler.step_id, seqs=[])
        self.tiers.attach_to_plan(plan)
        self.ring.write(self.enc.encode(plan), msg_type="step")
        result = self._wait_result(plan.step_id)
        if result.kv_store_error or result.error:
            log.warning("transfer step %d: KV stores dropped: %s", plan.step_id,
                        result.kv_store_error or result.error)
        self.tiers.after_step(plan, not result.error and not result.kv_store_error)

    def _emit(self, reqs: list[Request], error: str | None = None) -> None:
        by_frontend: dict[bytes, list[P.RequestOutput]] = {}
        for req in reqs:
            o = self._output(req)
            if error:
                o.error = error
                o.error_kind = "internal"
            by_frontend.setdefault(req.frontend, []).append(o)
        for ident, outs in by_frontend.items():
            if ident in self.frontends:
                self._send(ident, P.Outputs(outs))

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
            events = dict(poller.poll(0 if busy else 100))
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
    except SystemExit as e:
        log.error("%s", e.code)
        code = 2
    except Exception:
        log.exception("engine failed")
        code = 1
    finally:
        engine.shutdown(reason)
    log.info("engine stopped (exit code %d)", code)
    return code
