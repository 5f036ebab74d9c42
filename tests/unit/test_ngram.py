"""N-gram prompt lookup and the worker's token history (services/worker/spec/ngram.py,
history.py; docs/ARCHITECTURE.md §5.5). The lookup is checked against a brute-force search
written out here from the rule (longest n first, most recent earlier occurrence), the
history against the token list a request really has, and the proposer through the runner
(CPU, dummy tiny-Qwen3 weights) against plain decoding."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from benchmarks.common import model_dir
from services.worker.model_runner import ModelRunner
from services.worker.spec.history import UNKNOWN, TokenHistory
from services.worker.spec.ngram import NgramProposer, ngram_lookup
from shared.config import build_config
from shared.protocol import PENDING_TOKEN, SamplingParams, ScheduledSeq, StepPlan
from tests.runner_driver import generate, spec_run

GREEDY = SamplingParams(temperature=0.0)


def _brute(ctx: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The rule, by exhaustive search: for n = hi .. lo, the latest j < L - 1 with
    ctx[j-n+1 .. j] == ctx[L-n .. L-1] gives ctx[j+1 .. j+k], cut at the first UNKNOWN."""
    L = len(ctx)
    if k <= 0 or not ctx or ctx[-1] == UNKNOWN:
        return []
    for n in range(min(hi, L - 1), lo - 1, -1):
        for j in range(L - 2, n - 2, -1):
            if ctx[j - n + 1:j + 1] == ctx[L - n:]:
                out = ctx[j + 1:j + 1 + k]
                return out[:out.index(UNKNOWN)] if UNKNOWN in out else out
    return []


@pytest.mark.parametrize("vocab", [2, 3, 6])
def test_lookup_equals_the_brute_force_search(vocab):
    rng = np.random.default_rng(vocab)
    for trial in range(400):
        L = int(rng.integers(1, 60))
        ctx = rng.integers(0, vocab, L).astype(np.int32)
        if trial % 7 == 0:  # positions the worker never saw
            ctx[rng.integers(0, L, 2)] = UNKNOWN
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        k = int(rng.integers(0, 6))
        assert ngram_lookup(ctx, lo, hi, k) == _brute(ctx.tolist(), lo, hi, k), (ctx.tolist(), lo, hi, k)


def test_lookup_prefers_the_longest_ngram_then_the_most_recent_occurrence():
    a = np.array
    # "1 2 3" occurs at the start (followed by 7); "2 3" alone later (followed by 8): n = 3 wins
    ctx = a([1, 2, 3, 7, 9, 2, 3, 8, 5, 1, 2, 3])
    assert ngram_lookup(ctx, 2, 3, 2) == [7, 9]
    assert ngram_lookup(ctx, 2, 2, 2) == [8, 5]  # only n = 2: its most recent occurrence
    # two occurrences of the same n-gram: the later one's continuation
    ctx = a([4, 5, 6, 4, 5, 7, 0, 4, 5])
    assert ngram_lookup(ctx, 2, 4, 3) == [7, 0, 4]
    # the continuation stops where the context ends; no occurrence: no drafts
    assert ngram_lookup(a([1, 2, 1]), 1, 2, 5) == [2, 1]
    assert ngram_lookup(a([1, 2, 3, 4]), 1, 3, 5) == []
    assert ngram_lookup(a([1, 2, 1, 2]), 3, 3, 5) == []  # "2 1 2" never occurred before
    assert ngram_lookup(a([1, 2, 1, 2]), 2, 2, 0) == []


def test_history_follows_prefill_decode_verify_and_rollback():
    h = TokenHistory(initial_capacity=2)  # grows several times below
    seq = ScheduledSeq("a", [10, 11, 12], 0, [0], False, GREEDY)
    h.write([seq])
    h.write([ScheduledSeq("a", [13, 14], 3, [0], True, GREEDY)])
    h.emit([ScheduledSeq("a", [13, 14], 3, [0], True, GREEDY)], [[20]])
    assert h.tokens("a").tolist() == [10, 11, 12, 13, 14, 20]
    # a verify seq [last, d1, d2, d3]: two drafts accepted, then a recovered token
    v = ScheduledSeq("a", [20, 30, 31, 32], 5, [0], True, GREEDY, num_draft=3)
    h.write([v])
    assert h.tokens("a").tolist() == [10, 11, 12, 13, 14, 20, 30, 31, 32]
    h.emit([v], [[30, 31, 40]])
    assert h.tokens("a").tolist() == [10, 11, 12, 13, 14, 20, 30, 31, 40]  # d3 rolled back
    # a pending input keeps the token the worker emitted there
    p = ScheduledSeq("a", [PENDING_TOKEN], 8, [0], True, GREEDY)
    h.write([p])
    assert h.tokens("a").tolist()[-1] == 40
    h.emit([p], [[41]])
    assert h.length("a") == 10 and h.tokens("a").tolist()[-2:] == [40, 41]
    # a preemption restarts the request from token 0: everything after is gone
    h.write([ScheduledSeq("a", [10, 11], 0, [0], False, GREEDY)])
    assert h.tokens("a").tolist() == [10, 11]
    with pytest.raises(ValueError):
        h.tokens("a")[0] = 1  # a read-only view
    h.forget(["a"])
    assert h.length("a") == 0 and h.tokens("a").size == 0 and len(h) == 0


def test_history_takes_context_tokens_and_marks_gaps_unknown():
    h = TokenHistory()
    # a prefix-cache hit: the first seq starts at 4 and carries the tokens before it
    h.write([ScheduledSeq("b", [5, 6], 4, [0], True, GREEDY, context_token_ids=[1, 2, 3, 4])])
    assert h.tokens("b").tolist() == [1, 2, 3, 4, 5, 6]
    # a request first seen past position 0 without its context: the gap matches nothing
    h.write([ScheduledSeq("c", [7, 8], 3, [0], True, GREEDY)])
    assert h.tokens("c").tolist() == [UNKNOWN] * 3 + [7, 8]
    h.write([ScheduledSeq("d", [PENDING_TOKEN], 2, [0], True, GREEDY)])
    assert h.tokens("d").tolist() == [UNKNOWN] * 3


@pytest.fixture(scope="module")
def ngram_runner():
    folder = model_dir("tiny-qwen3")
    try:
        cfg = build_config(cli={"model": folder, "load_format": "dummy", "device": "cpu", "dtype": "float32",
                                "kv_cache_gib": 0.05, "max_model_len": 512,
                                "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                       "prompt_lookup_min": 1, "prompt_lookup_max": 3}},
                           env={})
        yield ModelRunner(cfg)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_runner_feeds_the_ngram_proposers_history(ngram_runner):
    r = ngram_runner
    assert isinstance(r.proposer, NgramProposer) and r.history is r.proposer.history
    assert r.report()["speculative"]["method"] == "ngram" and r.draft_kv is None
    prompt = [7, 8, 9, 7, 8]
    res = r.execute(StepPlan(0, [ScheduledSeq("h", prompt, 0, [80], True, GREEDY, 0, num_propose=3)]))
    t = res.sampled_token_ids[0]
    assert r.history.tokens("h").tolist() == [*prompt, t]
    assert res.draft_token_ids["h"] == ngram_lookup(np.array([*prompt, t]), 1, 3, 3)
    r.execute(StepPlan(1, [], forget=["h"]))
    assert r.history.length("h") == 0


def test_ngram_speculation_gives_the_tokens_of_plain_decoding(ngram_runner):
    g = torch.Generator().manual_seed(2)
    base = torch.randint(3, 10000, (12,), generator=g).tolist()
    prompts = [base * 3, torch.randint(3, 10000, (30,), generator=g).tolist(), base[:5] * 2]
    for sp in (GREEDY, SamplingParams(temperature=0.25, seed=3)):  # sampled: few drafts, any kept exact
        ref = generate(ngram_runner, prompts, 24, sp)
        run = spec_run(ngram_runner, prompts, 24, 4, sp, chunk=16)
        assert run.tokens == ref
    # greedy dummy weights repeat their tokens: prompt lookup finds them
    run = spec_run(ngram_runner, prompts, 24, 4)
    assert run.num_accepted > 0 and run.acceptance_length > 1.5
    assert len(ngram_runner.history) == 0  # the driver's last plan forgot every request



def test_drafts_stop_before_max_model_len_and_at_an_invalid_id():
    """`spec.step.propose` cuts a proposal to what the next seq can hold: [emitted[-1], drafts]
    ends before max_model_len; an id outside the vocabulary ends the drafts."""
    from services.worker.spec.base import Proposal, Proposer, ProposeRequest
    from services.worker.spec.step import DraftProbs, propose

    class Four(Proposer):
        def propose(self, requests, view):
            return Proposal([[5, 6, 7, 8], [5, 99, 7, 8], [1, 2, 3, 4]])

    def req(rid, next_pos):
        return ProposeRequest(rid, 0, [3], next_pos, 0, 4, [0], GREEDY, 1)

    out = propose(Four(), [req("a", 509), req("b", 10), req("c", 511)], None, 50, 512, DraftProbs())
    assert out == {"a": [5, 6], "b": [5], "c": []}
