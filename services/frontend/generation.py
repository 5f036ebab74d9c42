"""One request's generation as text: engine outputs -> final text deltas.

Shared by every API route (streaming or not): follows a request sent to the engine, turns its
token ids into text with the incremental detokenizer, applies stop strings (checked on
text, docs/ARCHITECTURE.md §5: the frontend aborts the request in the engine when one matches), and
aborts the request in the engine when the consumer goes away before the end.

A consumer that applies stop strings itself (an output parser: the Anthropic route, chat
with a reasoning parser) ends the request with `end_by_stop_string(gen, stop)`, which throws
`StopStringMatched` into the generator: the request is aborted in the engine like any stop
string's, and logged and counted (metrics.py) as finish reason "stop", not as a client gone.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from collections.abc import AsyncGenerator, Callable

from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.engine_client import EngineClient, RequestStream
from services.frontend.metrics import RequestMetrics, RequestTimer
from services.frontend.tokenizer import Tokenizer
from shared.protocol import ErrorKind, FinishReason, TokenLogprob

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
    error_kind: the engine's ErrorKind ("invalid", "overloaded", "unavailable", "internal"; None: internal).
    completion_tokens / prompt_tokens: counts so far.
    logprobs: the engine's TokenLogprob of each output token that arrived with this delta
    (empty unless the request asked for logprobs; the text of the last tokens may still be
    held back). prompt_logprobs: the prompt's, on the first delta only (None for token 0)."""

    text: str
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error_kind: ErrorKind | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)


class StopStringMatched(Exception):
    """Thrown into a `generate` iterator by a consumer whose own parser matched a stop
    string (see `end_by_stop_string`). stop: the stop string, for the log."""

    def __init__(self, stop: str):
        super().__init__(stop)
        self.stop = stop


StopProbe = Callable[[str], bool]  # feeds text to copies of a stop check: whether a stop string matched


def matcher_probe(matcher: StopStringMatcher) -> StopProbe:
    """A `StopProbe` over a copy of `matcher` (the matcher itself is left as it is)."""
    m = copy.copy(matcher)
    return lambda text: m.feed(text)[1]


def _through_stop_string(ids: list[int], lps: list[TokenLogprob], detok: IncrementalDetokenizer,
                         probe: StopProbe) -> tuple[list[int], list[TokenLogprob]]:
    """The leading tokens of `ids` up to the one whose text completes a stop string (all of
    them when none does), and their logprobs (aligned when given). Feeds a copy of the
    detokenizer's text token by token to `probe` (copies of the stop check: the generator's
    matcher, or an output parser's, `ChatOutputParser.stop_probe`); the caller then feeds the
    kept tokens as usual."""
    d = detok.fork()
    for i, tok in enumerate(ids[:-1]):
        if probe(d.add([tok])):
            return ids[:i + 1], lps[:i + 1]
    return ids, lps


async def end_by_stop_string(gen: AsyncGenerator[TextDelta | None, None], stop: str) -> None:
    """End a suspended `generate` iterator because the consumer matched stop string `stop`
    in its output: the request stops in the engine and finishes as "stop" (log, metrics).
    Call it between two items (not while `gen` is running); `gen` is exhausted after."""
    try:
        await gen.athrow(StopStringMatched(stop))
    except StopAsyncIteration:
        pass


async def generate(engine: EngineClient, tokenizer: Tokenizer, metrics: RequestMetrics,
                   stream: RequestStream, prompt_ids: list[int], stop: list[str],
                   skip_special_tokens: bool = True, tick_s: float | None = None,
                   stop_probe: Callable[[], StopProbe | None] | None = None
                   ) -> AsyncGenerator[TextDelta | None, None]:
    """Follow one request opened with `engine.open_request`; yield TextDeltas, the last
    with a finish_reason. tokenizer: the model's (detokenizing). metrics: where the
    request's latencies and token counts are recorded (the serving context's).

    tick_s: if set, yield None whenever no output came for that many seconds (the caller
    sends a keep-alive). If the consumer stops early (client gone, task cancelled), the
    request is aborted in the engine and counted as "abort". If the consumer throws
    StopStringMatched into it (`end_by_stop_string`), the request is aborted in the engine
    and finishes as "stop". The end is logged and recorded in the metrics once, when the
    iterator closes.

    stop_probe: for a consumer that applies stop strings itself (an output parser, with `stop`
    empty): returns a `StopProbe` of its state now (or None: no stop strings), so that an output
    of several tokens (speculative decoding) is cut at the token that completes a stop string,
    as with `stop`: the tokens after it are neither counted nor their logprobs returned. The
    consumer has fed its parser every delta yielded before the next output is read.
    """
    started = time.monotonic()
    request_id = stream.request_id
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    matcher = StopStringMatcher(stop) if stop else None
    n_prompt, n_out = len(prompt_ids), 0
    # Prometheus TTFT / ITL / TPOT / e2e and token counters (metrics.py), timed from the
    # request's submission to the engine.
    timer = RequestTimer(metrics, stream.created)
    reason: str | None = None  # how the request ended; None while running or if abandoned
    how = ""  # for the log line: set when the consumer's parser ended the request
    engine_done = False  # the engine finished the request itself (no Abort to send)
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
            lps = out.logprobs
            if len(ids) > 1:
                # several tokens at once (speculative decoding, docs/ARCHITECTURE.md §5.5): a
                # stop string inside them ends the output at the token that completes it, so
                # the tokens after it are neither counted nor their logprobs returned
                probe = (matcher_probe(matcher) if matcher is not None
                         else stop_probe() if stop_probe is not None else None)
                if probe is not None:
                    ids, lps = _through_stop_string(ids, lps, detok, probe)
            n_out += len(ids)
            timer.tokens(len(ids))
            pending_lps.extend(lps)
            if out.prompt_logprobs:
                prompt_lps = list(out.prompt_logprobs)
            if (out.finish_reason == FinishReason.STOP and out.stop_token_id is not None and ids
                    and ids[-1] == out.stop_token_id):
                ids = ids[:-1]  # the stop token's text is not part of the answer
            text = detok.add(ids)
            finish = out.finish_reason
            engine_done = finish is not None
            if finish in (FinishReason.ABORT, FinishReason.ERROR):
                reason = finish
                error = out.error or "The request was aborted by the engine."
                # a refusal of the request's own fault (a grammar that does not compile,
                # "invalid": a 400) is the client's mistake, not a fault here
                level = logging.INFO if out.error_kind == ErrorKind.INVALID else logging.ERROR
                log.log(level, "%s failed in the engine: %s", request_id, error)
                yield TextDelta(text, FinishReason.ERROR, error, n_prompt, n_out, out.error_kind)
                return
            if finish is not None:
                text += detok.flush()
            if matcher is not None:
                text, matched = matcher.feed(text)
                if matched:
                    finish = FinishReason.STOP
                elif finish is not None:
                    text += matcher.flush()
            if finish is not None:
                reason = finish
                if not engine_done:
                    engine.abort(request_id)  # a stop string matched: the engine stops too
                yield TextDelta(text, reason, None, n_prompt, n_out, None, pending_lps,
                                prompt_lps)
                return
            if text or prompt_lps:
                yield TextDelta(text, None, None, n_prompt, n_out, None, pending_lps,
                                prompt_lps)
                pending_lps, prompt_lps = [], []
    except StopStringMatched as e:  # the consumer's parser matched it: a stop, no client gone
        reason, how = FinishReason.STOP, f" (stop string {e.stop!r}, matched by the output parser)"
    finally:
        timer.finish(reason or FinishReason.ABORT, n_prompt, n_out)
        if reason is None:
            log.info("%s aborted after %d tokens (client gone)", request_id, n_out)
        elif reason not in (FinishReason.ABORT, FinishReason.ERROR):  # (those were logged as errors above)
            log.info("%s finished: %s%s, %d prompt + %d completion tokens, %.2f s",
                     request_id, reason, how, n_prompt, n_out, time.monotonic() - started)
        if engine_done:
            engine.release(request_id)
        else:
            engine.abort(request_id)  # no-op when a stop string already aborted it
