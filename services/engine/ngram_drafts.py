"""The engine-side drafter of n-gram speculation (docs/ARCHITECTURE.md §5.5): drafts are looked
up at plan time in the request's own prompt + output token ids, which the engine holds, so a
decode with a match verifies them in the very step that finds them, with no proposal step in
the worker and no round trip.

`Drafter` is the seam the `DraftScheduler` (services/engine/draft_schedule.py) calls:
`propose(req, k)` -> up to k drafts after req's known tokens. `NgramDrafter` answers with
prompt lookup (`shared.ngram.NgramIndex`, one incremental index per request, kept on the
request: it only grows, since rejected drafts never enter a request's tokens, and goes with
it when it ends). Tests inject their own drafter the same way.

An index far behind its request's tokens costs more to bring up to date (a dict store per
new position and n) than the stateless search over the whole context (`ngram_lookup`, one
numpy comparison): on the shared 2-core VM, garbage collection as in the engine process
(`shared.procutil.freeze_gc`), 12-34 us for 8-80 new tokens against ~7 us for a 150-token
context, 15 us for 600, 60 us for 2000. So a sparse lookup (the request's last one was more than
RECENT tokens ago, e.g. a probe every 16-256 steps, or its first) that finds its index more
than LAG + length / 64 tokens behind takes the stateless search and leaves the index as it is; a request
looked up step after step (it verifies drafts) brings its index up to date once and from
then on adds the few tokens of each step. Both give the same drafts.
"""

from __future__ import annotations

import numpy as np

from services.engine.request import Request
from shared.ngram import NgramIndex, ngram_lookup

LAG = 16     # a sparse lookup more than LAG + length / 64 tokens behind searches statelessly
RECENT = 8   # a lookup within this many tokens of the last one counts as step after step


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
        a few dict probes, plus inserts for the tokens appended since its last lookup; a
        sparse lookup far behind: one numpy search over the context."""
        idx = req.drafter_state
        if idx is None:
            idx = req.drafter_state = NgramIndex(self.min_n, self.max_n)
        n = req.num_tokens
        if n - idx.indexed > LAG + n // 64 and n - idx.last_length > RECENT:
            idx.last_length = n
            if k <= 0:
                return []
            ctx = np.array(req.prompt_token_ids + req.output_token_ids, dtype=np.int64)
            return ngram_lookup(ctx, self.min_n, self.max_n, k)
        return idx.lookup(req.token_slice, n, k)
