"""Probabilistic verification (services/worker/spec/verify.py `verify_probabilistic`,
kernels/rejection_sampling.py) against its independent truths:

- losslessness (Leviathan et al. 2023, arXiv 2211.17192, Theorem 1): the emitted tokens are
  distributed as the target's filtered distribution p (temperature, top-k, top-p, min-p,
  computed here in fp64 from their definitions), whatever the draft distribution q. Pearson
  chi-square over many seeded draws on a 12-token vocabulary, one seed per draw; the test
  fails when the p-value is below ALPHA = 1e-4. The draws are seeded, so each test's outcome
  is fixed (no flake); each case also shows the test has power: the same counts against a
  wrong distribution (q, or p without its filter) give a p-value below 1e-12.
- the acceptance rate of the first draft against its closed form sum_v min(p_v, q_v) (a
  binomial z-test, |z| < 4.5);
- point-mass verification (`accept_point_mass`) emits p as well, and accepts d with
  probability p(d);
- the bonus token is the ordinary sampler's draw at its output index (decoding without
  speculation), greedy rows follow the argmax, and outcomes depend only on (seed,
  output_index, logits, q, drafts): the same in any batch and on every run.
"""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from services.worker.sampler import Sampler
from services.worker.spec.verify import accept_point_mass, expand_rows, verify_probabilistic
from shared.protocol import SamplingParams, ScheduledSeq
from tests.rejection_helpers import chi_square

ALPHA = 1e-4  # chi-square significance level: a p-value below it fails the test
POWER = 1e-12  # the same counts against a wrong distribution must fall below this
V = 12
NEG = float("-inf")


def truth(logits: torch.Tensor, t: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The target distribution of one row in fp64, from the filters' definitions
    (kernels/sampling.py: temperature, then top-k, top-p on what top-k kept, min-p)."""
    p = torch.softmax(logits.double() / t, dim=-1)
    if top_k:
        p = torch.where(p >= p.sort(descending=True).values[top_k - 1], p, 0.0)
    if top_p < 1.0:
        s, order = p.sort(descending=True)
        before = s.cumsum(0) - s
        keep = torch.zeros_like(p, dtype=torch.bool)
        keep[order] = before < top_p * s.sum()
        p = torch.where(keep, p, 0.0)
    if min_p:
        p = torch.where(p >= min_p * p.max(), p, 0.0)
    return p / p.sum()


def make_seqs(drafts: torch.Tensor, params: SamplingParams, seed0: int, output_index: int = 3) -> list[ScheduledSeq]:
    """One verify seq per row of drafts [n, k], seeds seed0 + m."""
    k = drafts.shape[1]
    return [ScheduledSeq(request_id=f"r{m}", token_ids=[1] + row, start_pos=20, block_table=[], sample=True,
                         sampling=msgspec.structs.replace(params, seed=seed0 + m), output_index=output_index,
                         num_draft=k)
            for m, row in enumerate(drafts.tolist())]


def run(pos_logits: torch.Tensor, q: torch.Tensor, params: SamplingParams, n: int, seed0: int):
    """n seqs whose drafts are drawn from q [k, V] (a torch generator, independent of the
    verifier's hashed noise); every seq's target rows are pos_logits [k + 1, V].
    Returns (drafts [n, k], VerifyOutput)."""
    gen = torch.Generator().manual_seed(seed0)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).T.contiguous()
    seqs = make_seqs(drafts, params, seed0)
    _, starts = expand_rows(seqs)
    out = verify_probabilistic(pos_logits.repeat(n, 1), seqs, starts, [q] * n)
    return drafts, out


def check_fit(counts: torch.Tensor, p: torch.Tensor, wrong: torch.Tensor | None, what: str) -> None:
    stat, df, pv = chi_square(counts, p)
    assert pv >= ALPHA, f"{what}: chi-square {stat:.1f} on {df} df, p-value {pv:.2e} < {ALPHA}"
    if wrong is not None:
        assert chi_square(counts, wrong)[2] < POWER, f"{what}: the test cannot tell p from a wrong distribution"


def check_lossless(pos_logits, q, params, n, seed0, filt=None):
    """First emitted token ~ p_1, second ~ p_2 given the first draft was accepted, third ~
    p_3 given both were (k = 2), and the first acceptance rate = sum min(p_1, q_1)."""
    filt = filt or {}
    k = q.shape[0]
    ps = [truth(pos_logits[i], params.temperature, **filt) for i in range(k + 1)]
    drafts, out = run(pos_logits, q, params, n, seed0)
    toks = out.tokens
    assert all(1 <= len(t) <= k + 1 for t in toks)
    for m, t in enumerate(toks):  # accepted tokens are the drafts, in order
        assert t[:-1] == drafts[m, :len(t) - 1].tolist()
    first = torch.bincount(torch.tensor([t[0] for t in toks]), minlength=V)
    check_fit(first, ps[0], q[0].double(), "first token")
    rate = sum(len(t) > 1 for t in toks) / n
    want = float(torch.minimum(ps[0], q[0].double()).sum())
    z = (rate - want) / math.sqrt(max(want * (1 - want), 1e-12) / n)
    assert abs(z) < 4.5, f"first acceptance rate {rate:.4f}, expected {want:.4f} (z = {z:.1f})"
    for i in range(1, k + 1):
        later = [t[i] for t in toks if len(t) > i]
        assert len(later) > 1000, f"too few seqs reached position {i} for the test"
        check_fit(torch.bincount(torch.tensor(later), minlength=V), ps[i], None, f"token {i + 1}")
    return out


def _logits(seed: int, rows: int, scale: float = 1.5) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * scale


def test_chi_square_helper_matches_tables():
    from tests.rejection_helpers import chi2_sf
    for stat, df, pv in ((3.841459, 1, 0.05), (11.0705, 5, 0.05), (23.2093, 10, 0.01), (37.3668, 11, 1e-4)):
        assert abs(chi2_sf(stat, df) - pv) < 1e-3 * pv


def test_lossless_against_a_far_draft():
    lg = _logits(1, 3)
    q = torch.softmax(-lg[:2] * 1.2, dim=-1)  # anti-correlated with p: most mass where p has little
    check_lossless(lg, q, SamplingParams(temperature=1.0), 30000, 1000)


def test_lossless_with_zeros_on_either_side():
    lg = _logits(2, 3)
    lg[:, [0, 1]] = NEG  # p is 0 on tokens 0 and 1 (a mask), where q has mass
    q = torch.softmax(_logits(3, 2), dim=-1)
    q[:, [0, 1]] += 0.3
    q[:, [5, 6, 7]] = 0.0  # q is 0 where p is not
    q = q / q.sum(-1, keepdim=True)
    out = check_lossless(lg, q, SamplingParams(temperature=1.0), 30000, 50000)
    assert not any(x in (0, 1) for t in out.tokens for x in t)


@pytest.mark.parametrize("t", [0.6, 1.7])
def test_lossless_at_other_temperatures(t):
    lg = _logits(4, 3)
    q = 0.3 / V + 0.7 * torch.softmax(lg[:2] / 0.5, dim=-1).roll(3, dims=-1)  # peaked on the wrong tokens
    check_lossless(lg, q, SamplingParams(temperature=t), 30000, 90000 + int(t * 10))


def test_lossless_with_top_k():
    lg = _logits(5, 3)
    q = torch.full((2, V), 1.0 / V)  # uniform: half its mass outside the top 5
    params = SamplingParams(temperature=0.8, top_k=5)
    out = check_lossless(lg, q, params, 30000, 130000, {"top_k": 5})
    wrong = truth(lg[0], 0.8)  # the same counts against p without top-k
    first = torch.bincount(torch.tensor([t[0] for t in out.tokens]), minlength=V)
    assert chi_square(first, wrong)[2] < POWER


def test_lossless_with_top_p_and_min_p():
    lg = _logits(6, 3)
    q = 0.5 / V + 0.5 * torch.softmax(_logits(7, 2), dim=-1)
    check_lossless(lg, q, SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05), 30000, 170000,
                   {"top_p": 0.8, "min_p": 0.05})


@pytest.mark.parametrize("k", [1, 8])
def test_lossless_with_one_and_eight_drafts(k):
    lg = _logits(8 + k, k + 1)
    q = torch.softmax(_logits(20 + k, k), dim=-1)
    n = 20000 if k == 1 else 12000
    ps = [truth(lg[i], 1.0) for i in range(k + 1)]
    drafts, out = run(lg, q, SamplingParams(temperature=1.0), n, 210000 + k)
    first = torch.bincount(torch.tensor([t[0] for t in out.tokens]), minlength=V)
    check_fit(first, ps[0], q[0].double(), f"k={k} first token")
    assert max(len(t) for t in out.tokens) <= k + 1 and out.last_rows == [
        m * (k + 1) + len(t) - 1 for m, t in enumerate(out.tokens)]
    if k == 1:  # the bonus token, given the draft was accepted
        later = [t[1] for t in out.tokens if len(t) > 1]
        check_fit(torch.bincount(torch.tensor(later), minlength=V), ps[1], None, "bonus token")


def test_point_mass_verification_emits_p():
    """accept_point_mass over the ordinary sampler's draws: first token ~ p_1, draft
    accepted with probability p_1(d), second token ~ p_2 given acceptance."""
    lg = _logits(30, 2)
    params = SamplingParams(temperature=0.9)
    p1, p2 = truth(lg[0], 0.9), truth(lg[1], 0.9)
    d = int(p1.argsort()[-3])  # a draft of middling probability
    n = 30000
    seqs = make_seqs(torch.full((n, 1), d), params, 300000)
    rows, starts = expand_rows(seqs)
    drawn = Sampler().sample(lg.repeat(n, 1), rows).token_ids
    out = accept_point_mass(seqs, starts, drawn)
    first = torch.bincount(torch.tensor([t[0] for t in out.tokens]), minlength=V)
    check_fit(first, p1, torch.softmax(lg[0].double(), -1), "point mass first token")
    rate = sum(len(t) > 1 for t in out.tokens) / n
    pd = float(p1[d])
    assert abs(rate - pd) < 4.5 * math.sqrt(pd * (1 - pd) / n)
    later = [t[1] for t in out.tokens if len(t) > 1]
    check_fit(torch.bincount(torch.tensor(later), minlength=V), p2, None, "point mass second token")
    # a one-hot q through rejection sampling: the same acceptance probability p(d)
    _, out_q = run(lg, torch.nn.functional.one_hot(torch.tensor([d]), V).float(), params, n, 400000)
    rate_q = sum(len(t) > 1 for t in out_q.tokens) / n
    assert abs(rate_q - pd) < 4.5 * math.sqrt(pd * (1 - pd) / n)


# ---------------------------------------------------------------- exact properties


def test_rejection_keys_are_the_sampler_keys_and_their_streams():
    from kernels.rejection_sampling import ACCEPT_STREAM, RECOVER_STREAM, rejection_keys
    from kernels.sampling_noise import mix_seed, noise_keys
    seeds = [0, 1, -5, (1 << 64) - 1, 1 << 70, 123456789]
    idx = [0, 7, 3, 1000, 2, 1 << 20]
    keys, u = rejection_keys(seeds, idx)
    row = [mix_seed(s, i) for s, i in zip(seeds, idx)]
    assert torch.equal(keys[:, :2], noise_keys(row))
    assert torch.equal(keys[:, 2:], noise_keys([mix_seed(k, RECOVER_STREAM) for k in row]))
    acc = noise_keys([mix_seed(k, ACCEPT_STREAM) for k in row])
    assert not torch.equal(acc, keys[:, 2:]) and bool(((u >= 0) & (u < 1)).all())
    assert bool((u * 16777216.0 == (u * 16777216.0).round()).all())  # the 2**-24 grid


def _mixed_batch(seed0: int):
    """40 seqs: k = 0..4, greedy and sampled, with and without filters; target rows and q random."""
    gen = torch.Generator().manual_seed(seed0)
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
             SamplingParams(temperature=1.2, top_p=0.7, min_p=0.02)]
    seqs, qs = [], []
    for m in range(40):
        k = m % 5
        q = torch.softmax(torch.randn(k, V, generator=gen) * 2, dim=-1)
        d = torch.multinomial(q, 1, generator=gen).flatten().tolist() if k else []
        params = msgspec.structs.replace(kinds[m % 4], seed=seed0 * 100 + m)
        seqs.append(ScheduledSeq(request_id=f"s{m}", token_ids=[2] + d, start_pos=9, block_table=[], sample=True,
                                 sampling=params, output_index=m % 3, num_draft=k))
        qs.append(q if k else None)
    _, starts = expand_rows(seqs)
    logits = torch.randn(starts[-1], V, generator=gen) * 2
    return seqs, starts, logits, qs


def test_same_seeds_same_outputs_in_any_batch():
    seqs, starts, logits, qs = _mixed_batch(3)
    a = verify_probabilistic(logits, seqs, starts, qs)
    assert a.tokens == verify_probabilistic(logits.clone(), seqs, starts, qs).tokens
    for j in (0, 6, 13, 39):  # alone, each seq gets what it got in the batch
        s = seqs[j]
        one = verify_probabilistic(logits[starts[j]:starts[j + 1]], [s], [0, s.num_draft + 1], [qs[j]])
        assert one.tokens == [a.tokens[j]] and one.last_rows == [a.last_rows[j] - starts[j]]
    reseeded = [msgspec.structs.replace(s, sampling=msgspec.structs.replace(s.sampling, seed=s.sampling.seed + 1))
                for s in seqs]
    b = verify_probabilistic(logits, reseeded, starts, qs)
    sampled = [j for j, s in enumerate(seqs) if s.sampling.temperature > 0]
    assert any(a.tokens[j] != b.tokens[j] for j in sampled)
    assert all(a.tokens[j] == b.tokens[j] for j in range(len(seqs)) if j not in sampled)  # greedy


def test_all_accepted_when_p_equals_q_and_the_bonus_is_the_ordinary_draw():
    """q = p at every position (k = 8): every draft is accepted, and the bonus token is the
    token the ordinary sampler draws at output_index + 8, i.e. decoding without speculation."""
    k, n = 8, 600
    for params, filt in ((SamplingParams(temperature=1.0), {}), (SamplingParams(temperature=0.7, top_k=4), {"top_k": 4})):
        lg = _logits(40, k + 1)
        q = torch.stack([truth(lg[i], params.temperature, **filt) for i in range(k)]).float()
        drafts, out = run(lg, q, params, n, 500000)
        assert all(len(t) == k + 1 for t in out.tokens)
        seqs = make_seqs(drafts, params, 500000)
        rows, _ = expand_rows(seqs)
        drawn = Sampler().sample(lg.repeat(n, 1), rows).token_ids
        assert [t[k] for t in out.tokens] == drawn[k::k + 1]
    # seqs without drafts get the ordinary draw itself
    plain = make_seqs(torch.zeros((50, 0), dtype=torch.long), SamplingParams(temperature=0.9, top_p=0.9), 7)
    rows, starts = expand_rows(plain)
    lg = _logits(41, 50)
    assert [t[0] for t in verify_probabilistic(lg, plain, starts, [None] * 50).tokens] == \
        Sampler().sample(lg, rows).token_ids


def test_draft_of_zero_draft_probability():
    """q(d) = 0 (probability rounding in the drafter): accepted whenever p(d) > 0; never when
    p(d) = 0, and then the recovered token comes from max(0, p - q), or from p when p = q
    up to rounding (the residual is then float noise: RESIDUAL_EPS)."""
    lg = _logits(50, 2)
    lg[0, 4] = NEG
    p1 = truth(lg[0], 1.0)
    n = 4000
    q = p1.float().clone()[None]
    q[0, 3] = 0.0  # q(3) = 0 < p(3)
    params = SamplingParams(temperature=1.0)
    for d, accepted in ((3, True), (4, False)):
        seqs = make_seqs(torch.full((n, 1), d), params, 600000 + d)
        _, starts = expand_rows(seqs)
        out = verify_probabilistic(lg.repeat(n, 1), seqs, starts, [q] * n)
        assert all((len(t) == 2) == accepted for t in out.tokens)
        if not accepted:  # residual max(0, p - q) is p's mass on token 3 only
            assert all(t == [3] for t in out.tokens)
    # p = q exactly (both 0 at d = 4): no token has p > q, so the draw is from p
    seqs = make_seqs(torch.full((n, 1), 4), params, 700000)
    _, starts = expand_rows(seqs)
    qq = truth(lg[0], 1.0).float()[None]
    out = verify_probabilistic(lg.repeat(n, 1), seqs, starts, [qq] * n)
    assert all(len(t) == 1 for t in out.tokens)
    first = torch.bincount(torch.tensor([t[0] for t in out.tokens]), minlength=V)
    check_fit(first, p1, None, "draw from p after a q(d) = p(d) = 0 rejection")


def test_greedy_rows_follow_the_argmax():
    lg = _logits(60, 5)
    lg[2, [3, 8]] = lg[2].max() + 1.0  # a tie at position 2: the lowest id wins
    top = [int(i) for i in lg.argmax(-1)]
    assert top[2] == 3
    cases = [top[:4], top[:2] + [(top[2] + 1) % V, top[3]], [(top[0] + 1) % V] + top[1:4]]
    seqs = [ScheduledSeq(request_id=f"g{m}", token_ids=[0] + c, start_pos=5, block_table=[], sample=True,
                         sampling=SamplingParams(temperature=0.0, seed=m), num_draft=4) for m, c in enumerate(cases)]
    _, starts = expand_rows(seqs)
    q = torch.full((4, V), 1.0 / V)
    out = verify_probabilistic(lg.repeat(3, 1), seqs, starts, [q] * 3)
    assert out.tokens == [top, top[:3], top[:1]]
    assert out.tokens == accept_point_mass(seqs, starts, top * 3).tokens


def test_logprobs_are_raw_and_errors_are_loud():
    seqs, starts, logits, qs = _mixed_batch(5)
    seqs = [msgspec.structs.replace(s, sampling=msgspec.structs.replace(s.sampling, logprobs=2 if j % 2 else None))
            for j, s in enumerate(seqs)]
    raw = logits + 0.5 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    out = verify_probabilistic(logits, seqs, starts, qs, raw_logits=raw)
    ref = torch.log_softmax(raw.double(), dim=-1)
    for j, (t, lp) in enumerate(zip(out.tokens, out.logprobs)):
        if j % 2 == 0:
            assert lp is None
            continue
        assert lp is not None and [x.token_id for x in lp] == t
        for i, x in enumerate(lp):
            assert abs(x.logprob - float(ref[starts[j] + i, t[i]])) < 1e-5 and len(x.top_ids) == 2
    assert all(lp is None for lp in verify_probabilistic(logits, seqs, starts, qs).logprobs)
    with pytest.raises(ValueError, match="draft probs"):
        verify_probabilistic(logits, seqs, starts, [q[:, :-1] if q is not None else None for q in qs])
    with pytest.raises(ValueError, match="rows"):
        verify_probabilistic(logits[1:], seqs, starts, qs)
    bad = msgspec.structs.replace(seqs[1], token_ids=[0, V + 3])
    with pytest.raises(ValueError, match="outside"):
        verify_probabilistic(logits[:2], [bad], [0, 2], [qs[1]])


def test_near_tie_check_flags_real_differences():
    """The kernel-vs-reference comparison (tests/rejection_helpers.py) is not vacuous: a
    flipped accept flag or a different token on rows far from a tie is reported."""
    from kernels.rejection_sampling import rejection_keys, rejection_sample_ref
    from tests.rejection_helpers import unexplained_mismatches
    gen = torch.Generator().manual_seed(9)
    n = 30
    logits = torch.randn(n, 50, generator=gen) * 3
    temp = torch.where(torch.arange(n) % 3 == 0, 0.0, 1.0)
    drafts = torch.where(torch.arange(n) % 3 == 1, -1, torch.randint(0, 50, (n,), generator=gen))
    q = torch.softmax(torch.randn(n, 50, generator=gen), -1)
    q_index = torch.where(drafts >= 0, torch.arange(n), -1)
    keys, u = rejection_keys(list(range(n)), [0] * n)
    args = (logits, temp, drafts, q, q_index, keys, u)
    ref = rejection_sample_ref(*args)
    assert unexplained_mismatches(*args, ref, (ref[0].clone(), ref[1].clone())) == []
    flipped = ref[1].clone()
    flipped[2] = ~flipped[2]  # a draft row: accept flag flipped
    other = ref[0].clone()
    other[0] = (other[0] + 1) % 50  # a greedy row: not the argmax
    other[1] = (other[1] + 1) % 50  # a bonus row: another token
    assert unexplained_mismatches(*args, ref, (other, flipped)) == [0, 1, 2]
