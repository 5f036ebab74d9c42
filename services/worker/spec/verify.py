"""Verification of draft tokens (docs/ARCHITECTURE.md §5.5).

A seq with `num_draft = k` has logits at its last k + 1 positions: position i (0..k) scores
the token after token_ids[-(k+1) + i], i.e. row i predicts the token at output index
output_index + i, and draft d_{i+1} = token_ids[-k + i] is the guess for it.

`expand_rows` turns each verify seq into k + 1 per-position rows, so that the sampler's
processors apply at every position exactly as they would without speculation: row i has
output_index + i (seeded draws and the min_tokens mask), penalty_token_ids extended by
d_1..d_i, and the i-th of the seq's structured-output masks.

Point-mass drafts (n-gram, greedy drafting): every row is drawn with the ordinary sampler
(argmax for greedy requests, the seeded Gumbel-max draw otherwise) and the drafts are
accepted while each equals the draw at its position; the first draw that differs (or the
draw after the last draft) is the recovered (bonus) token. For a point-mass draft q = δ(d)
this is exactly rejection sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al.
2023, arXiv 2302.01318): the draft is accepted with probability p(d) = min(1, p(d)/q(d)),
and on rejection the draw is distributed as p with d removed, renormalised, which is
norm(max(0, p - q)). Because each draw depends only on (seed, output index, logits), the
emitted tokens are the very tokens decoding without speculation draws: greedy and seeded
output are identical with and without it.

Draft distributions q (probabilistic drafting): `verify_probabilistic`, rejection sampling
with recovered and bonus tokens (kernels/rejection_sampling.py): d is accepted with
probability min(1, p(d)/q(d)) by a uniform hashed from (seed, output index) on a stream of
its own, the first rejection emits a recovered token drawn from norm(max(0, p - q)) (its own
Gumbel stream), and after k acceptances the bonus token is the ordinary seeded draw. The
emitted tokens are distributed exactly as without speculation, but are not the same tokens
once a draft is rejected (the accept test and the recovered draw use their own noise);
greedy requests get the point-mass tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch

from kernels.rejection_sampling import rejection_keys, rejection_sample, restrict_to_filtered
from services.worker.sampler import make_token_logprobs
from shared.protocol import SamplingParams, ScheduledSeq, TokenLogprob


def mask_bytes(seq: ScheduledSeq, i: int) -> bytes | None:
    """The i-th of a verify seq's back-to-back structured-output masks (None without)."""
    b = seq.allowed_token_bitmask
    if b is None or seq.num_draft == 0:
        return b
    n = len(b) // (seq.num_draft + 1)
    return b[i * n:(i + 1) * n]


def expand_rows(seqs: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[int]]:
    """Per-position rows of sampled seqs (module doc): seqs without drafts stay one row
    each (the same object). Returns (rows, starts): starts[j] is seq j's first row, and
    starts[-1] = len(rows). Raises ValueError when a mask does not split into num_draft + 1."""
    rows: list[ScheduledSeq] = []
    starts = [0]
    for s in seqs:
        k = s.num_draft
        if k == 0:
            rows.append(s)
        else:
            b = s.allowed_token_bitmask
            if b is not None and len(b) % (k + 1):
                raise ValueError(f"request {s.request_id}: {len(b)} mask bytes do not split into {k + 1} masks")
            drafts = s.token_ids[-k:]
            pen = bool(s.penalty_token_ids)
            for i in range(k + 1):
                rows.append(msgspec.structs.replace(
                    s, output_index=s.output_index + i, num_draft=0,
                    penalty_token_ids=(s.penalty_token_ids + drafts[:i]) if pen else s.penalty_token_ids,
                    allowed_token_bitmask=mask_bytes(s, i)))
        starts.append(len(rows))
    return rows, starts


def plain_greedy(seqs: list[ScheduledSeq]) -> bool:
    """Whether every seq's rows would leave the sampler's processors idle and draw the argmax:
    greedy (temperature 0), no logit_bias, no min_tokens mask at any of its positions
    (output_index >= min_tokens), no penalties, no structured-output mask and no logprobs.
    Such seqs verify on `accept_greedy` over one argmax of their raw logits: the very
    tokens of `expand_rows` + `Sampler.sample` + `accept_point_mass` (which then runs no
    processor and takes the same argmax), without the per-position rows (§5.5)."""
    for s in seqs:
        p = s.sampling
        if (p is None or p.temperature != 0 or p.logit_bias or s.output_index < p.min_tokens
                or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
                or s.allowed_token_bitmask is not None or p.logprobs is not None):
            return False
    return True


def accept_greedy(seqs: list[ScheduledSeq], drawn: list[int]) -> list[list[int]]:
    """Point-mass acceptance (`accept_point_mass`) from the argmax of every kept row,
    `drawn` (sum(num_draft + 1) ints, seq after seq): per seq its drafts while each equals
    the draw at its position, then the first differing draw (or the bonus draw)."""
    out: list[list[int]] = []
    a = 0
    for s in seqs:
        k = s.num_draft
        n = 1
        if k:
            t = s.token_ids
            base = len(t) - k - 1  # t[base + n] is draft d_n
            while n <= k and drawn[a + n - 1] == t[base + n]:
                n += 1
        out.append(drawn[a:a + n])
        a += k + 1
    return out


@dataclass
class VerifyOutput:
    """Per sampled seq: emitted tokens (1..num_draft+1; accepted drafts then the recovered
    or bonus token), their logprobs (aligned, or None when the seq did not ask), and
    `last_rows`: for each seq the row (into the drawn rows) of its last emitted token."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprob] | None]
    last_rows: list[int]

    @property
    def num_accepted(self) -> list[int]:
        """Accepted drafts per seq (len(tokens) - 1)."""
        return [len(t) - 1 for t in self.tokens]


def accept_point_mass(seqs: list[ScheduledSeq], starts: list[int], drawn: list[int],
                      logprobs: list[TokenLogprob | None] | None = None) -> VerifyOutput:
    """Point-mass verification (module doc) of `seqs` from the per-position draws `drawn`
    (one token per row of `expand_rows`, in its order) and their logprobs (aligned, or
    None/empty when no row asked)."""
    out_t: list[list[int]] = []
    out_lp: list[list[TokenLogprob] | None] = []
    last: list[int] = []
    for j, s in enumerate(seqs):
        a, k = starts[j], s.num_draft
        drafts = s.token_ids[len(s.token_ids) - k:] if k else []
        n = 1
        while n <= k and drawn[a + n - 1] == drafts[n - 1]:
            n += 1
        out_t.append(drawn[a:a + n])
        if logprobs:
            lp = logprobs[a:a + n]
            out_lp.append(None if lp[0] is None else [x for x in lp if x is not None])
        else:
            out_lp.append(None)
        last.append(a + n - 1)
    return VerifyOutput(out_t, out_lp, last)


def verify_probabilistic(target_logits: torch.Tensor, seqs: list[ScheduledSeq], starts: list[int],
                         draft_probs: Sequence[torch.Tensor | None], *, default_seed: int = 0,
                         raw_logits: torch.Tensor | None = None) -> VerifyOutput:
    """Rejection sampling against draft distributions q (Leviathan et al. 2023, arXiv
    2211.17192; Chen et al. 2023, arXiv 2302.01318; kernels/rejection_sampling.py).

    target_logits: [rows, vocab] fp32 after the processors (`Sampler.process` over
        `expand_rows(seqs)`), rows = starts[-1]; row starts[j] + i is seq j's position i.
    seqs, starts: the sampled seqs and their first rows (`expand_rows`); a seq with
        num_draft 0 gets its ordinary draw.
    draft_probs: per seq, [num_draft, vocab] fp32 on any device: q_i, the distribution draft
        d_i was sampled from (not renormalised here); ignored (may be None) for num_draft 0.
    default_seed: the seed of requests without one (the Sampler's `default_seed`).
    raw_logits: [rows, vocab], the model's logits before the processors; when given, the
        emitted tokens of seqs that ask logprobs get raw logprobs (as `Sampler.sample`).
        Without it every logprobs entry is None and the caller computes them for the rows
        up to `last_rows` (the emitted token of row starts[j] + i is tokens[j][i]).

    Per seq: each draft d_i (i = 1..k) is accepted with probability min(1, p_i(d_i) /
    q_i(d_i)), p_i the filtered target distribution of row i - 1 (temperature, top-k,
    top-p, min-p: the ordinary sampler's), using a uniform hashed from (seed, output_index
    + i - 1) on its own stream; the first rejection emits a recovered token from
    norm(max(0, p_i - q_i)) (its own Gumbel stream) and stops; after k acceptances the
    bonus token is the ordinary seeded draw from p_{k+1}. Greedy seqs (temperature 0)
    accept while the argmax equals the draft and emit the first differing argmax (the same
    tokens as `accept_point_mass`). The emitted tokens are distributed as decoding without
    speculation (the papers' theorem); tests/unit/test_rejection_sampling.py checks it.

    Raises ValueError when rows, a draft id or a q's shape do not fit.
    """
    rows, vocab = target_logits.shape
    if rows != starts[-1] or len(starts) != len(seqs) + 1:
        raise ValueError(f"{rows} logits rows for seqs spanning {starts[-1]} rows")
    params = [s.sampling for s in seqs]
    if any(p is None for p in params):
        raise ValueError("sampling params are resolved before verification")
    x = _RowInputs.of(seqs, starts, draft_probs, vocab, default_seed)
    dev = target_logits.device
    temp_t = torch.tensor(x.temp, dtype=torch.float32)
    logits = target_logits.float()
    if x.filt:
        fp = x.filt_params
        logits = restrict_to_filtered(
            logits, torch.tensor(x.filt, device=dev), temp_t[x.filt].to(dev),
            torch.tensor([p.top_k for p in fp], dtype=torch.long, device=dev),
            torch.tensor([p.top_p for p in fp], dtype=torch.float32, device=dev),
            torch.tensor([p.min_p for p in fp], dtype=torch.float32, device=dev))
    keys, u = rejection_keys(x.seeds, x.indexes)
    q_all = torch.cat([q.to(dev, torch.float32) for q in x.qs]) if x.qs else logits.new_zeros((0, vocab))
    tokens, accepted = rejection_sample(logits, temp_t.to(dev), torch.tensor(x.drafts, device=dev), q_all,
                                        torch.tensor(x.q_index, device=dev), keys.to(dev), u.to(dev))
    tok, acc = torch.stack((tokens, accepted.long())).tolist()  # the one host sync
    out_t: list[list[int]] = []
    last: list[int] = []
    for j, s in enumerate(seqs):  # each seq's rows up to its first rejected one
        a, n = starts[j], 1
        while n <= s.num_draft and acc[a + n - 1]:
            n += 1
        out_t.append(tok[a:a + n])
        last.append(a + n - 1)
    out_lp: list[list[TokenLogprob] | None] = [None] * len(seqs)
    want = {j: p.logprobs for j, p in enumerate(params) if p is not None and p.logprobs is not None}
    if raw_logits is not None and want:
        emitted = [(starts[j] + i, t, k) for j, k in want.items() for i, t in enumerate(out_t[j])]
        idx = torch.tensor([e[0] for e in emitted], dtype=torch.long, device=raw_logits.device)
        ids = torch.tensor([e[1] for e in emitted], dtype=torch.long, device=raw_logits.device)
        made = make_token_logprobs(torch.log_softmax(raw_logits[idx].float(), dim=-1), ids, [e[2] for e in emitted])
        pos = 0
        for j in want:
            out_lp[j] = made[pos:pos + len(out_t[j])]
            pos += len(out_t[j])
    return VerifyOutput(out_t, out_lp, last)


@dataclass
class _RowInputs:
    """Host-side per-row inputs of `verify_probabilistic` (rows in `expand_rows` order):
    temperature, seed and output index of each row, the draft it verifies (-1: the bonus
    row) and its row in the concatenated q (-1: none); the sampled rows that filter and
    their params; the seqs' q tensors to concatenate."""

    temp: list[float]
    seeds: list[int]
    indexes: list[int]
    drafts: list[int]
    q_index: list[int]
    filt: list[int]
    filt_params: list[SamplingParams]
    qs: list[torch.Tensor]

    @classmethod
    def of(cls, seqs: list[ScheduledSeq], starts: list[int], draft_probs: Sequence[torch.Tensor | None],
           vocab: int, default_seed: int) -> _RowInputs:
        """Raises ValueError when a seq's rows, q shape or draft ids do not fit."""
        x = cls([], [], [], [], [], [], [], [])
        num_q = 0
        for j, s in enumerate(seqs):
            p = s.sampling
            assert p is not None
            k = s.num_draft
            if starts[j + 1] - starts[j] != k + 1:
                raise ValueError(f"request {s.request_id}: {starts[j + 1] - starts[j]} rows for {k} drafts")
            ds = s.token_ids[len(s.token_ids) - k:] if k else []
            if k:
                q = draft_probs[j]
                if q is None or tuple(q.shape) != (k, vocab):
                    raise ValueError(f"request {s.request_id}: draft probs {None if q is None else tuple(q.shape)}"
                                     f" for {k} drafts over {vocab} tokens")
                if not all(0 <= d < vocab for d in ds):
                    raise ValueError(f"request {s.request_id}: a draft token outside [0, {vocab})")
                x.q_index.extend(range(num_q, num_q + k))
                num_q += k
                x.qs.append(q)
            x.q_index.append(-1)
            if p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0):
                x.filt.extend(range(len(x.temp), len(x.temp) + k + 1))
                x.filt_params.extend([p] * (k + 1))
            x.temp.extend([p.temperature] * (k + 1))
            x.seeds.extend([default_seed if p.seed is None else p.seed] * (k + 1))
            x.indexes.extend(range(s.output_index, s.output_index + k + 1))
            x.drafts.extend(ds)
            x.drafts.append(-1)
        return x
