"""One request's generation as text: engine outputs -> final text deltas.

Shared by every API route (streaming or not): follows a request sent to the engine, turns its
token ids into text with the incremental detokenizer, applies stop strings (checked on
text, DESIGN §5: the frontend aborts the request in the engine when one matches), and
aborts the request in the engine when the consumer goes away before the end.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.engine_client import EngineClient, RequestStream
from services.frontend.metrics import RequestTimer
from services.frontend.tokenizer import Tokenizer
from shared.protocol import TokenLogprob

log = logging.getLogger("kestrel.frontend.generation")


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back what could be the start of one.

    stops: the stop strings (non-empty). `feed(text)` returns (text safe to emit, matched);
    once matched, the emitted text ends just before the stop string (OpenAI excludes it).
    `flush()` returns the held-back text at the end of a request.
    """

    def __init__(self, stops: list[str]):
        self._stops = stops
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Add new text; return the part that is final and whether a stop string matched."""
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[:min(hits)], True
        keep = self._partial_match_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text (no stop string completed)."""
        held, self._held = self._held, ""
        return held

    def _partial_match_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        longest = max((len(s) for s in self._stops), default=1) - 1
        for k in range(min(longest, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0


@dataclass
class TextDelta:
    """A piece of a request's output. text: new final text ('' allowed).
    finish_reason: None while running; "stop" or "length" at the end.
    error: set (with finish_reason "error") when the engine failed or dropped the request;
    error_kind: the engine's "invalid" / "overloaded" / "internal" (None: internal).
    completion_tokens / prompt_tokens: counts so far.
    logprobs: the engine's TokenLogprob of each output token that arrived with this delta
    (empty unless the request asked for logprobs; the text of the last tokens may still be
    held back). prompt_logprobs: the prompt's, on the first delta only (None for token 0)."""

    text: str
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error_kind: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)


async def generate(engine: EngineClient, tokenizer: Tokenizer, stream: RequestStream,
                   prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True,
                   tick_s: float | None = None) -> AsyncIterator[TextDelta | None]:
    """Follow one request opened with `engine.open_request`; yield TextDeltas, the last
    with a finish_reason.

    tick_s: if set, yield None whenever no output came for that many seconds (the caller
    sends a keep-alive). If the consumer stops early (client gone, task cancelled), the
    request is aborted in the engine.
    """
    started = time.monotonic()
    request_id = stream.request_id
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    matcher = StopStringMatcher(stop) if stop else None
    n_prompt, n_out, finished = len(prompt_ids), 0, False
    # Prometheus TTFT / ITL / TPOT / e2e and token counters (metrics.py), timed from the
    # request's submission to the engine.
    timer, reason = RequestTimer(getattr(stream, "created", None)), None
    pending_lps: list[TokenLogprob] = []
    prompt_lps: list[TokenLogprob | None] = []
    try:
        while True:
            try:
                out = await stream.get(tick_s)
            except TimeoutError:
                yield None
                continue
            ids = out.new_token_ids
            n_out += len(ids)
            timer.tokens(len(ids))
            pending_lps.extend(out.logprobs)
            if out.prompt_logprobs:
                prompt_lps = list(out.prompt_logprobs)
            if (out.finish_reason == "stop" and out.stop_token_id is not None and ids
                    and ids[-1] == out.stop_token_id):
                ids = ids[:-1]  # the stop token's text is not part of the answer
            text = detok.add(ids)
            reason = out.finish_reason
            if reason in ("abort", "error"):
                finished = True
                error = out.error or "The request was aborted by the engine."
                log.error("%s failed in the engine: %s", request_id, error)
                yield TextDelta(text, "error", error, n_prompt, n_out, out.error_kind)
                return
            if reason is not None:
                text += detok.flush()
            if matcher is not None:
                text, matched = matcher.feed(text)
                if matched:
                    reason = "stop"
                elif reason is not None:
                    text += matcher.flush()
            if reason is not None:
                finished = True
                if out.finish_reason is None:
                    engine.abort(request_id)  # a stop string matched: the engine stops too
                log.info("%s finished: %s, %d prompt + %d completion tokens, %.2f s",
                         request_id, reason, n_prompt, n_out, time.monotonic() - started)
                yield TextDelta(text, reason, None, n_prompt, n_out, None, pending_lps,
                                prompt_lps)
                return
            if text or prompt_lps:
                yield TextDelta(text, None, None, n_prompt, n_out, None, pending_lps,
                                prompt_lps)
                pending_lps, prompt_lps = [], []
    finally:
        timer.finish(reason if finished else "abort", n_prompt, n_out)
        if not finished:
            log.info("%s aborted after %d tokens (client gone)", request_id, n_out)
            engine.abort(request_id)
        else:
            engine.release(request_id)
