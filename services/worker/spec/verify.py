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
with recovered and bonus tokens (kernels/rejection_sampling.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch

from shared.protocol import ScheduledSeq, TokenLogprob


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
    """Rejection sampling against draft distributions q (module doc). target_logits:
    [rows, vocab] fp32 after the processors (`Sampler.process` over `expand_rows`);
    draft_probs: per seq [num_draft, vocab] fp32; default_seed: the seed of requests
    without one; raw_logits: the logits before the processors (for raw logprobs), or None.
    Not built yet (issue 15)."""
    raise NotImplementedError("probabilistic verification (issue 15)")
