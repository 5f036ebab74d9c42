"""The engine-side drafter of n-gram speculation (docs/ARCHITECTURE.md §5.5): drafts are looked
up at plan time in the request's own prompt + output token ids, which the engine holds, so a
decode with a match verifies them in the very step that finds them, with no proposal step in
the worker and no round trip.

`Drafter` is the seam the `DraftScheduler` (services/engine/draft_schedule.py) calls:
`propose(req, k)` -> up to k drafts after req's known tokens. `NgramDrafter` answers with
prompt lookup (`shared.ngram.NgramIndex`, one incremental index per request, kept on the
request: it only grows, since rejected drafts never enter a request's tokens, and goes with
it when it ends). Tests inject their own drafter the same way.
"""

from __future__ import annotations

from services.engine.request import Request
from shared.ngram import NgramIndex


class Drafter:
    """Engine-side drafts for a request (module doc)."""

    def propose(self, req: Request, k: int) -> list[int]:
        """Up to k draft tokens to follow req's known tokens (prompt + outputs, those in
        flight not included); [] for none."""
        raise NotImplementedError


class NgramDrafter(Drafter):
    """Prompt lookup over each request's tokens (`shared.ngram`); min_n, max_n: the
    speculative config's prompt_lookup_min / prompt_lookup_max. Raises ValueError on a bad
    range."""

    def __init__(self, min_n: int, max_n: int):
        NgramIndex(min_n, max_n)  # checks the range
        self.min_n, self.max_n = min_n, max_n

    def propose(self, req: Request, k: int) -> list[int]:
        """The drafts of `shared.ngram.ngram_lookup` over req's tokens (module doc). Cost:
        a few dict probes, plus inserts for the tokens appended since its last lookup."""
        idx = req.drafter_state
        if idx is None:
            idx = req.drafter_state = NgramIndex(self.min_n, self.max_n)
        return idx.lookup(req.token_slice, req.num_tokens, k)
