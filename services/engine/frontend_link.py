"""The engine's side of its frontends: their messages, their liveness, the outputs sent.

docs/ARCHITECTURE.md §2, §7. `FrontendLink` dispatches each decoded `FrontendToEngine`
message (Hello, AddRequest, Abort, UtilityCall, Heartbeat, and anything from an identity
that never said Hello), keeps each attached frontend's last sign of life (one silent for
FRONTEND_TIMEOUT_S is dropped: its requests are aborted), answers utility calls, and sends
the engine core's `Emitted` outputs. It owns no socket: it sends through the `send`
callable the engine process gives it (the ROUTER socket's send), so tests drive it directly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.engine.core import EngineCore
from services.engine.outputs import Emitted, refusal
from shared import protocol as P
from shared.config import KestrelConfig

log = logging.getLogger("kestrel.engine")

FRONTEND_TIMEOUT_S = 5.0  # a frontend silent this long is dead: its requests are aborted
DEBUG_SLEEP_MAX_S = 600.0

Send = Callable[[bytes, P.EngineToFrontend], None]  # (frontend identity, message); never raises


@dataclass
class FrontendState:
    """An attached frontend: its name (Hello.frontend_id) and when it was last heard from
    (time.monotonic() seconds)."""

    name: str
    last_seen: float


class FrontendLink:
    """Frontend messages in, outputs out, liveness (module doc).

    core: the engine core. send: delivers one message to one identity. cfg: the settings
    (served_model_name, block_size, max_num_waiting, debug_utilities). engine_id: this
    engine's id in EngineInfo (a restarted engine has a new one).
    frontends: attached identities -> state. debug_sleep_s: seconds the engine loop must
    sleep at its next turn (the debug_sleep utility), 0 when none.
    """

    def __init__(self, core: EngineCore, send: Send, cfg: KestrelConfig, engine_id: str):
        self.core = core
        self.send = send
        self.cfg = cfg
        self.engine_id = engine_id
        self.frontends: dict[bytes, FrontendState] = {}
        self.debug_sleep_s = 0.0

    # ------------------------------------------------------------------ messages in

    def on_message(self, ident: bytes, msg: P.FrontendToEngine) -> None:
        """Handle one message from `ident`. Aborts are queued (`apply_aborts` applies them)."""
        fe = self.frontends.get(ident)
        if fe is not None:
            fe.last_seen = time.monotonic()
        if isinstance(msg, P.Hello):
            self._on_hello(ident, msg)
        elif fe is None:
            self.on_unknown(ident, msg)
        elif isinstance(msg, P.AddRequest):
            self.deliver(self.core.add(ident, msg))
        elif isinstance(msg, P.Abort):
            self.core.abort(msg.request_ids)
        elif isinstance(msg, P.UtilityCall):
            self.send(ident, self.utility(msg))
        elif isinstance(msg, P.Heartbeat):
            # progress/busy let the frontend tell a stuck engine from an idle one
            self.send(ident, P.Heartbeat(time.time(), progress=self.core.num_steps,
                                         busy=self.core.has_requests_to_run()))

    def on_unknown(self, ident: bytes, msg: P.FrontendToEngine) -> None:
        """A message from an identity without a Hello (dropped after a silence, or sent to
        an earlier engine): refuse what needs an answer, and tell it to say Hello again."""
        reason = "this frontend is not attached to the engine (dropped or engine restarted)"
        log.warning("%s from unknown frontend %r: asking it to re-attach", type(msg).__name__,
                    ident)
        if isinstance(msg, P.AddRequest):
            self.send(ident, P.Outputs([refusal(msg, P.ErrorKind.OVERLOADED, reason)]))
        elif isinstance(msg, P.UtilityCall):
            self.send(ident, P.UtilityResult(msg.call_id, error=reason))
        self.send(ident, P.NotAttached(reason))

    def _on_hello(self, ident: bytes, msg: P.Hello) -> None:
        for old_ident, fe in list(self.frontends.items()):
            if fe.name == msg.frontend_id and old_ident != ident:
                log.info("frontend %s reconnected with a new identity: aborting its old requests",
                         msg.frontend_id)
                self.drop(old_ident, "the frontend reconnected with a new identity")
        known = ident in self.frontends  # a repeated hello (the frontend saw us silent)
        self.frontends[ident] = FrontendState(msg.frontend_id, time.monotonic())
        (log.debug if known else log.info)("frontend %s (pid %d) attached", msg.frontend_id,
                                           msg.pid)
        core = self.core
        self.send(ident, P.EngineInfo(
            engine_id=self.engine_id, model_name=self.cfg.served_model_name,
            model_path=core.info.path, max_model_len=core.max_model_len,
            block_size=self.cfg.block_size, num_blocks=core.num_blocks,
            eos_token_ids=list(core.info.eos_token_ids), max_num_waiting=self.cfg.max_num_waiting))

    def utility(self, msg: P.UtilityCall) -> P.UtilityResult:
        """Answer a utility call: stats/ping, debug_sleep and set_speculation (with
        --debug-utilities), reset_prefix_cache; an unknown method is an error result."""
        if msg.method in ("stats", "ping"):
            return P.UtilityResult(msg.call_id, {**self.core.stats(),
                                                 "num_frontends": len(self.frontends)})
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
        if msg.method == "set_speculation":
            return self._set_speculation(msg)
        if msg.method == "reset_prefix_cache":
            ok = self.core.reset_prefix_cache()  # False while any block is in use
            log.info("reset_prefix_cache: %s", "done" if ok else "refused, blocks in use")
            return P.UtilityResult(msg.call_id, {"ok": ok})
        return P.UtilityResult(msg.call_id, error=f"unknown utility method {msg.method!r}")

    def _set_speculation(self, msg: P.UtilityCall) -> P.UtilityResult:
        """set_speculation {"enabled": bool}, debug only (--debug-utilities): speculation
        switched off or on at runtime (`SpecPolicy.set_enabled`, docs/ARCHITECTURE.md §5.5),
        so that a benchmark measures both sides on one server (benchmarks/spec_serve.py
        --one-server). Error results: debug utilities off, no speculative config, `enabled`
        not a boolean. Result {"ok": true, "enabled": bool}."""
        if not self.cfg.debug_utilities:
            return P.UtilityResult(msg.call_id, error="debug utilities are off (start with --debug-utilities)")
        spec = self.core.spec
        if spec is None:
            return P.UtilityResult(msg.call_id, error="no speculative config")
        enabled = msg.args.get("enabled")
        if not isinstance(enabled, bool):
            return P.UtilityResult(msg.call_id, error="enabled must be true or false")
        spec.set_enabled(enabled)
        log.warning("set_speculation: speculation switched %s", "on" if enabled else "off")
        return P.UtilityResult(msg.call_id, {"ok": True, "enabled": enabled})

    # ------------------------------------------------------------------ liveness

    def drop(self, ident: bytes, why: str) -> None:
        """Forget a frontend and queue the abort of its requests. Each aborted request's
        last output (finish_reason "abort", error `why`) is still sent to that identity: if
        the frontend is alive after all (its loop was blocked), its clients get an error,
        not a stream that never ends."""
        self.frontends.pop(ident, None)
        self.core.drop_frontend(ident, why)

    def check_frontends(self) -> None:
        """Drop the frontends silent for more than FRONTEND_TIMEOUT_S."""
        now = time.monotonic()
        for ident, fe in list(self.frontends.items()):
            silent = now - fe.last_seen
            if silent > FRONTEND_TIMEOUT_S:
                log.warning("frontend %s silent for %.1f s: aborting its requests", fe.name,
                            silent)
                self.drop(ident, f"the engine dropped this frontend after {silent:.0f} s of silence")

    # ------------------------------------------------------------------ outputs out

    def deliver(self, em: Emitted | None) -> None:
        """Send a verb's outputs: one `Outputs` per attached frontend, then the outputs sent
        whatever the frontend's state."""
        if em is None:
            return
        for ident, outs in em.attached.items():
            if ident in self.frontends:
                self.send(ident, P.Outputs(outs))
        for ident, out in em.anyway:
            self.send(ident, P.Outputs([out]))

    def apply_aborts(self) -> None:
        """Apply the queued aborts and send their outputs."""
        if self.core.pending_aborts:
            self.deliver(self.core.apply_aborts())

    def admit_compiled(self) -> None:
        """Admit the requests whose grammar compiled (those of attached frontends)."""
        self.deliver(self.core.admit_compiled(self.frontends))
