"""The frontend process's lifecycle: listening socket, draining shutdown, watchdog beats,
debug routes.

- Several frontends share one port (`--frontends N`): each binds its own socket with
  SO_REUSEPORT before uvicorn starts, and the kernel spreads connections over them.
  uvicorn only calls listen() after the ASGI lifespan (engine handshake) is done, so a
  frontend that is not ready yet gets no connections.
- Draining: on SIGTERM/SIGINT `DrainingServer` marks the app draining. uvicorn stops
  accepting connections and waits up to cfg.shutdown_timeout seconds for requests in flight,
  then cancels them (their requests are aborted on the engine); a request that still reaches
  the app meanwhile (keep-alive connection) gets 503 + Retry-After from `DrainMiddleware`.
- Watchdog: `beat_forever` beats the process's progress beacon from the event loop, so a
  blocked loop stops the counter and the supervisor's watchdog dumps the stacks.
- `POST /debug/sleep {"seconds": N}`: only with --debug-utilities, only from loopback: the
  engine sleeps inside its next step for N seconds (a hang, for watchdog tests).
"""

from __future__ import annotations

import asyncio
import logging
import socket

import orjson
import uvicorn
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from services.frontend.engine_client import EngineCallError, EngineUnavailable
from shared.config import KestrelConfig
from shared.liveness import Beacon

log = logging.getLogger("kestrel.frontend")

BEAT_INTERVAL_S = 0.5
DRAIN_RETRY_AFTER_S = 5
LOOPBACK = ("127.0.0.1", "::1", "localhost")


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
    """uvicorn's server that marks `app.state.draining` when a stop signal arrives."""

    def __init__(self, config: uvicorn.Config, app):
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig, frame) -> None:
        if not getattr(self._app.state, "draining", False):
            self._app.state.draining = True
            log.info("stop signal: draining (new requests get 503; in-flight requests have "
                     "up to %s s)", self.config.timeout_graceful_shutdown)
        super().handle_exit(sig, frame)


class DrainMiddleware:
    """ASGI middleware: every HTTP request gets 503 + Retry-After once the app drains."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and getattr(scope["app"].state, "draining", False):
            body = orjson.dumps({"error": {"message": "The server is shutting down.",
                                           "type": "service_unavailable", "param": None,
                                           "code": None}})
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"connection", b"close"),
                (b"retry-after", str(DRAIN_RETRY_AFTER_S).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


async def beat_forever(beacon: Beacon) -> None:
    """Beat `beacon` every BEAT_INTERVAL_S seconds from the event loop (cancel to stop)."""
    while True:
        beacon.beat()
        await asyncio.sleep(BEAT_INTERVAL_S)


async def _debug_sleep(request: Request) -> Response:
    """POST /debug/sleep {"seconds": N}: the engine's debug_sleep utility. Loopback only
    (404 otherwise). 200 {"ok": true, "seconds": N}; 400 for a bad body or refused call;
    503 when the engine does not answer."""
    if (request.client.host if request.client else "") not in LOOPBACK:
        return Response(b'{"error": "not found"}', 404, media_type="application/json")
    try:
        secs = float(orjson.loads(await request.body())["seconds"])
    except (ValueError, KeyError, TypeError) as e:
        return Response(orjson.dumps({"error": f"body must be {{\"seconds\": N}}: {e}"}), 400,
                        media_type="application/json")
    engine = request.app.state.serving.engine
    try:
        result = await engine.call_utility("debug_sleep", {"seconds": secs}, timeout=5.0)
    except EngineCallError as e:
        return Response(orjson.dumps({"error": str(e)}), 400, media_type="application/json")
    except (EngineUnavailable, TimeoutError) as e:
        return Response(orjson.dumps({"error": f"engine unavailable: {e}"}), 503,
                        media_type="application/json")
    return Response(orjson.dumps(result), media_type="application/json")


def debug_routes(cfg: KestrelConfig) -> list[Route]:
    """The debug-only routes: none unless cfg.debug_utilities."""
    if not cfg.debug_utilities:
        return []
    return [Route("/debug/sleep", _debug_sleep, methods=["POST"])]


def serve(app, cfg: KestrelConfig, index: int) -> None:
    """Run `app` under uvicorn until a stop signal, draining for cfg.shutdown_timeout s.

    With cfg.frontends > 1 the socket is pre-bound with SO_REUSEPORT (shared port);
    otherwise uvicorn binds cfg.host:cfg.port itself. Raises OSError if the bind fails."""
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_config=None,
                            log_level=cfg.log_level.lower(), timeout_keep_alive=30,
                            timeout_graceful_shutdown=max(float(cfg.shutdown_timeout), 0.1))
    server = DrainingServer(config, app)
    sockets = [reuseport_socket(cfg.host, cfg.port)] if cfg.frontends > 1 else None
    server.run(sockets=sockets)
    if not server.started:
        raise SystemExit(3)  # as uvicorn.run: startup failed (engine never answered)
