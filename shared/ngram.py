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


BULK = 32  # appended positions from which the index is extended with one zip per n


class NgramIndex:
    """The incremental form of `ngram_lookup` for one growing context (module doc).

    min_n, max_n: the n-gram sizes (1 <= min_n <= max_n). The index (one dict, keyed by the
    n-gram's tuple, so n-grams of different n never collide) holds every n-gram of the
    context that ends at a position <= L - 2 (L: the context's length at the last lookup),
    with the last such end; the context's own last n-gram (ending at L - 1) is added only
    once a later token follows it, so a hit is always an earlier occurrence.
    Token ids must be >= 0. Raises ValueError on a bad n range.
    """

    __slots__ = ("min_n", "max_n", "_ends", "_upto", "last_length")

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram: prompt_lookup_min {min_n} and prompt_lookup_max {max_n} "
                             "must satisfy 1 <= min <= max")
        self.min_n, self.max_n = min_n, max_n
        self._ends: dict[tuple[int, ...], int] = {}
        self._upto = 0  # n-grams ending at positions < _upto are indexed
        self.last_length = 0  # the context's length at the last lookup (a caller may set it)

    @property
    def indexed(self) -> int:
        """Positions whose ending n-grams are in the index."""
        return self._upto

    def lookup(self, tokens: Callable[[int, int], Sequence[int]], length: int, k: int) -> list[int]:
        """`ngram_lookup` of a context of `length` tokens (which only ever grew since the
        last call); `tokens(start, end)` gives its positions [start, end) (so the caller's
        storage is sliced, never copied whole). Indexes what is new first: one slice of the
        context from max_n - 1 before the first new position, then per new position one
        dict store per n (a zip per n from BULK new positions on, e.g. a prompt)."""
        lo, hi = self.min_n, self.max_n
        self.last_length = length
        if k <= 0 or length < lo + 1:
            return []
        d = self._ends
        a, end = self._upto, length - 1
        top = hi if hi < end else end  # the longest n that can occur earlier
        if a < end:
            base = a - hi + 1 if a >= hi - 1 else 0  # position of seg[0]
            seg = tokens(base, length)
            if end - a >= BULK:
                for n in range(lo, hi + 1):
                    first = a if a >= n - 1 else n - 1
                    if first < end:  # in position order: the most recent end wins
                        cols = [seg[first - n + 1 - base + m:end - n + 1 - base + m] for m in range(n)]
                        d.update(zip(zip(*cols), range(first, end)))
            else:
                for p in range(a, end):
                    e = p + 1 - base
                    for n in range(lo, (hi if p + 1 >= hi else p + 1) + 1):
                        d[tuple(seg[e - n:e])] = p
            self._upto = end
            tail = seg[length - top - base:]
        else:
            tail = tokens(length - top, length)
        for n in range(top, lo - 1, -1):
            j = d.get(tuple(tail[top - n:]))
            if j is not None:
                return list(tokens(j + 1, min(j + 1 + k, length)))
        return []
