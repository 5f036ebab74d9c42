"""POST /tokenize and POST /detokenize, in vLLM's request and response shapes.

/tokenize: {"model"?, "prompt": str, "add_special_tokens": bool = true,
"return_token_strs": bool = false} or {"model"?, "messages": [...],
"add_generation_prompt": bool = true, "add_special_tokens": bool = false,
"chat_template_kwargs"?: {}, "tools"?, "tool_choice"?, "return_token_strs"?} -> {"count",
"max_model_len", "tokens", "token_strs" (null unless asked)}. Messages and tools render as
/v1/chat/completions renders them (tools left out when tool_choice is "none").
/detokenize: {"model"?, "tokens": [int]} -> {"prompt": str}. An id outside the vocabulary is
a 400 naming `tokens`.

Parsing, rendering, tokenizing and decoding run off the event loop (`asyncio.to_thread`): a
body near the size limit takes seconds, and the loop must keep serving other streams and
the engine's heartbeats meanwhile.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from services.frontend.body import json_object, read_body
from services.frontend.chat_template import check_template_kwargs
from services.frontend.context import ServingContext
from services.frontend.errors import InternalError, InvalidRequest, model_not_found
from services.frontend.guard import guard, json_response
from services.frontend.openai_protocol import parse_messages
from services.frontend.openai_sampling import get_bool, is_int
from services.frontend.openai_tools import parse_tools


class TokenizeServing:
    """The /tokenize and /detokenize routes of one frontend, built once at startup from the
    serving context."""

    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    def _body(self, raw: bytes) -> dict[str, Any]:
        """The body as a JSON object; raises InvalidRequest (400), or NotFound (404) when it
        names a model other than the served one."""
        body = json_object(raw)
        model = body.get("model")
        if model is not None and model != self.ctx.model_name:
            raise model_not_found(str(model))
        return body

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize (see the module docstring). 400 on a bad field."""
        s = self.ctx

        def work(raw: bytes) -> Response:
            body = self._body(raw)
            if body.get("messages") is not None:
                messages = parse_messages(body["messages"])
                if s.template is None:
                    raise InternalError("The model has no chat template.")
                kwargs = check_template_kwargs(body.get("chat_template_kwargs"))
                tools = parse_tools(body)
                text = s.template.render(
                    messages, add_generation_prompt=get_bool(body, "add_generation_prompt",
                                                             True),
                    tools=tools.tools if tools.active else None,
                    **(s.features.template_kwargs() | kwargs))
                ids = s.tokenizer.encode(text, get_bool(body, "add_special_tokens", False))
            elif isinstance(body.get("prompt"), str):
                ids = s.tokenizer.encode(body["prompt"],
                                         get_bool(body, "add_special_tokens", True))
            else:
                raise InvalidRequest("prompt", "Give 'prompt' (a string) or 'messages'.")
            strs = None
            if get_bool(body, "return_token_strs", False):
                strs = [s.lp.token(t)[0] for t in ids]
            return json_response({"count": len(ids), "max_model_len": s.limits.max_model_len,
                                  "tokens": ids, "token_strs": strs})

        async def handle() -> Response:
            return await asyncio.to_thread(work, await read_body(
                request, s.limits.max_body_bytes, s.limits.body_timeout_s))

        return await guard(f"tokenize-{uuid.uuid4().hex[:12]}", handle)

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize (see the module docstring). 400 on a bad token id."""
        s = self.ctx

        def work(raw: bytes) -> Response:
            body = self._body(raw)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
                raise InvalidRequest("tokens", "'tokens' must be a list of token ids.")
            bad = [t for t in tokens if not 0 <= t < s.tokenizer.vocab_size]
            if bad:
                raise InvalidRequest("tokens", f"Token id {bad[0]} is outside the vocabulary "
                                     f"({s.tokenizer.vocab_size} tokens).")
            return json_response({"prompt": s.tokenizer.decode(tokens,
                                                                skip_special_tokens=False)})

        async def handle() -> Response:
            return await asyncio.to_thread(work, await read_body(
                request, s.limits.max_body_bytes, s.limits.body_timeout_s))

        return await guard(f"detokenize-{uuid.uuid4().hex[:12]}", handle)
