"""The frontend process's lifecycle: listening socket, draining shutdown, watchdog beats.

- Several frontends share one port (`--frontends N`): each binds its own socket with
  SO_REUSEPORT before uvicorn starts, and the kernel spreads connections over them.
  uvicorn only calls listen() after the ASGI lifespan (engine handshake) is done, so a
  frontend that is not ready yet gets no connections.
- Draining: on SIGTERM (or SIGINT when the frontend runs alone) `DrainingServer` marks the
  app draining. The listening socket stays open: every new request gets 503 + Retry-After
  from `DrainMiddleware` (with `Connection: close`), while the requests in flight (counted
  by the middleware) get up to cfg.shutdown_timeout seconds. When none is left, uvicorn
  shuts down. When the time is up, the requests still in flight are ended with a "server
  shutting down" error (`app.state.end_requests`, the engine client's `end_requests`: every
  request gets an error output of kind "unavailable", which each API renders its own way,
  as for any engine error: a non-streamed request gets a 503 + Retry-After in its
  envelope, a stream its error event, then `data: [DONE]` on the OpenAI routes); they get
  CUT_GRACE_S to write it, then uvicorn shuts down: it closes the listener, and cancels
  what still runs after FINAL_GRACE_S (those requests are aborted on the engine). A second
  stop signal ends the requests in flight the same way and skips the rest of the drain.
  Under a supervisor (`kestrel serve`) SIGINT is a no-op: a terminal's Ctrl-C reaches the
  whole process group, and the supervisor drains everything in order. Before the engine
  has answered (the lifespan's handshake) nothing listens and nothing is in flight: a stop
  signal ends the process at once (exit 128 + the signal), so a `kestrel serve` whose
  engine group refused its configuration stops without waiting out the frontend's grace.
- Watchdog: `beat_forever` beats the process's progress beacon from the event loop, so a
  blocked loop stops the counter and the supervisor's watchdog dumps the stacks.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time

import orjson
import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from services.frontend.header_guard import guarded_protocol
from shared.config import KestrelConfig
from shared.liveness import Beacon
from shared.procutil import exit_now, supervisor_pid

log = logging.getLogger("kestrel.frontend")

BEAT_INTERVAL_S = 0.5
DRAIN_RETRY_AFTER_S = 5
FINAL_GRACE_S = 1  # seconds (uvicorn takes an int); after the drain: for responses that are just finishing, then cancel
CUT_GRACE_S = 2.0  # seconds for the requests ended at the drain's timeout to write their error
SHUTDOWN_ERROR = "the server is shutting down"


def frontend_name(index: int) -> str:
    """The stable name of frontend `index` (its Hello's frontend_id and watchdog role). A
    restarted frontend reuses it, so the engine aborts the old one's requests at once."""
    return f"frontend-{index}"


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEADDR and SO_REUSEPORT, not listening
    (uvicorn listens once the app is ready). Raises OSError if the bind fails."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a draining phase before uvicorn's own shutdown.

    The first stop signal marks `app.state.draining` (DrainMiddleware answers 503) and
    keeps serving until no request is in flight or `drain_s` seconds have passed; only then
    does uvicorn close the listener. `ignore_sigint`: SIGINT does nothing (supervised).
    Signals are not re-raised after the server stops (uvicorn would, killing the process
    by SIGTERM), so a drained frontend exits 0. A stop signal before the server started
    (the lifespan still waits for the engine) ends the process at once, 128 + the signal.
    """

    def __init__(self, config: uvicorn.Config, app, drain_s: float, ignore_sigint: bool = False):
        super().__init__(config)
        self._app = app
        self._drain_s = drain_s
        self._ignore_sigint = ignore_sigint
        self._drain_deadline: float | None = None  # time.monotonic() at which the drain ends
        self._cut_deadline: float | None = None    # the same, for the error writes after it

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGINT and self._ignore_sigint:
            return  # the supervisor got it too, and drains us with SIGTERM
        if not self.started:
            # still in the lifespan's startup (the engine handshake, up to startup_timeout_s):
            # nothing listens yet, so nothing is in flight to drain: go now, as a loading
            # worker does (a SystemExit here would unwind the lifespan into a traceback)
            log.info("stop signal before the frontend was ready: exiting")
            exit_now(128 + sig)
        if self._drain_deadline is None:
            self._app.state.draining = True
            self._drain_deadline = time.monotonic() + self._drain_s
            log.info("stop signal: draining (new requests get 503; %d in flight have up to "
                     "%.0f s)", in_flight(self._app), self._drain_s)
        elif self.should_exit:
            self.force_exit = True
        else:
            log.info("second stop signal: stopping now")
            end_in_flight(self._app, f"{SHUTDOWN_ERROR} (stopped before its drain ended)")
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        """uvicorn calls this every 0.1 s; True stops the server. Ends the drain: at its
        timeout the requests in flight are ended with an error (module doc), and CUT_GRACE_S
        later uvicorn's shutdown cancels what is left."""
        if self._drain_deadline is not None and not self.should_exit:
            left = in_flight(self._app)
            now = time.monotonic()
            if left == 0:
                log.info("drained: no request in flight")
                self.should_exit = True
            elif self._cut_deadline is None and now >= self._drain_deadline:
                log.warning("drain time (%.0f s) is up with %d request(s) in flight: ending "
                            "them with an error", self._drain_s, left)
                end_in_flight(self._app, f"{SHUTDOWN_ERROR} (the request outlasted the "
                                         f"{self._drain_s:.0f} s drain)")
                self._cut_deadline = now + CUT_GRACE_S
            elif self._cut_deadline is not None and now >= self._cut_deadline:
                log.warning("%d request(s) still in flight %.0f s after their error: "
                            "cancelling them", left, CUT_GRACE_S)
                self.should_exit = True
        return await super().on_tick(counter)


def end_in_flight(app, reason: str) -> None:
    """End every request of `app` in flight with error `reason` through the hook its
    lifespan set (`app.state.end_requests(reason)`, the engine client's `end_requests`);
    nothing when there is none (before the startup finished)."""
    hook = getattr(app.state, "end_requests", None)
    if hook is not None:
        n = hook(reason)
        log.info("ended %s request(s) in flight: %s", n, reason)


def in_flight(app) -> int:
    """HTTP requests of `app` that are running now (not counting 503s of the drain)."""
    return getattr(app.state, "in_flight", 0)


class DrainMiddleware:
    """ASGI middleware: counts the HTTP requests in flight (app.state.in_flight), and answers
    every new one with 503 + Retry-After once the app drains."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        if getattr(state, "draining", False):
            body = orjson.dumps({"error": {"message": "The server is shutting down.",
                                           "type": "service_unavailable", "param": None,
                                           "code": None}})
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"connection", b"close"),
                (b"retry-after", str(DRAIN_RETRY_AFTER_S).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        state.in_flight = getattr(state, "in_flight", 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.in_flight -= 1


async def beat_forever(beacon: Beacon) -> None:
    """Beat `beacon` every BEAT_INTERVAL_S seconds from the event loop (cancel to stop)."""
    while True:
        beacon.beat()
        await asyncio.sleep(BEAT_INTERVAL_S)


def serve(app, cfg: KestrelConfig, index: int) -> None:
    """Run `app` under uvicorn until a stop signal, draining for up to cfg.shutdown_timeout s.

    With cfg.frontends > 1 the socket is pre-bound with SO_REUSEPORT (shared port);
    otherwise uvicorn binds cfg.host:cfg.port itself. uvicorn's HTTP protocol gets the
    header timeout and the cap on connections still sending headers (header_guard.py:
    cfg.header_timeout, cfg.max_incomplete_connections). Raises OSError if the bind fails,
    ValueError for a header timeout or cap that is not positive."""
    http = guarded_protocol(AutoHTTPProtocol, cfg.header_timeout, cfg.max_incomplete_connections)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_config=None, http=http,
                            log_level=cfg.log_level.lower(), timeout_keep_alive=30,
                            timeout_graceful_shutdown=FINAL_GRACE_S)
    server = DrainingServer(config, app, drain_s=max(float(cfg.shutdown_timeout), 0.1),
                            ignore_sigint=supervisor_pid() is not None)
    sockets = [reuseport_socket(cfg.host, cfg.port)] if cfg.frontends > 1 else None
    server.run(sockets=sockets)
    if not server.started:
        raise SystemExit(3)  # as uvicorn.run: startup failed (engine never answered)
