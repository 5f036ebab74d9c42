"""POST /v1/completions: OpenAI's (legacy) Completions API.

Each prompt of `prompt` (string, strings, token ids, lists of token ids) gets `n` choices,
choice index = prompt_index * n + j, each its own engine request. String prompts are
tokenized with the tokenizer's special tokens (BOS where the model has one), as vLLM does.
`echo` puts the prompt text before each choice's text: a string prompt as sent, a token-id
prompt decoded with its special tokens kept (as vLLM does, whatever skip_special_tokens
says), so that its text and its prompt logprobs' tokens and text_offsets agree.
`max_tokens: 0` with `echo` scores the prompt: no text is generated (the engine runs the
prompt and samples nothing, so the prompt may fill max_model_len) and, with `logprobs`, the
prompt's logprobs come back (`SamplingParams.prompt_logprobs`; the first prompt token has
none, as in OpenAI's format). max_tokens defaults to the server's default max_tokens
(`--generation-config`), else OpenAI's 16.

Response objects are `text_completion` (non-streaming and each SSE chunk):
{"id", "object", "created", "model", "choices": [{"index", "text", "logprobs",
"finish_reason"}], "usage"}; streams end with a `choices: []` usage chunk when
stream_options.include_usage is set, then `data: [DONE]`. With
stream_options.continuous_usage_stats too (vLLM's extension), every chunk carries `usage`
{prompt_tokens of its prompt, completion_tokens of its choice so far, total_tokens} instead
of null.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from services.frontend.body import read_body
from services.frontend.context import ServingContext
from services.frontend.errors import context_error, model_not_found
from services.frontend.fanout import Collected, FanOut, check_choices, collect, fan_out
from services.frontend.generation import TextDelta
from services.frontend.guard import CLIENT_CLOSED, guard, json_response
from services.frontend.logprobs import merge_completion
from services.frontend.openai_protocol import CompletionRequest, parse_completion_request
from services.frontend.sse import SSE_DONE, sse, start_stream, stream_items
from shared.protocol import FinishReason, SamplingParams

log = logging.getLogger("kestrel.frontend.completions")

DEFAULT_MAX_TOKENS = 16


class _Choice:
    """Per-choice state while building text and completions-format logprobs."""

    def __init__(self, prompt_ids: list[int], prompt_text: str):
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        self.parts: list[str] = []
        self.logprobs: dict[str, list] | None = None
        self.offset = 0
        self.final: TextDelta | None = None


class CompletionsServing:
    """The /v1/completions route, built once at startup from the serving context."""

    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    def _prepare(self, req: CompletionRequest) -> list[tuple[list[int], str, int]]:
        """(token ids, text, max_tokens to send) of each prompt; raises APIError. text (what
        `echo` shows): a string prompt itself, a token-id prompt decoded with its special
        tokens kept (whatever skip_special_tokens says; that applies to generated text).
        max_tokens 0 (scoring, with echo) may fill the whole context: the engine runs the
        prompt and samples nothing."""
        ctx = self.ctx
        tok, max_model_len = ctx.tokenizer, ctx.limits.max_model_len
        if req.model != ctx.model_name:
            raise model_not_found(req.model)
        check_choices(ctx, len(req.prompts) * req.sampling.n,
                      "prompt" if len(req.prompts) > 1 else "n")
        out = []
        want = req.sampling.max_tokens
        for p in req.prompts:
            ids = tok.encode(p, add_special_tokens=True) if isinstance(p, str) else p
            # A token-id prompt echoes with its special tokens (as vLLM decodes it): the
            # prompt logprobs list every prompt token, and their text_offsets index this.
            text = p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False)
            room = max_model_len - len(ids)
            if room < (0 if want == 0 else 1) or (want is not None and want > room):
                raise context_error("prompt", max_model_len, len(ids), want, "prompt")
            out.append((ids, text, req.sampling.max_tokens_for(room, DEFAULT_MAX_TOKENS)))
        return out

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions. Errors as for chat (400 naming the field, 404, 413, 503)."""
        request_id = f"cmpl-{uuid.uuid4().hex}"

        ctx = self.ctx

        async def handle() -> Response:
            raw = await read_body(request, ctx.limits.max_body_bytes, ctx.limits.body_timeout_s)

            def parse() -> tuple[CompletionRequest, list[tuple[list[int], str, int]]]:
                req = parse_completion_request(raw, ctx.tokenizer.vocab_size, ctx.defaults)
                return req, self._prepare(req)

            # Off the loop: tokenizing a big prompt takes seconds (see chat_api).
            req, prepared = await asyncio.to_thread(parse)
            sp = req.sampling
            prompt_lp = req.logprobs if (req.echo and req.logprobs is not None) else None
            choices: list[tuple[list[int], SamplingParams]] = []
            states: list[_Choice] = []
            for pi, (ids, text, max_tokens) in enumerate(prepared):
                for j in range(sp.n):
                    choices.append((ids, sp.to_params(max_tokens, pi * sp.n + j,
                                                      logprobs=req.logprobs,
                                                      prompt_logprobs=prompt_lp)))
                    states.append(_Choice(ids, text))
            fan = fan_out(ctx, request_id, choices, sp)
            log.info("%s added: %d prompts, n %d, max_tokens %d, stream %s", request_id,
                     len(prepared), sp.n, max_tokens, sp.stream)
            n_prompt = sum(len(p[0]) for p in prepared)
            if sp.stream:
                return await start_stream(
                    request, request_id, fan, ctx.limits.keepalive_s,
                    lambda first, f: self._events(request_id, req, states, n_prompt, first, f))
            res = await collect(request, request_id, fan, len(choices), Collected)
            if res is None:
                return Response(status_code=CLIENT_CLOSED)
            out = []
            for i, (st, c) in enumerate(zip(states, res)):
                assert c.final is not None
                d = TextDelta(c.text, None, None, 0, 0, None, c.logprobs, c.prompt_logprobs)
                text, lps = self._piece(req, st, d, first=True)
                out.append({"index": i, "text": text, "logprobs": lps,
                            "finish_reason": self._finish(req, c.final)})
            completion = self._completion_tokens(req, [c.final for c in res])
            return json_response({
                "id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": ctx.model_name, "choices": out,
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": completion,
                          "total_tokens": n_prompt + completion}})

        return await guard(request_id, handle)

    @staticmethod
    def _scoring(req: CompletionRequest) -> bool:
        return req.sampling.max_tokens == 0

    def _finish(self, req: CompletionRequest, d: TextDelta) -> str | None:
        return FinishReason.LENGTH if self._scoring(req) else d.finish_reason

    def _completion_tokens(self, req: CompletionRequest, finals: list) -> int:
        if self._scoring(req):
            return 0
        return sum(d.completion_tokens for d in finals if d is not None)

    def _piece(self, req: CompletionRequest, st: _Choice, d: TextDelta,
               first: bool) -> tuple[str, dict | None]:
        """Text and completions-format logprobs of one delta of a choice (with the echoed
        prompt on its first piece)."""
        lp = self.ctx.lp
        text, lps = "", None
        top = req.logprobs or 0
        if first and req.echo:
            text = st.prompt_text
            if req.logprobs is not None:
                plps = list(d.prompt_logprobs) or [None] * len(st.prompt_ids)
                plps = (plps + [None] * len(st.prompt_ids))[:len(st.prompt_ids)]
                lps, st.offset = lp.completion(plps, st.prompt_ids, top, st.offset)
            else:
                st.offset += len(text)
        if self._scoring(req):
            return text, lps
        text += d.text
        if req.logprobs is not None:
            gen, st.offset = lp.completion(list(d.logprobs), [t.token_id for t in d.logprobs],
                                           top, st.offset)
            lps = merge_completion(lps, gen)
        return text, lps

    async def _events(self, request_id: str, req: CompletionRequest, states: list[_Choice],
                      n_prompt: int, first: tuple[int, TextDelta] | None, fan: FanOut
                      ) -> AsyncIterator[bytes]:
        """The SSE chunks of a streamed answer, `data: [DONE]` last. n_prompt: the tokens of
        every prompt (the final usage chunk's prompt_tokens). With
        stream_options.include_usage each chunk has `usage: null`, or with
        continuous_usage_stats too (vLLM's) {prompt_tokens of the chunk's prompt,
        completion_tokens of its choice so far (0 when scoring), total_tokens}."""
        created = int(time.time())
        sp = req.sampling
        started = [False] * len(states)
        finals: list[TextDelta | None] = [None] * len(states)
        counts = [0] * len(states)  # completion tokens of each choice so far

        def chunk(index: int, text: str, lps, finish: str | None) -> bytes:
            c: dict[str, Any] = {
                "id": request_id, "object": "text_completion", "created": created,
                "model": self.ctx.model_name,
                "choices": [{"index": index, "text": text, "logprobs": lps,
                             "finish_reason": finish}]}
            if sp.continuous_usage:
                prompt = len(states[index].prompt_ids)
                c["usage"] = {"prompt_tokens": prompt, "completion_tokens": counts[index],
                              "total_tokens": prompt + counts[index]}
            elif sp.include_usage:
                c["usage"] = None
            return sse(c)

        async for item in stream_items(first, fan):
            if item is None:  # a choice failed: its error event and [DONE] went out
                return
            if isinstance(item, bytes):
                yield item
                continue
            i, d = item
            counts[i] = 0 if self._scoring(req) else d.completion_tokens
            text, lps = self._piece(req, states[i], d, first=not started[i])
            started[i] = True
            if d.finish_reason is not None:
                finals[i] = d
                if text or lps:
                    yield chunk(i, text, lps, None)
                yield chunk(i, "", None, self._finish(req, d))
            elif text or lps:
                yield chunk(i, text, lps, None)
        if sp.include_usage:
            completion = self._completion_tokens(req, finals)
            yield sse({"id": request_id, "object": "text_completion", "created": created,
                       "model": self.ctx.model_name, "choices": [],
                       "usage": {"prompt_tokens": n_prompt, "completion_tokens": completion,
                                 "total_tokens": n_prompt + completion}})
        yield SSE_DONE
