"""OpenAI-compatible HTTP routes: GET /v1/models, POST /v1/chat/completions, GET /health.

Response shapes follow the OpenAI API reference: `chat.completion` objects, and for
`stream: true` Server-Sent Events, each `data: <chat.completion.chunk JSON>\\n\\n`: a first
chunk per choice with the assistant role, content deltas (with `logprobs` when asked), a
chunk per choice with its finish_reason (null before), one usage chunk with `choices: []`
when stream_options.include_usage is set (and `usage` on every chunk with
stream_options.continuous_usage_stats too), then `data: [DONE]\\n\\n`. While waiting, a
comment line `: keep-alive\\n\\n` goes out every keepalive_s seconds.

A request is validated completely before the first SSE byte, and the first engine output is
awaited (up to keepalive_s) so that an engine refusal (overloaded: 503 + Retry-After,
invalid: 400) is an HTTP status too; a failure after that is sent as
`data: {"error": {...}}\\n\\n` followed by `data: [DONE]\\n\\n`. `n > 1` runs as n engine
requests (see `fanout`). The chat route itself (tools, reasoning) lives in `chat_api`,
/v1/completions in `completions_api`, /tokenize and /detokenize in `tokenize_api`.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from services.frontend.chat_features import ChatFeatures
from services.frontend.chat_template import ChatTemplate
from services.frontend.engine_client import EngineClient, EngineUnavailable
from services.frontend.errors import (APIError, InternalError, InvalidRequest, NotFound, engine_error,
                                      PayloadTooLarge, ServiceUnavailable, error_body,
                                      error_response, model_not_found)
from services.frontend.fanout import FanOut, SSEResponse, until_disconnect
from services.frontend.generation import TextDelta, generate
from services.frontend.logprobs import LogprobFormatter
from services.frontend.openai_sampling import SamplingRequest
from services.frontend.tokenizer import Tokenizer
from shared.protocol import SamplingParams

log = logging.getLogger("kestrel.frontend.openai")

SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keep-alive\n\n"
CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; nobody reads it


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def stream_items(first: tuple[int, TextDelta] | None, fan: "FanOut"
                       ) -> AsyncIterator[tuple[int, TextDelta] | bytes | None]:
    """The SSE loop's input: `first` (if any), then the items of `fan`. Yields (index,
    delta) to render; bytes to send as they are (a keep-alive comment); on a choice that
    failed, its error event and [DONE] as bytes, then None: the stream must end there."""
    async def items():
        if first is not None:
            yield first
        async for it in fan:
            yield it

    async for item in items():
        if item is None:
            yield SSE_KEEPALIVE
        elif item[1].error is not None:
            yield sse(error_body(delta_error(item[1])))
            yield SSE_DONE
            yield None
            return
        else:
            yield item


def delta_error(d: TextDelta) -> APIError:
    """The API error for a choice that ended with finish_reason "error" (`engine_error`)."""
    return engine_error(d.error, d.error_kind)


def context_error(param: str, max_model_len: int, n_prompt: int, max_tokens: int | None,
                  what: str) -> InvalidRequest:
    """The 400 for a prompt (+ max_tokens) that does not fit in max_model_len tokens."""
    asked = (f"{n_prompt + max_tokens} tokens ({n_prompt} in the {what}, {max_tokens} in "
             "the completion)" if max_tokens else f"{n_prompt} tokens in the {what}")
    return InvalidRequest(param, f"This model's maximum context length is {max_model_len} "
                          f"tokens. However, you requested {asked}. Please reduce the length "
                          f"of the {what} or completion.", code="context_length_exceeded")


class Collected:
    """Everything one choice produced (non-streaming)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.logprobs: list = []
        self.prompt_logprobs: list = []
        self.final: TextDelta | None = None

    def add(self, d: TextDelta) -> None:
        """Take one delta of this choice (the final one included)."""
        self.parts.append(d.text)
        self.logprobs.extend(d.logprobs)
        if d.prompt_logprobs:
            self.prompt_logprobs = d.prompt_logprobs

    @property
    def text(self) -> str:
        return "".join(self.parts)


class OpenAIServing:
    """The OpenAI routes of one frontend.

    model_name: the served model name (requests must name it). max_model_len: tokens of
    prompt + completion. template: the model's chat template, None if it has none (chat
    requests then fail with 500). keepalive_s: seconds between SSE keep-alive comments.
    max_body_bytes: request bodies above it get 413. features: the tool-call and reasoning
    parsers of chat requests (default: none). max_choices: engine requests one HTTP request
    may open (prompts x n; the engine's waiting-queue bound), 0 for no bound.
    """

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, template: ChatTemplate | None,
                 model_name: str, max_model_len: int, keepalive_s: float,
                 max_body_bytes: int = 8 << 20, features: ChatFeatures | None = None,
                 max_choices: int = 0):
        self.engine = engine
        self.features = features or ChatFeatures()
        self.tokenizer = tokenizer
        self.template = template
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.keepalive_s = keepalive_s
        self.max_body_bytes = max_body_bytes
        self.max_choices = max_choices
        self.created = int(time.time())
        self.lp = LogprobFormatter(tokenizer)

    # ------------------------------------------------------------ simple routes

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "kestrel", "max_model_len": self.max_model_len}

    async def list_models(self, request: Request) -> Response:
        """GET /v1/models: the one served model, with its max_model_len."""
        return json_response({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request) -> Response:
        """GET /v1/models/{model}: the model card, or 404 model_not_found."""
        if request.path_params["model"] != self.model_name:
            return error_response(model_not_found(request.path_params["model"]))
        return json_response(self._model_card())

    async def health(self, request: Request) -> Response:
        """GET /health: 200 when the engine answered within the last few seconds, else 503."""
        if self.engine.is_healthy():
            return json_response({"status": "ok"})
        return json_response({"status": "unavailable", "reason": "the engine is not answering"},
                             503)

    async def internal_stats(self, request: Request) -> Response:
        """GET /internal/stats: the engine's `stats` utility result (num_free_blocks, ...).
        Answers only clients on the loopback interface (404 for others)."""
        host = request.client.host if request.client else ""
        if host not in ("127.0.0.1", "::1", "localhost"):
            return error_response(NotFound(f"No route for GET {request.url.path}."))

        async def stats() -> Response:
            try:
                return json_response(await self.engine.call_utility("stats", timeout=10.0))
            except TimeoutError:
                raise ServiceUnavailable("The engine did not answer within 10 s.") from None

        return await self.guard("internal-stats", stats)

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions (completions_api.CompletionsServing)."""
        # Imported here: completions_api builds on this module's helpers.
        from services.frontend.completions_api import CompletionsServing
        return await CompletionsServing(self).completions(request)

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize (tokenize_api.TokenizeServing)."""
        from services.frontend.tokenize_api import TokenizeServing
        return await TokenizeServing(self).tokenize(request)

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize (tokenize_api.TokenizeServing)."""
        from services.frontend.tokenize_api import TokenizeServing
        return await TokenizeServing(self).detokenize(request)

    async def openapi(self, request: Request) -> Response:
        """GET /openapi.json: the OpenAPI 3.1 document (openapi_spec)."""
        from services.frontend.openapi_spec import openapi_document
        return json_response(openapi_document())

    # ------------------------------------------------------------ shared machinery

    async def read_body(self, request: Request) -> bytes:
        """The request body; raises PayloadTooLarge (413) past max_body_bytes, checked on
        Content-Length and on the bytes actually received."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"The request body ({declared} bytes) exceeds the limit of "
                                  f"{limit} bytes.")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"The request body exceeds the limit of {limit} bytes.")
            chunks.append(chunk)
        return b"".join(chunks)

    def check_choices(self, count: int, param: str) -> None:
        """Raise InvalidRequest(param) (400) when one request would open more than
        max_choices engine requests: the engine's waiting queue could never take it whole,
        so it would get 503 + Retry-After on every retry."""
        if self.max_choices and count > self.max_choices:
            raise InvalidRequest(param, f"this request needs {count} sequences (prompts x n), more than the "
                                        f"server queues at once ({self.max_choices}, --max-num-waiting); "
                                        "send it in smaller batches")

    def fan_out(self, request_id: str, choices: list[tuple[list[int], SamplingParams]],
                sampling: SamplingRequest,
                wrap: Callable[[int, AsyncIterator], AsyncIterator] | None = None,
                stop: list[str] | None = None) -> FanOut:
        """Open one engine request per choice (ids `<request_id>-<index>` when several) and
        merge their text deltas. wrap(index, deltas): an iterator to merge instead of the
        choice's `generate` (the chat route's output parsers). stop: the stop strings for
        `generate` (default sampling.stop). Raises EngineUnavailable (aborting those
        already opened)."""
        gens, opened = [], []
        stop = sampling.stop if stop is None else stop
        try:
            for i, (prompt_ids, params) in enumerate(choices):
                rid = request_id if len(choices) == 1 else f"{request_id}-{i}"
                # no stop strings (sampling.stop, also when an output parser checks them):
                # queued outputs may merge into one chunk under load
                stream = self.engine.open_request(rid, prompt_ids, params, merge=not sampling.stop)
                opened.append(rid)
                # one streamed choice ticks by itself (FanOut iterates it directly)
                tick = self.keepalive_s if sampling.stream and len(choices) == 1 else None
                gen = generate(self.engine, self.tokenizer, stream, prompt_ids, stop,
                               sampling.skip_special_tokens, tick_s=tick)
                gens.append(wrap(i, gen) if wrap is not None else gen)
        except EngineUnavailable:
            for rid in opened:
                self.engine.abort(rid)
            raise
        return FanOut(gens, self.keepalive_s if sampling.stream else None)

    async def guard(self, request_id: str, handler: Callable[[], Awaitable[Response]]
                    ) -> Response:
        """Run a route handler; map APIError / EngineUnavailable / faults to responses."""
        try:
            return await handler()
        except APIError as e:
            if e.status >= 500:
                log.error("%s failed: %s", request_id, e.message)
            else:
                log.info("%s rejected (%d, %s): %s", request_id, e.status, e.param, e.message)
            return error_response(e)
        except EngineUnavailable as e:
            log.warning("%s refused: %s", request_id, e)
            return error_response(ServiceUnavailable(f"The engine is unavailable: {e}."))
        except ClientDisconnect:
            log.info("%s: client disconnected while sending the body", request_id)
            return Response(status_code=CLIENT_CLOSED)
        except Exception:
            log.exception("%s failed with an internal error", request_id)
            return error_response(InternalError(f"Internal error (request {request_id})."))

    async def collect(self, request: Request, request_id: str, fan: FanOut, n: int,
                      make: Callable[[], Collected] = Collected) -> list[Collected] | None:
        """Run every choice to its end (non-streaming), gathering each in a `make()`. None
        when the client went away (the requests are then aborted). Raises the APIError of a
        failed choice."""

        async def run() -> list[Collected]:
            res = [make() for _ in range(n)]
            async for item in fan:
                if item is None:
                    continue
                i, d = item
                c = res[i]
                c.add(d)
                if d.finish_reason is not None:
                    c.final = d
                    if d.error is not None:
                        raise delta_error(d)
            return res

        try:
            done, res = await until_disconnect(request, run())
        finally:
            await fan.aclose()
        if not done:
            log.info("%s: client disconnected", request_id)
            return None
        return res  # type: ignore[return-value]

    async def stream(self, request: Request, request_id: str, fan: FanOut,
                     events: Callable[[tuple[int, TextDelta] | None, FanOut],
                                      AsyncIterator[bytes]]) -> Response:
        """Start an SSE response once the first output (or keepalive_s of silence) is in:
        an engine refusal on the first output is still an HTTP error status. `events` turns
        the first item and the rest of `fan` into SSE bytes (it ends with [DONE])."""
        try:
            done, first = await until_disconnect(request, fan.next(self.keepalive_s))
        except StopAsyncIteration:
            done, first = True, None
        except BaseException:
            await fan.aclose()
            raise
        if not done:
            await fan.aclose()
            log.info("%s: client disconnected before the first chunk", request_id)
            return Response(status_code=CLIENT_CLOSED)
        if first is not None and first[1].error is not None:
            await fan.aclose()
            raise delta_error(first[1])

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in events(first, fan):  # type: ignore[arg-type]
                    yield chunk
            except Exception:
                log.exception("%s failed while streaming", request_id)
                yield sse(error_body(InternalError(f"Internal error (request {request_id}).")))
                yield SSE_DONE
            finally:
                await fan.aclose()

        return SSEResponse(body())

    # ------------------------------------------------------------ chat completions

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions (chat_api.ChatServing)."""
        # Imported here: chat_api builds on this module's helpers.
        from services.frontend.chat_api import ChatServing
        return await ChatServing(self).chat_completions(request)
