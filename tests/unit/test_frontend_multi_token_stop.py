"""Several tokens in one engine output (speculative decoding's accepted drafts, §5.5 of
docs/ARCHITECTURE.md) with a stop string inside them: the answer, the completion-token count
and the logprobs end at the token that completes the stop string, as when the tokens come
one by one, whether `generate` applies the stop strings or an output parser does (its
`stop_probe`). The truth is the same request fed one token per output."""

from __future__ import annotations

import asyncio
import os
import time

from services.frontend.generation import generate
from services.frontend.parsers.output import ChatOutputParser, Finish, Reasoning, run_parsed
from services.frontend.parsers.reasoning import Qwen3ReasoningParser
from services.frontend.parsers.tool_parsers import Content
from services.frontend.metrics import RequestMetrics
from services.frontend.tokenizer import Tokenizer
from shared.protocol import RequestOutput, TokenLogprob

SMOLLM2 = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "models", "SmolLM2-135M-Instruct")
TEXT = " the quick brown fox jumps over the lazy dog and runs far away"


class _Stream:
    """The outputs of one request, as `RequestStream.get` hands them out."""

    def __init__(self, outputs: list[RequestOutput]):
        self.request_id, self.created, self._outs = "cmpl-1", time.monotonic(), list(outputs)

    async def get(self, tick_s=None) -> RequestOutput:
        return self._outs.pop(0)


class _Engine:
    def __init__(self):
        self.aborted: list[str] = []

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    def release(self, rid: str) -> None:
        pass


def _run(tok: Tokenizer, ids: list[int], per_output: int, stop: list[str]) -> tuple[str, int, list[int]]:
    outs = []
    for i in range(0, len(ids), per_output):
        chunk = ids[i:i + per_output]
        outs.append(RequestOutput("cmpl-1", chunk, 3, logprobs=[TokenLogprob(t, -0.5) for t in chunk]))
    outs[-1].finish_reason = "length"

    async def main():
        text, n, lps = "", 0, []
        async for d in generate(_Engine(), tok, RequestMetrics(), _Stream(outs), [1, 2, 3], stop):
            if d is None:
                continue
            text += d.text
            n = d.completion_tokens
            lps += [lp.token_id for lp in d.logprobs]
        return text, n, lps
    return asyncio.run(main())


def test_a_stop_string_inside_a_multi_token_output_ends_the_count_where_it_completes():
    tok = Tokenizer(SMOLLM2)
    ids = tok.encode(TEXT)
    for stop in (["lazy"], ["fox jumps"], ["far away"], ["absent"]):
        want = _run(tok, ids, 1, stop)
        for per_output in (2, 3, 5, len(ids)):
            assert _run(tok, ids, per_output, stop) == want, (stop, per_output)
    text, n, lps = _run(tok, ids, 5, ["lazy"])
    assert text == TEXT.split("lazy")[0] and n < len(ids) and lps == ids[:n]


def _run_parsed(tok: Tokenizer, ids: list[int], per_output: int, stops: list[str],
                reasoning: bool) -> tuple[str, str, int, str | None]:
    """As `_run`, but the stop strings are an output parser's (the Anthropic route, chat with a
    reasoning parser): `generate` without stop strings, with the parser's `stop_probe`, followed
    by `run_parsed`. Returns (reasoning text, content text, completion tokens, stop string)."""
    outs = []
    for i in range(0, len(ids), per_output):
        chunk = ids[i:i + per_output]
        outs.append(RequestOutput("cmpl-1", chunk, 3, logprobs=[TokenLogprob(t, -0.5) for t in chunk]))
    outs[-1].finish_reason = "length"
    parser = ChatOutputParser(Qwen3ReasoningParser() if reasoning else None, None, stops)

    async def main():
        gen = generate(_Engine(), tok, RequestMetrics(), _Stream(outs), [1, 2, 3], [],
                       stop_probe=parser.stop_probe)
        think, content = "", ""
        async for item in run_parsed(gen, parser):
            if isinstance(item, Finish):
                return think, content, item.completion_tokens, item.stop_string
            for ev in item or []:
                if isinstance(ev, Reasoning):
                    think += ev.text
                elif isinstance(ev, Content):
                    content += ev.text
        raise AssertionError("no Finish")
    return asyncio.run(main())


def test_an_output_parsers_stop_string_inside_a_multi_token_output_ends_the_count_where_it_completes():
    """The Anthropic route's stop_sequences and chat's stop strings under a reasoning parser are
    the parser's (on the content only): with several tokens an output, the count still ends at
    the token that completes the stop string, and a stop string inside the reasoning stops
    nothing."""
    tok = Tokenizer(SMOLLM2)
    for text, reasoning in ((TEXT, False), ("<think> a lazy fox thinks </think>" + TEXT, True)):
        ids = tok.encode(text)
        for stop in (["lazy"], ["fox jumps"], ["far away"], ["absent"]):
            want = _run_parsed(tok, ids, 1, stop, reasoning)
            assert want[3] == (None if stop == ["absent"] else stop[0])
            for per_output in (2, 3, 5, len(ids)):
                assert _run_parsed(tok, ids, per_output, stop, reasoning) == want, (stop, per_output, reasoning)
    _, content, n, _ = _run_parsed(tok, tok.encode(TEXT), 5, ["lazy"], False)
    assert content == TEXT.split("lazy")[0] and n < len(tok.encode(TEXT))
