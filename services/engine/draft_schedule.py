"""The scheduler's side of speculative decoding: which drafts a step verifies, how many each
seq asks for next, and their blocks (docs/ARCHITECTURE.md §5.5).

`DraftScheduler` asks the `SpecPolicy` (services/engine/spec_policy.py) and applies the
limits the policy does not know: the step's token budget, what a request may still emit
(max_tokens, max_model_len), its grammar (drafts are cut at the first one it rejects,
`RequestGrammar.draft_bitmasks`, which also gives the masks of every verified position),
and the free blocks: blocks for the drafts and the proposal are taken without preempting
anyone, and a seq whose blocks are short runs plain instead. After the step
(`after_step`), the request is rolled back to the KV of its accepted positions: rejected
drafts' KV is simply overwritten by later steps, and the trailing blocks it no longer
needs go back (they hold no accepted KV, so they were never named in the prefix cache).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.engine.block_manager import BlockManager
from services.engine.ngram_drafts import Drafter, NgramDrafter
from services.engine.request import Request, RequestStatus
from services.engine.spec_policy import SpecPolicy
from services.engine.step_plan import SeqWork


class DraftScheduler:
    """Drafts and proposals for the scheduler's seqs (module doc).

    spec: the policy. bm: the scheduler's block manager. max_model_len: tokens of one request.
    drafter: the engine-side drafter (method "ngram": `NgramDrafter`, built from spec's
    config when not given), or None: the workers propose (the model-based methods).
    """

    def __init__(self, spec: SpecPolicy, bm: BlockManager, max_model_len: int,
                 drafter: Drafter | None = None):
        self.spec = spec
        self.bm = bm
        self.max_model_len = max_model_len
        cfg = spec.cfg
        if drafter is None and cfg.method == "ngram":
            drafter = NgramDrafter(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        self.drafter = drafter
        # requests an engine-side lookup left a state on (look_up), by id, in the order met
        self._watch: dict[str, Request] = {}

    def room(self, req: Request) -> int:
        """Tokens req may still emit (max_tokens, max_model_len), counting those in flight."""
        return min(req.sampling.max_tokens - len(req.output_token_ids) - req.inflight,
                   self.max_model_len - req.num_tokens - req.inflight)

    def propose_limit(self, req: Request, num_draft: int) -> int:
        """The most drafts req can use after a seq verifying num_draft: the next step may
        emit one token less than it may now, one of them not a draft; and a drafter's KV
        (positions up to the last emitted token's + the drafts) stays below max_model_len."""
        return min(self.room(req) - 2, self.max_model_len - req.num_tokens - req.inflight - num_draft)

    def choose(self, decodes: list[Request], step_tokens: int, async_ok: bool,
               budget: int | None = None, mixed: bool = False) -> dict[str, int]:
        """The policy's k per request id for the decodes that hold drafts, in a step of
        about `step_tokens` tokens before drafts. async_ok: nothing else keeps the pipeline
        from planning ahead. budget: the step's token budget (None: unbounded); the drafts
        chosen fit in what the step leaves of it (drafts past it would displace decodes or
        prefill tokens, which the policy's gains do not count). mixed: prefill tokens are
        expected in the step. With an engine-side drafter the decodes' drafts are looked
        up here first (`look_up`)."""
        spec = self.spec
        spec.begin_step(step_tokens, len(decodes), async_ok,
                        None if budget is None else max(0, budget - step_tokens), mixed)
        pool = self.look_up(decodes) if self.drafter is not None else decodes
        cands = [(r, min(len(r.draft_token_ids), spec.kmax, self.room(r) - 1))
                 for r in pool if r.draft_token_ids and not r.inflight]
        return spec.choose(cands) if cands else {}

    def look_up(self, decodes: list[Request]) -> list[Request]:
        """The engine-side drafter's turn (docs/ARCHITECTURE.md §5.5), for the decodes the
        policy wants drafts for (`SpecPolicy.wants_lookup`). When no decode of the step has
        a token in flight, each one's drafts are looked up in its tokens and kept for this
        step (`draft_token_ids`). Otherwise nothing verifies in this step (a verify step
        runs its graph only without pending tokens, §6.5): a request whose known tokens
        already have a match is marked `lookup_due`, so that the next plan waits for the
        results in flight and looks up again; one without counts as an empty lookup. With
        policy "fixed" every decode is marked (the pipeline then always waits, as it did
        for the worker's proposals).

        In a step where no acceptance pays and nobody is probed (`SpecPolicy.lookups_quiet`),
        only requests whose probe is on its way or that verified last time are looked up,
        and only those an earlier lookup left a state on (drafts, `lookup_due`, a probe,
        a verify: `_watch`) are visited at all, so that such a step costs the engine what a
        plain one does, not a pass over every decode. Returns the decodes visited (those
        that may hold drafts now)."""
        spec, drafter = self.spec, self.drafter
        assert drafter is not None
        exact = not any(r.inflight for r in decodes)
        quiet = spec.lookups_quiet()
        watch = self._watch
        if quiet:
            todo = [r for r in watch.values() if r.status == RequestStatus.RUNNING
                    and r.num_computed_tokens >= r.num_tokens + r.inflight - 1]  # (a decode, as the scheduler's)
        else:
            todo = decodes
        for r in todo:
            if r.lookup_due:
                if r.inflight:
                    continue  # waiting for its result already
                r.lookup_due = False
            if r.draft_token_ids:
                r.draft_token_ids = []  # only this step's lookup counts
            if quiet:  # (wants_lookup's answer in such a step, without the call)
                st = r.spec
                if st is None or not (st.probing or st.verifying):
                    continue
            if r.spec_inflight or not spec.wants_lookup(r, exact):
                continue
            k = min(spec.kmax, self.room(r) - 1)
            if k <= 0:
                continue
            if not exact and spec.fixed:  # "fixed" looks every decode up: every step waits
                r.lookup_due = True
                spec.num_lookup_waits += 1
                continue
            drafts = drafter.propose(r, k if exact else 1)
            if exact:
                r.draft_token_ids = drafts
            else:
                r.lookup_due = bool(drafts)
                spec.num_lookup_waits += r.lookup_due
            spec.observe_lookup(r, bool(drafts), exact)
        for r in todo:  # the requests whose state may want a lookup in a later quiet step
            st = r.spec
            if r.lookup_due or r.draft_token_ids or (st is not None and (st.probing or st.verifying)):
                watch[r.request_id] = r
            else:
                watch.pop(r.request_id, None)
        for rid in [rid for rid, r in watch.items() if r.is_finished]:
            del watch[rid]
        return todo

    def decode(self, req: Request, end: int, k: int, budget: int) -> SeqWork | None:
        """req's decode (its tokens up to `end`) with k of its drafts (fewer within
        `budget` or its grammar) and the drafts it asks for next, blocks allocated; None
        when it verifies and asks none, or the blocks are short: then it runs plain."""
        drafts = req.draft_token_ids
        if not drafts and (self.drafter is not None or not self.spec.may_ask(req)):
            return None  # it runs plain: the common step of a request with nothing to copy
        n = end - req.num_computed_tokens
        declined = bool(drafts) and k == 0  # the policy's choice (not the budget's)
        k = max(0, min(k, len(drafts), budget - n))
        masks = None
        if k and req.grammar is not None:
            k, masks = req.grammar.draft_bitmasks(drafts[:k])
        p = 0 if self.drafter is not None else self.spec.num_propose(req, k, self.propose_limit(req, k), declined)
        if not (k or p) or not self.bm.allocate(req, end + k + p):
            return None
        return SeqWork(req, n, drafts[:k], p, masks if k else None)

    def prefill(self, req: Request, end: int) -> int:
        """Drafts a prefill chunk of req ending at `end` asks for: only its last chunk
        (which samples) may ask."""
        if end != req.num_tokens or req.sampling.max_tokens <= 0 or self.drafter is not None:
            return 0
        return self.spec.num_propose(req, 0, self.propose_limit(req, 0))

    def after_step(self, req: Request, num_computed: int, num_propose: int, drafts: Sequence[int]) -> None:
        """req's seq that verified or proposed came back and req goes on: its KV holds the
        accepted tokens up to `num_computed` (the next seq starts at its last emitted
        token), blocks past its tokens are trimmed (the workers' copy of its table is cut
        by its next seq's increment), and the drafts proposed for its next seq are kept
        (at most num_propose)."""
        req.num_computed_tokens = num_computed
        self.bm.trim(req, req.num_tokens)
        req.worker_blocks = min(req.worker_blocks, len(req.block_ids))
        if num_propose:
            req.draft_token_ids = list(drafts[:num_propose])
