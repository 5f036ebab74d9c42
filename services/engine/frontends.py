"""The engine's frontend side: the ROUTER socket's messages in, the request outputs out.

`FrontendLink` owns what the engine does with `FrontendToEngine` messages (Hello, AddRequest
and its validation, Abort, UtilityCall, Heartbeat, and anything from an identity that never
said Hello), the liveness of each frontend (`FRONTEND_TIMEOUT_S`), the aborts queued for
after a step, and the `RequestOutput`s sent back (`_output`, `_emit`).

It is a mixin of `services.engine.core.EngineCore` and keeps no state of its own beyond
the requests whose grammar is compiling (`_compiling`, made on first use): a new grammar is
compiled by a thread, so that a schema that takes seconds does not stall the loop (and every
other request with it); the request joins the scheduler when it is ready.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zmq

from services.engine.request import Request
from services.engine.structured import GrammarError, RequestGrammar
from shared import protocol as P
from shared.zmq_utils import safe_decode

log = logging.getLogger("kestrel.engine")

FRONTEND_TIMEOUT_S = 5.0  # a frontend silent this long is dead: its requests are aborted
COMPILE_THREADS = 2  # threads that compile new grammars off the engine loop
DEBUG_SLEEP_MAX_S = 600.0


@dataclass
class FrontendState:
    name: str
    last_seen: float


class FrontendLink:
    """The frontend half of `EngineCore`: frontend messages, frontend liveness, aborts and
    outputs.

    Expects from the class that mixes it in (set by `EngineCore.__init__` / `start`):
    router (the ROUTER socket), enc, dec_frontend, frontends (ident -> FrontendState),
    pending_aborts, scheduler, cfg, info, max_model_len, engine_id, rng, num_steps,
    debug_sleep_s (written by the debug_sleep utility), tiers (None when off), and the
    method `structured()` (the grammar compiler).
    """

    # request id -> (future of its compiled grammar, frontend identity, AddRequest), while the
    # grammar compiles (None until the first compile; `_finish_compiles` empties it)
    _compiling: dict | None = None
    _compile_jobs: dict | None = None  # (kind, spec) -> the future of its compiled grammar
    _compile_pool: ThreadPoolExecutor | None = None

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
            eos_token_ids=list(self.info.eos_token_ids), max_num_waiting=self.cfg.max_num_waiting))

    def _validate(self, msg: P.AddRequest) -> str | None:
        """Why an AddRequest is invalid (the client's fault), or None."""
        sp = msg.sampling
        n = len(msg.prompt_token_ids)
        vocab = self.info.vocab_size
        if n == 0:
            return "empty prompt"
        if n + sp.max_tokens > self.max_model_len:  # max_tokens 0 (scoring) may fill the context
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
        # what the worker turns into int64 / fp32 tensors: a value it cannot hold would fail
        # the whole step (every request in it), not just this one
        if not 0 <= sp.top_k < 2 ** 31:
            return "top_k must be in 0..2147483647 (0: off)"
        if sp.seed is not None and not -2 ** 63 <= sp.seed < 2 ** 63:
            return "seed must fit in 64 bits"
        finite = (sp.temperature, sp.top_p, sp.min_p, sp.presence_penalty, sp.frequency_penalty,
                  sp.repetition_penalty, *sp.logit_bias.values())
        if not all(math.isfinite(v) for v in finite):
            return "sampling parameters must be finite numbers"
        if sp.temperature < 0 or not 0 < sp.top_p <= 1 or not 0 <= sp.min_p <= 1:
            return "temperature must be >= 0, top_p in (0, 1] and min_p in [0, 1]"
        if msg.request_id in self.scheduler.requests or msg.request_id in (self._compiling or {}):
            return "duplicate request id"
        return None

    def _on_add(self, ident: bytes, msg: P.AddRequest) -> None:
        """Validate and admit a request. One whose grammar is not compiled yet waits in
        `_compiling` while a thread compiles it (`_finish_compiles` admits it)."""
        sp = msg.sampling
        kind, error = "invalid", self._validate(msg)
        waiting = len(self.scheduler.waiting) + len(self._compiling or {})
        if error is None and waiting >= self.cfg.max_num_waiting:
            kind, error = "overloaded", f"waiting queue full ({self.cfg.max_num_waiting} requests)"
        grammar = None
        if error is None and sp.structured is not None:
            try:
                mgr = self.structured()
                grammar = mgr.cached_grammar_for(sp.structured)
                if grammar is None:  # compiled off the loop: a big schema takes seconds
                    self._compiling_add(ident, msg, mgr)
                    return
            except Exception as e:  # no tokenizer.json, xgrammar fault: not the client's fault
                log.exception("request %s: structured output unavailable", msg.request_id)
                kind, error = "internal", f"structured output unavailable: {e}"
        if error:
            self._refuse(ident, msg, kind, error)
            return
        self._admit(ident, msg, grammar)

    def _refuse(self, ident: bytes, msg: P.AddRequest, kind: str, error: str) -> None:
        self._send(ident, P.Outputs([P.RequestOutput(msg.request_id, [], len(msg.prompt_token_ids), "error",
                                                     error=error, error_kind=kind)]))

    def _admit(self, ident: bytes, msg: P.AddRequest, grammar) -> None:
        sp = msg.sampling
        if sp.seed is None:
            sp.seed = self.rng.getrandbits(63)
        req = Request(msg.request_id, ident, msg.prompt_token_ids, sp, msg.arrival_time)
        req.grammar = grammar
        self.scheduler.add(req)

    def _compiling_add(self, ident: bytes, msg: P.AddRequest, mgr) -> None:
        """Park msg until its grammar compiles in a thread; requests with the same spec share
        one compile."""
        if self._compiling is None:
            self._compiling, self._compile_jobs = {}, {}
            self._compile_pool = ThreadPoolExecutor(COMPILE_THREADS, "xgrammar-compile")
        spec = msg.sampling.structured
        key = (spec.kind, spec.spec)
        fut = self._compile_jobs.get(key)
        if fut is None or fut.done():
            fut = self._compile_jobs[key] = self._compile_pool.submit(mgr.compile, spec)
        self._compiling[msg.request_id] = (fut, ident, msg)

    def _finish_compiles(self) -> None:
        """Admit the requests whose grammar compiled, refuse those whose grammar failed
        (GrammarError: "invalid"; anything else: "internal"). A request whose frontend was
        dropped meanwhile is forgotten (its abort went out with the others)."""
        for rid, (fut, ident, msg) in list((self._compiling or {}).items()):
            if not fut.done():
                continue
            del self._compiling[rid]
            if ident not in self.frontends:
                continue
            try:
                grammar = RequestGrammar(fut.result(), self.info.vocab_size)
            except GrammarError as e:
                self._refuse(ident, msg, "invalid", str(e))
                continue
            except Exception as e:
                log.error("request %s: grammar compile failed: %r", rid, e)
                self._refuse(ident, msg, "internal", f"structured output unavailable: {e}")
                continue
            self._admit(ident, msg, grammar)
        for key, fut in list((self._compile_jobs or {}).items()):
            if fut.done():
                del self._compile_jobs[key]

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
        for rid, (_, owner, _) in (self._compiling or {}).items():
            if owner == ident:
                self.pending_aborts.append((rid, "abort", why))

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
                compiling = (self._compiling or {}).pop(rid, None)
                if compiling is not None:  # its grammar is still compiling: it never ran
                    _, ident, msg = compiling
                    self._send(ident, P.Outputs([P.RequestOutput(
                        rid, [], len(msg.prompt_token_ids), reason, error=error,
                        error_kind="internal" if error is not None else None)]))
                continue
            self.scheduler.finish(req, reason)
            if error is not None:
                out = self._output(req)
                out.error, out.error_kind = error, "internal"
                self._send(req.frontend, P.Outputs([out]))
            elif req.frontend in self.frontends:
                self._send(req.frontend, P.Outputs([self._output(req)]))

    # ------------------------------------------------------------------ outputs

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
