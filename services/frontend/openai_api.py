"""OpenAI-compatible HTTP routes: GET /v1/models, POST /v1/chat/completions, GET /health.

Response shapes follow the OpenAI API reference: `chat.completion` objects, and for
`stream: true` Server-Sent Events, each `data: <chat.completion.chunk JSON>\\n\\n`: a first
chunk with the assistant role, content deltas, a chunk with the finish_reason, a usage
chunk with `choices: []` when stream_options.include_usage is set, then `data: [DONE]\\n\\n`.
While waiting, a comment line `: keep-alive\\n\\n` goes out every keepalive_s seconds. A request
is validated completely before the first SSE byte; a failure after that is sent as
`data: {"error": {...}}\\n\\n` followed by `data: [DONE]\\n\\n`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from services.frontend.chat_template import ChatTemplate
from services.frontend.engine_client import EngineClient, EngineUnavailable
from services.frontend.errors import (APIError, InternalError, InvalidRequest,
                                      ServiceUnavailable, error_body, error_response,
                                      model_not_found)
from services.frontend.generation import TextDelta, generate
from services.frontend.openai_protocol import ChatCompletionRequest, parse_chat_request
from services.frontend.tokenizer import Tokenizer
from shared.protocol import SamplingParams

log = logging.getLogger("kestrel.frontend.openai")

SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keep-alive\n\n"


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _usage(d: TextDelta) -> dict[str, int]:
    return {"prompt_tokens": d.prompt_tokens, "completion_tokens": d.completion_tokens,
            "total_tokens": d.prompt_tokens + d.completion_tokens}


class OpenAIServing:
    """The OpenAI routes of one frontend.

    model_name: the served model name (requests must name it). max_model_len: tokens of
    prompt + completion. template: the model's chat template, None if it has none (chat
    requests then fail with 500). keepalive_s: seconds between SSE keep-alive comments.
    """

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, template: ChatTemplate | None,
                 model_name: str, max_model_len: int, keepalive_s: float):
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = template
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.keepalive_s = keepalive_s
        self.created = int(time.time())

    # ------------------------------------------------------------ simple routes

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "kestrel", "max_model_len": self.max_model_len}

    async def list_models(self, request: Request) -> Response:
        """GET /v1/models: the one served model, with its max_model_len."""
        return _json({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request) -> Response:
        """GET /v1/models/{model}: the model card, or 404 model_not_found."""
        if request.path_params["model"] != self.model_name:
            return error_response(model_not_found(request.path_params["model"]))
        return _json(self._model_card())

    async def health(self, request: Request) -> Response:
        """GET /health: 200 when the engine answered within the last few seconds, else 503."""
        if self.engine.is_healthy():
            return _json({"status": "ok"})
        return _json({"status": "unavailable", "reason": "the engine is not answering"}, 503)

    # ------------------------------------------------------------ chat completions

    def _prepare(self, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
        """Prompt token ids and sampling params of a valid request; raises APIError."""
        if req.model != self.model_name:
            raise model_not_found(req.model)
        if self.template is None:
            raise InternalError("The model has no chat template.")
        prompt = self.template.render(req.messages, add_generation_prompt=True,
                                      **req.chat_template_kwargs)
        prompt_ids = self.tokenizer.encode(prompt)
        n = len(prompt_ids)
        room = self.max_model_len - n
        if room < 1 or (req.max_tokens is not None and req.max_tokens > room):
            asked = f"{n + (req.max_tokens or 0)} tokens ({n} in the messages, " \
                    f"{req.max_tokens or 0} in the completion)" if req.max_tokens \
                else f"{n} tokens in the messages"
            raise InvalidRequest(
                "messages", f"This model's maximum context length is {self.max_model_len} "
                f"tokens. However, you requested {asked}. Please reduce the length of the "
                "messages or completion.", code="context_length_exceeded")
        bad = [t for t in req.stop_token_ids if t >= self.tokenizer.vocab_size]
        if bad:
            raise InvalidRequest("stop_token_ids", f"Token id {bad[0]} is outside the "
                                 f"vocabulary ({self.tokenizer.vocab_size} tokens).")
        sampling = SamplingParams(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            seed=req.seed, max_tokens=req.max_tokens if req.max_tokens is not None else room,
            min_tokens=req.min_tokens, stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos)
        return prompt_ids, sampling

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions (OpenAI Chat Completions, streaming and not).

        Errors: 400 invalid JSON / fields / too long, 404 unknown model, 503 engine not
        answering, 500 internal faults (logged with the request id)."""
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            req = parse_chat_request(await request.body())
            prompt_ids, sampling = self._prepare(req)
            stream = self.engine.open_request(request_id, prompt_ids, sampling)
            gen = generate(self.engine, self.tokenizer, stream, prompt_ids, req.stop,
                           req.skip_special_tokens,
                           tick_s=self.keepalive_s if req.stream else None)
            log.info("%s added: %d prompt tokens, max_tokens %d, stream %s", request_id,
                     len(prompt_ids), sampling.max_tokens, req.stream)
            if req.stream:
                return StreamingResponse(self._sse_stream(request_id, req, gen),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            return await self._complete(request, request_id, req, gen)
        except APIError as e:
            if e.status >= 500:
                log.error("%s failed: %s", request_id, e.message)
            else:
                log.info("%s rejected (%d, %s): %s", request_id, e.status, e.param, e.message)
            return error_response(e)
        except EngineUnavailable as e:
            log.warning("%s refused: %s", request_id, e)
            return error_response(ServiceUnavailable(f"The engine is unavailable: {e}."))
        except Exception:
            log.exception("%s failed with an internal error", request_id)
            return error_response(InternalError(f"Internal error (request {request_id})."))

    def _chunk(self, request_id: str, created: int, delta: dict[str, Any],
               finish_reason: str | None, include_usage: bool) -> dict[str, Any]:
        chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                 "model": self.model_name,
                 "choices": [{"index": 0, "delta": delta, "logprobs": None,
                              "finish_reason": finish_reason}]}
        if include_usage:
            chunk["usage"] = None
        return chunk

    async def _sse_stream(self, request_id: str, req: ChatCompletionRequest,
                          gen: AsyncIterator[TextDelta | None]) -> AsyncIterator[bytes]:
        created = int(time.time())
        usage = req.include_usage
        try:
            yield _sse(self._chunk(request_id, created, {"role": "assistant", "content": ""},
                                   None, usage))
            async for d in gen:
                if d is None:
                    yield SSE_KEEPALIVE
                    continue
                if d.error is not None:
                    yield _sse(error_body(InternalError(f"The request failed: {d.error}")))
                    break
                if d.text:
                    yield _sse(self._chunk(request_id, created, {"content": d.text}, None,
                                           usage))
                if d.finish_reason is not None:
                    yield _sse(self._chunk(request_id, created, {}, d.finish_reason, usage))
                    if usage:
                        yield _sse({"id": request_id, "object": "chat.completion.chunk",
                                    "created": created, "model": self.model_name,
                                    "choices": [], "usage": _usage(d)})
                    break
        except Exception:
            log.exception("%s failed while streaming", request_id)
            yield _sse(error_body(InternalError(f"Internal error (request {request_id}).")))
        finally:
            await gen.aclose()
            self.engine.abort(request_id)  # no-op unless the request is still running
        yield SSE_DONE

    async def _complete(self, request: Request, request_id: str, req: ChatCompletionRequest,
                        gen: AsyncIterator[TextDelta | None]) -> Response:
        """Collect a whole answer; abort the request if the client disconnects first."""

        async def collect() -> TextDelta:
            parts, last = [], None
            async for d in gen:
                if d is not None:
                    parts.append(d.text)
                    last = d
            assert last is not None and last.finish_reason is not None
            last.text = "".join(parts)
            return last

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(collect())
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()  # the generator's cleanup aborts the request in the engine
                await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            self.engine.abort(request_id)
            log.info("%s: client disconnected", request_id)
            return Response(status_code=499)  # nobody is listening any more
        final = work.result()
        if final.error is not None:
            raise InternalError(f"The request failed: {final.error}")
        return _json({
            "id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": final.text},
                         "logprobs": None, "finish_reason": final.finish_reason}],
            "usage": _usage(final)})
