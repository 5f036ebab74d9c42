"""Helpers of the rejection-sampling tests (tests/unit/test_rejection_sampling.py, the
interpreter check, tests/gpu/test_rejection_sampling_gpu.py): a chi-square goodness-of-fit
test written out here (scipy is not installed), and the near-tie check that explains a
difference between the Triton kernel and the torch reference.
"""

from __future__ import annotations

import math

import torch

from kernels.sampling_noise import race_noise


def _lower_gamma_series(a: float, x: float) -> float:
    """Regularized lower incomplete gamma P(a, x) by its power series (x < a + 1)."""
    term = total = 1.0 / a
    n = a
    for _ in range(10000):
        n += 1.0
        term *= x / n
        total += term
        if abs(term) < abs(total) * 1e-15:
            break
    return total * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _upper_gamma_fraction(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x) by its continued fraction (x >= a + 1),
    evaluated with the modified Lentz method."""
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h * math.exp(-x + a * math.log(x) - math.lgamma(a))


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X chi-square with df degrees of freedom: Q(df / 2, stat / 2)."""
    if stat <= 0:
        return 1.0
    a, x = df / 2.0, stat / 2.0
    if x < a + 1.0:
        return 1.0 - _lower_gamma_series(a, x)
    return _upper_gamma_fraction(a, x)


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's goodness-of-fit of observed `counts` [V] against `probs` [V] (sums to 1).

    Bins of zero probability must be empty (else the p-value is 0). Bins with an expected
    count below `min_expected` are pooled into one (the usual validity rule). Returns
    (statistic, degrees of freedom, p-value)."""
    counts = counts.double()
    probs = probs.double() / probs.double().sum()
    n = float(counts.sum())
    if bool((counts[probs == 0] > 0).any()):
        return math.inf, 0, 0.0
    exp = probs * n
    big = exp >= min_expected
    obs_b, exp_b = counts[big].tolist(), exp[big].tolist()
    small = (~big) & (probs > 0)
    if bool(small.any()):
        obs_b.append(float(counts[small].sum()))
        exp_b.append(float(exp[small].sum()))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs_b, exp_b))
    df = len(obs_b) - 1
    return stat, df, (chi2_sf(stat, df) if df > 0 else 1.0)


def _residual_score(res: torch.Tensor, g: torch.Tensor, v: int) -> float:
    """The recovered draw's score of token v: log(p - q) + G, -inf where p <= q."""
    return math.log(float(res[v])) + float(g[v]) if res[v] > 0 else -math.inf


def unexplained_mismatches(logits: torch.Tensor, temperature: torch.Tensor, draft_ids: torch.Tensor,
                           q: torch.Tensor, q_index: torch.Tensor, keys: torch.Tensor, u: torch.Tensor,
                           ref: tuple[torch.Tensor, torch.Tensor], got: tuple[torch.Tensor, torch.Tensor],
                           rel: float = 1e-4) -> list[int]:
    """Rows where `got` (tokens, accepted) differs from `ref` and the difference is not a
    near-tie of the float math (kernels/rejection_sampling.py, module doc), recomputed here in
    fp64 on the CPU: an accept test with u * q(d) within `rel` (relative) of p(d), or two
    tokens whose scores (logit for greedy rows, logit / T + G for bonus rows, log(p - q) + G
    for recovered tokens) are within `rel` of each other, or a recovered token whose p - q is
    within `rel` * p of zero (cancellation). Arguments as `rejection_sample_ref`."""
    bad = []
    logits, temperature, draft_ids = logits.cpu().double(), temperature.cpu(), draft_ids.cpu()
    q, q_index, keys, u = q.cpu().double(), q_index.cpu(), keys.cpu(), u.cpu().double()
    rt, ra = (t.cpu() for t in ref)
    gt, ga = (t.cpu() for t in got)
    vocab = logits.shape[1]
    for r in (rt != gt).logical_or(ra != ga).nonzero().flatten().tolist():
        t, d = float(temperature[r]), int(draft_ids[r])
        a, b = int(rt[r]), int(gt[r])
        if t == 0:
            x = logits[r]
            ok = bool(ra[r] == ga[r]) and abs(float(x[a] - x[b])) <= rel * (1 + abs(float(x[a])))
        elif d < 0:
            s = logits[r] / t + race_noise(keys[r:r + 1, :2], vocab)[0].double()
            ok = abs(float(s[a] - s[b])) <= rel * (1 + abs(float(s[a])))
        else:
            p = torch.softmax(logits[r] / t, dim=-1)
            qr = q[int(q_index[r])]
            lhs, rhs = float(u[r] * qr[d]), float(p[d])
            if bool(ra[r] != ga[r]):
                ok = abs(lhs - rhs) <= rel * max(lhs, rhs)
            else:
                g = race_noise(keys[r:r + 1, 2:], vocab)[0].double()
                res = p - qr
                sa, sb = (_residual_score(res, g, v) for v in (a, b))
                near_zero = any(abs(float(res[v])) <= rel * float(p[v]) for v in (a, b))
                ok = near_zero or abs(sa - sb) <= rel * (1 + abs(sa))
        if not ok:
            bad.append(r)
    return bad
