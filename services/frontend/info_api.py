"""The routes about the server itself: GET /v1/models, GET /v1/models/{model}, GET /health,
GET /metrics, GET /openapi.json, GET /internal/stats, POST /reset_prefix_cache, and with
--debug-utilities POST /debug/sleep and POST /debug/speculation.

Model cards follow OpenAI's `model` object, with Kestrel's `max_model_len`. /health is 200
only while the engine answers (engine_client.py says when). /metrics is Prometheus text
(metrics.py); it and /health are open without a key (auth.py). /internal/stats answers only
loopback clients. `POST /debug/sleep {"seconds": N}` (only with --debug-utilities, only
from loopback): the engine sleeps inside its next step for N seconds (a hang, for watchdog
tests). `POST /debug/speculation {"enabled": false|true}` (the same conditions): the engine
switches speculative decoding off or on (its set_speculation utility), so that a benchmark
measures both sides on one server (benchmarks/spec_serve.py --one-server).
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from services.frontend.context import ServingContext
from services.frontend.engine_client import EngineCallError, EngineUnavailable
from services.frontend.errors import NotFound, ServiceUnavailable, error_response, model_not_found
from services.frontend.guard import guard, json_response
from services.frontend.metrics import MetricsEndpoint
from services.frontend.openapi_spec import openapi_document

log = logging.getLogger("kestrel.frontend")

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _is_loopback(request: Request) -> bool:
    return (request.client.host if request.client else "") in LOOPBACK


class InfoServing:
    """The server's own routes (see the module docstring), built once from the serving
    context. runtime_dir: where the supervisor's restarts.json lives (cfg.runtime_dir; None:
    no restart counts)."""

    def __init__(self, ctx: ServingContext, runtime_dir: str | None):
        self.ctx = ctx
        self.metrics = MetricsEndpoint(ctx.engine, ctx.metrics, runtime_dir)

    def _model_card(self) -> dict[str, Any]:
        ctx = self.ctx
        return {"id": ctx.model_name, "object": "model", "created": ctx.created,
                "owned_by": "kestrel", "max_model_len": ctx.limits.max_model_len}

    async def list_models(self, request: Request) -> Response:
        """GET /v1/models: the one served model, with its max_model_len."""
        return json_response({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request) -> Response:
        """GET /v1/models/{model}: the model card, or 404 model_not_found."""
        if request.path_params["model"] != self.ctx.model_name:
            return error_response(model_not_found(request.path_params["model"]))
        return json_response(self._model_card())

    async def health(self, request: Request) -> Response:
        """GET /health: 200 when the engine answered within the last few seconds, else 503."""
        if self.ctx.engine.is_healthy():
            return json_response({"status": "ok"})
        return json_response({"status": "unavailable", "reason": "the engine is not answering"},
                             503)

    async def openapi(self, request: Request) -> Response:
        """GET /openapi.json: the OpenAPI 3.1 document (openapi_spec)."""
        return json_response(openapi_document())

    async def internal_stats(self, request: Request) -> Response:
        """GET /internal/stats: the engine's `stats` utility result (num_free_blocks, ...).
        Answers only clients on the loopback interface (404 for others); 503 when the
        engine does not answer within 10 s."""
        if not _is_loopback(request):
            return error_response(NotFound(f"No route for GET {request.url.path}."))

        async def stats() -> Response:
            try:
                return json_response(await self.ctx.engine.call_utility("stats", timeout=10.0))
            except TimeoutError:
                raise ServiceUnavailable("The engine did not answer within 10 s.") from None

        return await guard("internal-stats", stats)

    async def reset_prefix_cache(self, request: Request) -> Response:
        """POST /reset_prefix_cache: drop every cached KV block of the engine's prefix cache.

        Calls the engine's `reset_prefix_cache` utility. 200 `{"ok": true}` when done; 409
        `{"ok": false, "error": {...}}` (type `conflict`) when requests still hold blocks
        (the engine refuses; retry when idle); 503 when the engine does not answer within
        10 s.
        """
        try:
            result = await self.ctx.engine.call_utility("reset_prefix_cache", timeout=10.0)
        except (EngineUnavailable, EngineCallError, TimeoutError) as e:
            return Response(orjson.dumps({"ok": False, "error": {
                "message": f"The engine did not reset its prefix cache: {e or 'timeout'}.",
                "type": "service_unavailable", "param": None, "code": None}}),
                status_code=503, media_type="application/json")
        if result.get("ok"):
            return Response(orjson.dumps({"ok": True}), media_type="application/json")
        return Response(orjson.dumps({"ok": False, "error": {
            "message": "Requests are using KV blocks; the prefix cache was not reset. Retry "
                       "when the server is idle.", "type": "conflict", "param": None,
            "code": None}}), status_code=409, media_type="application/json")

    async def debug_sleep(self, request: Request) -> Response:
        """POST /debug/sleep {"seconds": N}: the engine's debug_sleep utility. Loopback only
        (404 otherwise). 200 {"ok": true, "seconds": N}; 400 for a bad body or refused
        call; 503 when the engine does not answer within 5 s."""
        if not _is_loopback(request):
            return Response(b'{"error": "not found"}', 404, media_type="application/json")
        try:
            secs = float(orjson.loads(await request.body())["seconds"])
        except (ValueError, KeyError, TypeError) as e:
            return Response(orjson.dumps({"error": f"body must be {{\"seconds\": N}}: {e}"}),
                            400, media_type="application/json")
        return await self._debug_call("debug_sleep", {"seconds": secs})

    async def _debug_call(self, method: str, args: dict) -> Response:
        """A debug route's engine utility call: 200 with its result, 400 for a refused call,
        503 when the engine does not answer within 5 s."""
        try:
            result = await self.ctx.engine.call_utility(method, args, timeout=5.0)
        except EngineCallError as e:
            return Response(orjson.dumps({"error": str(e)}), 400, media_type="application/json")
        except (EngineUnavailable, TimeoutError) as e:
            return Response(orjson.dumps({"error": f"engine unavailable: {e}"}), 503,
                            media_type="application/json")
        return Response(orjson.dumps(result), media_type="application/json")

    async def debug_speculation(self, request: Request) -> Response:
        """POST /debug/speculation {"enabled": true|false}: the engine's set_speculation
        utility (docs/ARCHITECTURE.md §5.5). Loopback only (404 otherwise). 200 with the
        engine's result ({"ok": true, "enabled": bool}); 400 for a bad body or a refused call
        (e.g. "no speculative config"); 503 when the engine does not answer within 5 s."""
        if not _is_loopback(request):
            return Response(b'{"error": "not found"}', 404, media_type="application/json")
        try:
            enabled = orjson.loads(await request.body())["enabled"]
            if not isinstance(enabled, bool):
                raise TypeError(f"enabled is {type(enabled).__name__}, not a boolean")
        except (ValueError, KeyError, TypeError) as e:
            return Response(orjson.dumps({"error": f"body must be {{\"enabled\": true|false}}: {e}"}),
                            400, media_type="application/json")
        return await self._debug_call("set_speculation", {"enabled": enabled})
