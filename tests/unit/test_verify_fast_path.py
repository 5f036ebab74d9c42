"""The greedy fast path of verification (`spec.step.verify_drafts` with `FAST_VERIFY`,
`verify.plain_greedy` / `verify.accept_greedy`, docs/ARCHITECTURE.md §5.5) against the full
path (per-position rows, the sampler, `accept_point_mass`) and against the acceptance rule
written out from the argmax of each row: the same tokens and counts on random logits with
random drafts (full, partial and no acceptance, k = 0 rows mixed in), and every request
that uses a processor, a seed or logprobs still takes the full path."""

from __future__ import annotations

import random

import pytest
import torch

from services.worker.sampler import Sampler
from services.worker.spec import step as spec_step
from services.worker.spec import verify
from services.worker.spec.step import DraftProbs, verify_drafts
from shared.protocol import SamplingParams, ScheduledSeq

V = 50
GREEDY = SamplingParams(temperature=0.0)


def _batch(rng: random.Random, logits_rows: list[torch.Tensor], n: int, sampling=lambda j: GREEDY):
    """n verify seqs with random k (0..5, zeros included) whose drafts follow the argmax of
    their rows for a random number of positions, then go wrong (or a random draft).
    Returns (seqs, logits [sum(k + 1), V])."""
    seqs = []
    for j in range(n):
        k = rng.choice([0, 0, 1, 2, 3, 4, 5])
        rows = torch.randn(k + 1, V, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        top = rows.argmax(-1).tolist()
        good = rng.randint(0, k)  # drafts 1..good are the argmax of their position
        drafts = [top[i] if i < good else (top[i] + 1 + rng.randrange(V - 1)) % V for i in range(k)]
        if rng.random() < 0.2:
            drafts = [rng.randrange(V) for _ in range(k)]
        logits_rows.append(rows)
        seqs.append(ScheduledSeq(f"r{j}", [rng.randrange(V), *drafts], 10 + j, [0, 1, 2], True, sampling(j),
                                 output_index=rng.randrange(5), num_draft=k))
    return seqs, torch.cat(logits_rows)


def _expected(seqs: list[ScheduledSeq], logits: torch.Tensor) -> list[list[int]]:
    """Greedy point-mass acceptance, written out: drafts while each is its row's argmax, then
    the argmax of the first row that differs (or of the last row)."""
    top = logits.argmax(-1).tolist()
    out, a = [], 0
    for s in seqs:
        k = s.num_draft
        drafts = s.token_ids[1:]
        n = 0
        while n < k and drafts[n] == top[a + n]:
            n += 1
        out.append(drafts[:n] + [top[a + n]])
        a += k + 1
    return out


def _run(monkeypatch, fast: bool, seqs, logits):
    monkeypatch.setattr(spec_step, "FAST_VERIFY", fast)
    return verify_drafts(Sampler(default_seed=7), logits, seqs, DraftProbs())


@pytest.mark.parametrize("seed", range(6))
def test_fast_greedy_verification_gives_the_full_paths_tokens_and_counts(monkeypatch, seed):
    rng = random.Random(seed)
    seqs, logits = _batch(rng, [], rng.choice([1, 3, 16, 33]))
    full = _run(monkeypatch, False, seqs, logits)
    calls = []
    real = verify.expand_rows
    monkeypatch.setattr(verify, "expand_rows", lambda s: calls.append(1) or real(s))
    fast = _run(monkeypatch, True, seqs, logits)
    assert not calls  # the fast path ran: no per-position rows
    want = _expected(seqs, logits)
    assert fast.tokens == full.tokens == want
    assert [len(t) for t in fast.tokens] == [len(t) for t in want]
    assert fast.logprobs == full.logprobs == [None] * len(seqs)
    if len(seqs) >= 16:
        assert len({len(t) for t in want}) > 2  # the batch mixes acceptance lengths


def test_partial_acceptance_and_plain_rows_in_one_step(monkeypatch):
    logits = torch.full((7, V), -1.0)
    for r, t in enumerate([3, 4, 5, 6, 8, 9, 10]):
        logits[r, t] = 1.0
    seqs = [ScheduledSeq("a", [1, 3, 4, 7], 5, [0], True, GREEDY, num_draft=3),  # rows 0-3: accepts 3, 4; 7 != 5
            ScheduledSeq("b", [2], 9, [1], True, GREEDY),  # row 4: plain decode
            ScheduledSeq("c", [2, 9], 9, [2], True, GREEDY, num_draft=1)]  # rows 5-6: accepts 9, bonus 10
    for fast in (True, False):
        assert _run(monkeypatch, fast, seqs, logits).tokens == [[3, 4, 5], [8], [9, 10]]


@pytest.mark.parametrize("special", [
    {"sampling": SamplingParams(temperature=0.8, seed=3)},
    {"sampling": SamplingParams(temperature=0.0, logprobs=2)},
    {"sampling": SamplingParams(temperature=0.0, repetition_penalty=1.3), "penalty_token_ids": [1, 2, 3]},
    {"sampling": SamplingParams(temperature=0.0, frequency_penalty=0.5), "penalty_token_ids": [4]},
    {"sampling": SamplingParams(temperature=0.0, logit_bias={5: 3.0})},
    {"sampling": SamplingParams(temperature=0.0, min_tokens=10)},
    {"sampling": GREEDY, "allowed_token_bitmask": b"\xff\xff\xff\xff\xff\xff\x03\x00" * 3},
])
def test_any_processor_seed_or_logprobs_takes_the_full_path(monkeypatch, special):
    rng = random.Random(11)
    seqs, logits = _batch(rng, [], 8)
    seqs.append(ScheduledSeq("x", [1, 2, 3], 40, [0, 1, 2], True, special["sampling"], output_index=2, num_draft=2,
                             penalty_token_ids=special.get("penalty_token_ids", []),
                             allowed_token_bitmask=special.get("allowed_token_bitmask")))
    logits = torch.cat([logits, torch.randn(3, V, generator=torch.Generator().manual_seed(5))])
    assert not verify.plain_greedy(seqs)
    full = _run(monkeypatch, False, seqs, logits)
    fast = _run(monkeypatch, True, seqs, logits)
    assert fast.tokens == full.tokens and fast.logprobs == full.logprobs
    if special["sampling"].logprobs is not None:
        assert fast.logprobs[-1] is not None and len(fast.logprobs[-1]) == len(fast.tokens[-1])


def test_kept_draft_distributions_go_to_rejection_sampling_not_the_fast_path(monkeypatch):
    seqs = [ScheduledSeq("q", [1, 2, 3], 4, [0], True, GREEDY, num_draft=2)]
    store = DraftProbs()
    store.keep("q", 5, [2, 3], torch.full((2, V), 1.0 / V))
    calls = []
    monkeypatch.setattr(verify, "verify_probabilistic",
                        lambda t, s, st, q, **kw: calls.append(len(q)) or verify.accept_point_mass(
                            s, st, t.argmax(-1).tolist()))
    monkeypatch.setattr(spec_step, "FAST_VERIFY", True)
    verify_drafts(Sampler(), torch.randn(3, V), seqs, store)
    assert calls == [1]
