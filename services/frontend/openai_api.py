"""OpenAI-compatible HTTP routes: GET /v1/models, POST /v1/chat/completions, GET /health.

Response shapes follow the OpenAI API reference: `chat.completion` objects, and for
`stream: true` Server-Sent Events, each `data: <chat.completion.chunk JSON>\\n\\n`: a first
chunk per choice with the assistant role, content deltas (with `logprobs` when asked), a
chunk per choice with its finish_reason (null before), one usage chunk with `choices: []`
when stream_options.include_usage is set, then `data: [DONE]\\n\\n`. While waiting, a comment
line `: keep-alive\\n\\n` goes out every keepalive_s seconds.

A request is validated completely before the first SSE byte, and the first engine output is
awaited (up to keepalive_s) so that an engine refusal (overloaded: 503 + Retry-After,
invalid: 400) is an HTTP status too; a failure after that is sent as
`data: {"error": {...}}\\n\\n` followed by `data: [DONE]\\n\\n`. `n > 1` runs as n engine
requests (see `fanout`). /v1/completions lives in `completions_api`, /tokenize and
/detokenize in `tokenize_api`.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from services.frontend.chat_template import ChatTemplate
from services.frontend.engine_client import EngineClient, EngineUnavailable
from services.frontend.errors import (APIError, InternalError, InvalidRequest, NotFound, Overloaded,
                                      PayloadTooLarge, ServiceUnavailable, error_body,
                                      error_response, model_not_found)
from services.frontend.fanout import FanOut, SSEResponse, until_disconnect
from services.frontend.generation import TextDelta, generate
from services.frontend.logprobs import LogprobFormatter
from services.frontend.openai_protocol import ChatCompletionRequest, parse_chat_request
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


def delta_error(d: TextDelta) -> APIError:
    """The API error for a choice that ended with finish_reason "error"."""
    if d.error_kind == "overloaded":
        return Overloaded(f"The server is overloaded ({d.error}); retry later.")
    if d.error_kind == "invalid":
        return InvalidRequest(None, f"The engine rejected the request: {d.error}")
    return InternalError(f"The request failed: {d.error}")


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

    @property
    def text(self) -> str:
        return "".join(self.parts)


class OpenAIServing:
    """The OpenAI routes of one frontend.

    model_name: the served model name (requests must name it). max_model_len: tokens of
    prompt + completion. template: the model's chat template, None if it has none (chat
    requests then fail with 500). keepalive_s: seconds between SSE keep-alive comments.
    max_body_bytes: request bodies above it get 413.
    """

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, template: ChatTemplate | None,
                 model_name: str, max_model_len: int, keepalive_s: float,
                 max_body_bytes: int = 8 << 20):
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = template
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.keepalive_s = keepalive_s
        self.max_body_bytes = max_body_bytes
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

    def fan_out(self, request_id: str, choices: list[tuple[list[int], SamplingParams]],
                sampling: SamplingRequest) -> FanOut:
        """Open one engine request per choice (ids `<request_id>-<index>` when several) and
        merge their text deltas. Raises EngineUnavailable (aborting those already opened)."""
        gens, opened = [], []
        try:
            for i, (prompt_ids, params) in enumerate(choices):
                rid = request_id if len(choices) == 1 else f"{request_id}-{i}"
                stream = self.engine.open_request(rid, prompt_ids, params)
                opened.append(rid)
                gens.append(generate(self.engine, self.tokenizer, stream, prompt_ids,
                                     sampling.stop, sampling.skip_special_tokens))
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

    async def collect(self, request: Request, request_id: str, fan: FanOut,
                      n: int) -> list[Collected] | None:
        """Run every choice to its end (non-streaming). None when the client went away
        (the requests are then aborted). Raises the APIError of a failed choice."""

        async def run() -> list[Collected]:
            res = [Collected() for _ in range(n)]
            async for item in fan:
                if item is None:
                    continue
                i, d = item
                c = res[i]
                c.parts.append(d.text)
                c.logprobs.extend(d.logprobs)
                if d.prompt_logprobs:
                    c.prompt_logprobs = d.prompt_logprobs
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

    def _chat_prompt(self, req: ChatCompletionRequest) -> tuple[list[int], int]:
        """Prompt token ids and the max_tokens to send; raises APIError."""
        if req.model != self.model_name:
            raise model_not_found(req.model)
        if self.template is None:
            raise InternalError("The model has no chat template.")
        prompt = self.template.render(req.messages, add_generation_prompt=True,
                                      **req.chat_template_kwargs)
        prompt_ids = self.tokenizer.encode(prompt)
        n, max_tokens = len(prompt_ids), req.sampling.max_tokens
        room = self.max_model_len - n
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise context_error("messages", self.max_model_len, n, max_tokens, "messages")
        return prompt_ids, max_tokens if max_tokens is not None else room

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions (OpenAI Chat Completions, streaming and not).

        Errors: 400 invalid JSON / fields / too long, 404 unknown model, 413 body too large,
        503 engine not answering or overloaded (Retry-After), 500 internal faults."""
        request_id = f"chatcmpl-{uuid.uuid4().hex}"

        async def handle() -> Response:
            req = parse_chat_request(await self.read_body(request), self.tokenizer.vocab_size)
            prompt_ids, max_tokens = self._chat_prompt(req)
            s = req.sampling
            fan = self.fan_out(request_id, [
                (prompt_ids, s.to_params(max_tokens, i, logprobs=req.logprobs))
                for i in range(s.n)], s)
            log.info("%s added: %d prompt tokens, n %d, max_tokens %d, stream %s", request_id,
                     len(prompt_ids), s.n, max_tokens, s.stream)
            if s.stream:
                return await self.stream(request, request_id, fan,
                                         lambda first, f: self._chat_events(
                                             request_id, req, first, f))
            res = await self.collect(request, request_id, fan, s.n)
            if res is None:
                return Response(status_code=CLIENT_CLOSED)
            return json_response(self._chat_body(request_id, req, res, len(prompt_ids)))

        return await self.guard(request_id, handle)

    def _chat_logprobs(self, req: ChatCompletionRequest, lps: list) -> dict | None:
        if req.logprobs is None:
            return None
        return {"content": self.lp.chat_content(lps, req.logprobs)}

    def _chat_body(self, request_id: str, req: ChatCompletionRequest, res: list[Collected],
                   n_prompt: int) -> dict[str, Any]:
        completion = sum(c.final.completion_tokens for c in res if c.final)
        return {
            "id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                         "logprobs": self._chat_logprobs(req, c.logprobs),
                         "finish_reason": c.final.finish_reason if c.final else None}
                        for i, c in enumerate(res)],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": completion,
                      "total_tokens": n_prompt + completion}}

    async def _chat_events(self, request_id: str, req: ChatCompletionRequest,
                           first: tuple[int, TextDelta] | None, fan: FanOut
                           ) -> AsyncIterator[bytes]:
        created = int(time.time())
        s = req.sampling

        def chunk(index: int, delta: dict, finish: str | None, logprobs=None) -> bytes:
            c: dict[str, Any] = {
                "id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish}]}
            if s.include_usage:
                c["usage"] = None
            return sse(c)

        for i in range(s.n):
            yield chunk(i, {"role": "assistant", "content": ""}, None)
        n_prompt, completion = 0, 0

        async def items():
            if first is not None:
                yield first
            async for item in fan:
                yield item

        async for item in items():
            if item is None:
                yield SSE_KEEPALIVE
                continue
            i, d = item
            if d.error is not None:
                yield sse(error_body(delta_error(d)))
                yield SSE_DONE
                return
            if d.text or d.logprobs:
                yield chunk(i, {"content": d.text}, None, self._chat_logprobs(req, d.logprobs))
            if d.finish_reason is not None:
                n_prompt = d.prompt_tokens
                completion += d.completion_tokens
                yield chunk(i, {}, d.finish_reason)
        if s.include_usage:
            yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                       "model": self.model_name, "choices": [],
                       "usage": {"prompt_tokens": n_prompt, "completion_tokens": completion,
                                 "total_tokens": n_prompt + completion}})
        yield SSE_DONE
