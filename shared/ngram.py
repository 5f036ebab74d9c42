"""N-gram prompt lookup, as vLLM's `ngram` method (docs/ARCHITECTURE.md §5.5): the drafts
are what followed an earlier occurrence of the context's last tokens (LLMA, Yang et al.
2023, arXiv 2304.04487, copies spans of a reference text the same way). It needs no weights
and pays off where the output copies its input (editing, summarising code, RAG answers).

For n from max_n down to min_n, the first n for which the context's last n tokens occur
earlier in it wins; of those occurrences the most recent one is taken, and the up to k
tokens that followed it are the drafts (fewer when the context ends first).

Two implementations of the same function:
- `ngram_lookup(context, min_n, max_n, k)`: stateless, over a numpy array: one vectorised
  comparison of the context with its last token, then at most max_n - 1 comparisons over
  the candidates it leaves (no Python loop over the context). Negative ids (a position
  never seen) match nothing and stop the drafts.
- `NgramIndex`: incremental, for a context that only grows (the engine's prompt + output
  tokens of a request): a dict per n from n-gram to the last position where it ends,
  brought up to date from the tokens appended since the last lookup. A lookup costs
  max_n - min_n + 1 dict probes plus O(new tokens) inserts, whatever the context's length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def ngram_lookup(context: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k drafts for `context` [L] int (module doc): the tokens after the most recent
    earlier occurrence of its last n tokens, for the largest n in [min_n, max_n] that has
    one; [] when none does, k <= 0, or the context's last token is negative (unknown).
    Drafts stop at the first negative token. Requires 1 <= min_n <= max_n."""
    L = int(context.shape[0])
    if k <= 0 or L < min_n + 1:
        return []
    last = context[L - 1]
    if last < 0:
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
    stop = np.flatnonzero(drafts < 0)
    if stop.size:
        drafts = drafts[:stop[0]]
    return drafts.tolist()


class NgramIndex:
    """The incremental form of `ngram_lookup` for one growing context (module doc).

    min_n, max_n: the n-gram sizes (1 <= min_n <= max_n). The index holds, per n, every
    n-gram of the context that ends at a position <= L - 2 (L: the context's length at the
    last lookup) with the last such end; the context's own last n-gram (ending at L - 1) is
    added only once a later token follows it, so a hit is always an earlier occurrence.
    Token ids must be >= 0. Raises ValueError on a bad n range.
    """

    __slots__ = ("min_n", "max_n", "_ends", "_upto")

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram: prompt_lookup_min {min_n} and prompt_lookup_max {max_n} "
                             "must satisfy 1 <= min <= max")
        self.min_n, self.max_n = min_n, max_n
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]
        self._upto = 0  # n-grams ending at positions < _upto are indexed

    @property
    def indexed(self) -> int:
        """Positions whose ending n-grams are in the index."""
        return self._upto

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        """Index the n-grams ending at positions [indexed, upto), where `tokens` holds the
        context's positions [indexed - max_n + 1 (or 0), upto) (the caller slices only what
        is new, plus max_n - 1 tokens before it)."""
        a = self._upto
        if upto <= a:
            return
        base = max(0, a - self.max_n + 1)  # position of tokens[0]
        for i, n in enumerate(range(self.min_n, self.max_n + 1)):
            first = max(a, n - 1)  # first end position to add for this n
            if first >= upto:
                continue
            lo = first - n + 1 - base  # index in tokens of that n-gram's first token
            cols = [tokens[lo + m:upto - base - n + 1 + m] for m in range(n)]
            # in position order: a later occurrence overwrites an earlier one (the most recent wins)
            self._ends[i].update(zip(zip(*cols), range(first, upto)))
        self._upto = upto

    def lookup(self, tokens: Callable[[int, int], Sequence[int]], length: int, k: int) -> list[int]:
        """`ngram_lookup` of a context of `length` tokens (which only ever grew since the
        last call); `tokens(start, end)` gives its positions [start, end) (so the caller's
        storage is sliced, never copied whole). Indexes what is new first."""
        if k <= 0 or length < self.min_n + 1:
            return []
        if self._upto < length - 1:
            start = max(0, self._upto - self.max_n + 1)
            self.extend(tokens(start, length - 1), length - 1)
        top = min(self.max_n, length - 1)
        tail = list(tokens(length - top, length))
        for n in range(top, self.min_n - 1, -1):
            j = self._ends[n - self.min_n].get(tuple(tail[top - n:]))
            if j is not None:
                return list(tokens(j + 1, min(j + 1 + k, length)))
        return []
