"""The worker's token history: per request, the tokens so far as the worker knows them, for
proposers that read the context (n-gram prompt lookup; docs/ARCHITECTURE.md §5.5).

The engine sends a request's tokens only as they run, so the history is assembled from what
the runner sees, in step order:
- a request's first seq may carry `context_token_ids`, the tokens [0, start_pos) the worker
  never ran (a prefix-cache hit, a tier load): written at position 0;
- each seq's `token_ids` are written at its `start_pos` (a prefill chunk, a decode's token, a
  verify seq's last token and drafts); a PENDING_TOKEN entry keeps the token already there
  (the worker's own last draw, recorded by `emit` at the previous step);
- the tokens a sampled seq emits (accepted drafts, then the recovered or bonus token) are
  written just past its non-draft tokens (`spec.step.emitted_pos`).
Every write truncates the request's tokens to its end, so rejected drafts (and, after a
preemption, everything from the restart position on) leave no trace. Positions the worker
never saw (a gap) hold -1, which matches no token.

Storage: one int32 numpy array per request with amortised (doubling) growth and a length;
a decode step costs one element write per request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.worker.spec.step import emitted_pos
from shared.protocol import PENDING_TOKEN, ScheduledSeq

UNKNOWN = -1  # a position the worker never saw; equal to PENDING_TOKEN by design of write


class TokenHistory:
    """Tokens per request id (module doc). `tokens(rid)` is a read-only view, valid until
    the next write."""

    def __init__(self, initial_capacity: int = 256) -> None:
        self._cap0 = max(1, initial_capacity)
        self._arr: dict[str, np.ndarray] = {}
        self._len: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._arr)

    def length(self, request_id: str) -> int:
        """Tokens held for a request (0 when unknown)."""
        return self._len.get(request_id, 0)

    def tokens(self, request_id: str) -> np.ndarray:
        """The request's tokens [length] int32 (UNKNOWN at positions never seen); empty when
        the request is unknown. A view: do not keep it past the next write."""
        a = self._arr.get(request_id)
        if a is None:
            return np.empty(0, dtype=np.int32)
        v = a[:self._len[request_id]]
        v.flags.writeable = False
        return v

    def put(self, request_id: str, pos: int, token_ids: Sequence[int]) -> None:
        """Write token_ids at positions pos.. and truncate the request there; a PENDING_TOKEN
        entry keeps the token held at its position (UNKNOWN when none); positions between
        the request's end and pos become UNKNOWN."""
        m = len(token_ids)
        end = pos + m
        a = self._arr.get(request_id)
        n = self._len.get(request_id, 0)
        if a is None or end > a.shape[0]:
            cap = max(self._cap0, end, 2 * (a.shape[0] if a is not None else 0))
            grown = np.empty(cap, dtype=np.int32)
            if a is not None:
                grown[:n] = a[:n]
            a = self._arr[request_id] = grown
        if pos > n:
            a[n:pos] = UNKNOWN
        if m == 1:  # the decode step: one token
            t = token_ids[0]
            if t != PENDING_TOKEN:
                a[pos] = t
            elif pos >= n:
                a[pos] = UNKNOWN
        elif m:
            new = np.asarray(token_ids, dtype=np.int32)
            pend = new == PENDING_TOKEN
            if pend.any():
                held = pend & (np.arange(pos, end) < n)
                new[held] = a[pos:end][held]
            a[pos:end] = new
        self._len[request_id] = end

    def write(self, seqs: Sequence[ScheduledSeq]) -> None:
        """Record a plan's seqs (resolved), before its forward: context tokens of first seqs,
        then every seq's token_ids at its start_pos."""
        for s in seqs:
            if s.context_token_ids:
                self.put(s.request_id, 0, s.context_token_ids)
            self.put(s.request_id, s.start_pos, s.token_ids)

    def emit(self, seqs: Sequence[ScheduledSeq], emitted: Sequence[Sequence[int]]) -> None:
        """Record the tokens each sampled seq emitted this step (aligned with seqs)."""
        for s, toks in zip(seqs, emitted):
            self.put(s.request_id, emitted_pos(s), toks)

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop these requests (ended)."""
        for r in request_ids:
            self._arr.pop(r, None)
            self._len.pop(r, None)
