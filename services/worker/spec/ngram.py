"""N-gram prompt lookup, as vLLM's `ngram` method (docs/ARCHITECTURE.md §5.5): the drafts
are what followed an earlier occurrence of the context's last tokens (LLMA, Yang et al.
2023, arXiv 2304.04487, copies spans of a reference text the same way). It needs no weights and pays off where the output copies its input (editing, summarising
code, RAG answers).

For n from prompt_lookup_max down to prompt_lookup_min, the first n for which the context's
last n tokens occur earlier in it wins; of those occurrences the most recent one is taken,
and the up to num_propose tokens that followed it are the drafts (fewer when the context
ends first). The context is the worker's token history of the request
(`spec.history.TokenHistory`: prompt, outputs, the token emitted this step), which the
runner feeds (`NgramProposer.history`).

Cost: one vectorised comparison of the context with its last token, then at most
prompt_lookup_max - 1 comparisons over the candidates it leaves; no Python loop over the
context.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from services.worker.spec.base import Proposal, Proposer, ProposerInfo, ProposeRequest, StepView
from services.worker.spec.history import UNKNOWN, TokenHistory


def ngram_lookup(context: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k drafts for `context` [L] int (module doc): the tokens after the most recent
    earlier occurrence of its last n tokens, for the largest n in [min_n, max_n] that has
    one; [] when none does, k <= 0, or the context's last token is UNKNOWN. Drafts stop at
    the first UNKNOWN token. Requires 1 <= min_n <= max_n."""
    L = int(context.shape[0])
    if k <= 0 or L < min_n + 1:
        return []
    last = context[L - 1]
    if last == UNKNOWN:
        return []
    max_n = min(max_n, L - 1)
    # candidate ends j of an earlier occurrence: context[j] == last, j <= L - 2
    cand = np.flatnonzero(context[:L - 1] == last)
    if cand.size == 0:
        return []
    match = np.ones(cand.size, dtype=np.int64)  # tokens matched backwards from j, capped at max_n
    alive = np.ones(cand.size, dtype=bool)
    for m in range(1, max_n):
        idx = cand - m
        ok = alive & (idx >= 0)
        if not ok.any():
            break
        ok[ok] = context[idx[ok]] == context[L - 1 - m]
        match += ok
        alive = ok
    best = int(match.max())
    if best < min_n:
        return []
    j = int(cand[match == best][-1])  # the most recent occurrence of the longest n-gram
    drafts = context[j + 1:j + 1 + k]
    stop = np.flatnonzero(drafts == UNKNOWN)
    if stop.size:
        drafts = drafts[:stop[0]]
    return drafts.tolist()


class NgramProposer(Proposer):
    """Prompt lookup over each request's token history (module doc); no KV, no weights.

    Built by `spec.build_proposer` as NgramProposer(cfg, spec, runner): spec's
    prompt_lookup_min / prompt_lookup_max bound n. `history` is the `TokenHistory` the
    runner writes every step (`ModelRunner.history`).
    """

    def __init__(self, cfg: Any, spec: Any, runner: Any = None):
        self.min_n = int(spec.prompt_lookup_min)
        self.max_n = int(spec.prompt_lookup_max)
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"ngram: prompt_lookup_min {self.min_n} and prompt_lookup_max {self.max_n} "
                             "must satisfy 1 <= min <= max")
        self.history = TokenHistory()

    def propose(self, requests: list[ProposeRequest], view: StepView) -> Proposal:
        """Drafts per request from its history (which already holds this step's emitted
        tokens); point masses (no probs)."""
        h = self.history
        return Proposal([ngram_lookup(h.tokens(r.request_id), self.min_n, self.max_n, r.num_propose)
                         for r in requests])

    def forget(self, request_ids: list[str]) -> None:
        """Nothing of its own: the runner drops the requests from the history."""

    def info(self) -> ProposerInfo:
        """method "ngram" and its n range."""
        return ProposerInfo("ngram", detail={"prompt_lookup_min": self.min_n, "prompt_lookup_max": self.max_n})
