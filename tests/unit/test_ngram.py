"""N-gram prompt lookup (shared/ngram.py) and the engine's drafter (services/engine/
ngram_drafts.py; docs/ARCHITECTURE.md §5.5). The lookup, stateless and incremental, is
checked against a brute-force search written out here from the rule (longest n first, most
recent earlier occurrence), and n-gram speculation through the runner (CPU, dummy
tiny-Qwen3 weights, the drafts looked up as the engine does) against plain decoding."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from benchmarks.common import model_dir
from services.engine.ngram_drafts import NgramDrafter
from services.engine.request import Request
from services.worker.model_runner import ModelRunner
from shared.config import build_config
from shared.ngram import NgramIndex, ngram_lookup
from shared.protocol import SamplingParams
from tests.runner_driver import generate, spec_run

GREEDY = SamplingParams(temperature=0.0)
UNKNOWN = -1  # a position never seen: matches nothing, stops the drafts


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
        if trial % 7 == 0:  # positions never seen (negative ids)
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


@pytest.mark.parametrize("vocab", [2, 3, 7, 50])
def test_the_incremental_index_equals_the_brute_force_search_after_every_append(vocab):
    """A context that grows by 1-5 tokens at a time (a decode, a verify's accepted drafts, a
    prefill chunk): after every append, `NgramIndex.lookup` gives what the exhaustive search
    of the whole context gives, for random n ranges and k."""
    rng = np.random.default_rng(100 + vocab)
    for trial in range(60):
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        idx = NgramIndex(lo, hi)
        ctx: list[int] = []
        for _ in range(40):
            ctx += rng.integers(0, vocab, int(rng.choice([1, 1, 1, 2, 5]))).tolist()
            k = int(rng.integers(0, 6))
            got = idx.lookup(lambda a, b, c=ctx: c[a:b], len(ctx), k)
            assert got == _brute(ctx, lo, hi, k), (trial, ctx, lo, hi, k)


def test_the_index_skips_lookups_it_was_not_asked_for():
    """Appends between two lookups (a request not looked up for a while) are indexed at the
    next one, in order: the most recent occurrence still wins."""
    idx = NgramIndex(2, 2)
    ctx = [1, 2, 3]
    assert idx.lookup(lambda a, b: ctx[a:b], 3, 2) == []
    ctx += [1, 2, 4, 9, 1, 2]  # "1 2" now followed by 3 (first) and 4 (later)
    assert idx.lookup(lambda a, b: ctx[a:b], len(ctx), 2) == [4, 9] == _brute(ctx, 2, 2, 2)
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


def test_the_engine_drafter_looks_up_a_requests_prompt_and_outputs():
    """`NgramDrafter.propose` over a `Request`: prompt and outputs as one context, the
    index kept on the request (`drafter_state`) and brought up to date as outputs arrive."""
    req = Request("q", b"fe", [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=10))
    d = NgramDrafter(1, 3)
    assert d.propose(req, 3) == [7, 8, 5] == _brute(req.prompt_token_ids, 1, 3, 3)
    assert isinstance(req.drafter_state, NgramIndex)
    req.output_token_ids += [7, 8]  # "5 6 7 8" then "5 6 7 8": the latest "6 7 8" is at 1..3
    whole = req.prompt_token_ids + req.output_token_ids
    assert d.propose(req, 4) == _brute(whole, 1, 3, 4) == [5, 6, 7, 8]


def test_sparse_lookups_far_behind_search_statelessly_and_step_after_step_ones_catch_up():
    """`NgramDrafter.propose` on a request whose index lags far behind (its first lookup, or
    one long after its last: a probe every 16-256 steps): the stateless search, the index
    left as it was; a lookup a step later brings the index up to date, and from then on it
    adds the new tokens only. Every answer equals the brute-force search over prompt +
    outputs."""
    rng = np.random.default_rng(3)
    req = Request("q", b"fe", [int(t) for t in rng.integers(0, 12, 40)], SamplingParams(max_tokens=400))
    d = NgramDrafter(2, 4)

    def check():
        assert d.propose(req, 4) == _brute(req.prompt_token_ids + req.output_token_ids, 2, 4, 4)

    check()  # its first lookup, 40 tokens behind
    idx = req.drafter_state
    assert idx.indexed == 0
    req.output_token_ids += [int(t) for t in rng.integers(0, 12, 60)]  # 60 steps without a lookup
    check()
    assert idx.indexed == 0  # sparse and far behind: stateless
    for _ in range(6):  # step after step: the index catches up, then grows by the new tokens
        req.output_token_ids += [int(t) for t in rng.integers(0, 12, 2)]
        check()
        assert idx.indexed == req.num_tokens - 1


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


def test_the_runner_has_no_ngram_proposer_and_reports_the_drafts_as_the_engines(ngram_runner):
    r = ngram_runner
    assert r.proposer is None and r.draft_kv is None
    rep = r.report()["speculative"]
    assert rep["method"] == "ngram" and rep["drafts"] == "engine" and rep["num_speculative_tokens"] == 4


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
