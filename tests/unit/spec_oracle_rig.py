"""A scripted oracle worker for the engine's speculative decoding (docs/ARCHITECTURE.md §5.5).

`OracleWorker.execute(plan) -> StepResult` is a `StepRunner` whose next token is a pure
function of the whole context (`pick`), as a real model's greedy draw is. It keeps a paged
"KV cache" keyed by (block id, slot), each slot holding (position, token, digest of the
context it was computed under), and every sampled row reads its whole context back through
the block table, so a plan that reads a rejected draft's KV, a stale block or a block
trimmed and reused by another request fails the run (or changes its output).

It verifies like a real worker (services/worker/spec/verify.py, point-mass drafts): row i
of a seq with k drafts draws the oracle's token after token_ids[:len-k+i] under the i-th
mask; drafts are accepted while each equals the draw at its position, and the first draw
that differs (or the one after the last draft) is the recovered or bonus token. It proposes
`num_propose` drafts: by default the oracle's own continuation of the emitted context, with
a mistake (another token) wherever `mistake(request_id, output_index)` says so, or what
`proposer` returns (a replay of a reference run, for grammars). Everything it checks is an
assert; what it saw is recorded (`verified`, `pending_fed`, `masks`) for the tests.
"""

from __future__ import annotations

from collections.abc import Callable

from services.engine.ngram_drafts import Drafter
from services.engine.request import Request
from shared import protocol as P
from shared.plan_state import PlanState

VOCAB = 50
EOS = 0


def mix(digest: int, token: int) -> int:
    return (digest * 31 + token + 7) % 1000003


def allowed_ids(mask: bytes | None, vocab: int) -> list[int] | None:
    """Token ids whose bit is set in a packed little-endian int32 mask (None: no mask)."""
    if mask is None:
        return None
    bits = int.from_bytes(mask, "little")
    return [t for t in range(vocab) if bits >> t & 1]


def pick(digest: int, length: int, allowed: list[int] | None) -> int:
    """The oracle: the next token after a context of `length` tokens with this digest; EOS
    now and then (every 13th position), or, under a mask, one of the allowed tokens."""
    if allowed is not None:
        assert allowed, "a mask that allows nothing"
        return allowed[digest % len(allowed)]
    return 1 + digest % (VOCAB - 1) if length % 13 else EOS


def oracle_continuation(ctx: list[int], n: int) -> list[int]:
    """The oracle's next n tokens after ctx (no mask)."""
    d = 0
    for t in ctx:
        d = mix(d, t)
    out, length = [], len(ctx)
    for _ in range(n):
        tok = pick(d, length, None)
        out.append(tok)
        d, length = mix(d, tok), length + 1
    return out


class FakeClock:
    """Simulated seconds: the worker advances it by each step's cost."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class OracleWorker:
    """The oracle behind `execute(plan) -> StepResult` (module doc).

    block_size: the engine's. vocab: token ids 0..vocab-1 (masks are read over them).
    mistake(request_id, output_index): whether the draft for that output is wrong.
    proposer(request_id, context, output_index, n): drafts for the tokens after context
        (default: the oracle's continuation with mistakes). short(request_id,
        output_index): how many of the wanted drafts to return (default: all).
    bm: the engine's block manager; a write into a block it shares or has named fails.
    clock, step_cost(plan): a simulated clock advanced by step_cost(plan) seconds per step.
    Its drafts reach the engine through `OracleDrafter` (the engine-side drafter seam of
    method "ngram", services/engine/ngram_drafts.py), or, for seqs with num_propose, with
    the step result as a worker-side proposer's do.
    """

    def __init__(self, block_size: int, vocab: int = VOCAB, *,
                 mistake: Callable[[str, int], bool] = lambda rid, i: False,
                 proposer: Callable[[str, list[int], int, int], list[int]] | None = None,
                 short: Callable[[str, int], int] | None = None, bm=None,
                 clock: FakeClock | None = None, step_cost: Callable[[P.StepPlan], float] | None = None):
        self.bs, self.vocab = block_size, vocab
        self.mistake, self.proposer, self.short = mistake, proposer, short
        self.bm, self.clock, self.step_cost = bm, clock, step_cost
        self.state = PlanState()
        self.kv: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.history: dict[str, list[int]] = {}
        self.last: dict[str, int] = {}      # last emitted token per request (PENDING_TOKEN)
        self.spec_prev: dict[str, bool] = {}  # the request's last seq verified or proposed
        self.pending_fed = 0
        self.verified: list[tuple[str, int, int, int]] = []  # (rid, output_index, k, accepted)
        # (rid, output_index, drafts, masks per row) of the sampled seqs that had masks
        self.masks: list[tuple[str, int, list[int], list[bytes | None]]] = []
        self.proposals: list[tuple[str, int, list[int]]] = []  # (rid, output index of d1, drafts)
        self.emitted: dict[str, list[int]] = {}  # everything emitted per request, drops included

    def _read(self, table: list[int], end: int) -> tuple[list[int], int]:
        """The context [0, end) read back through the table, checked; (tokens, digest)."""
        toks, d = [], 0
        for pos in range(end):
            slot = self.kv.get((table[pos // self.bs], pos % self.bs))
            assert slot is not None, f"position {pos} reads a slot never written"
            assert slot[0] == pos, f"position {pos} reads KV written for position {slot[0]}"
            d = mix(d, slot[1])
            assert slot[2] == d, f"KV of position {pos} was computed under another context"
            toks.append(slot[1])
        return toks, d

    def execute(self, plan: P.StepPlan) -> P.StepResult:
        firsts = {s.request_id: s.table_start == 0 for s in plan.seqs}
        if any(s.num_draft for s in plan.seqs):  # a verify step replays its graph only without them (§6.5)
            assert not any(P.PENDING_TOKEN in s.token_ids for s in plan.seqs), "a pending token in a verify step"
        self.state.resolve(plan)
        for rid in plan.forget:
            self.history.pop(rid, None)
        sampled: list[int] = []
        counts: list[int] = []
        lps: list[P.TokenLogprob | None] = []
        drafts: dict[str, list[int]] = {}
        any_lp = False
        for s in plan.seqs:
            rid, k, table = s.request_id, s.num_draft, s.block_table
            toks = list(s.token_ids)
            assert 0 <= k < len(toks) and (s.sample or not k), "drafts outside a sampled seq"
            assert s.sample or not s.num_propose, "a proposal after an unsampled seq"
            assert P.PENDING_TOKEN not in toks[1:], "a pending token past a decode's first"
            if toks[0] == P.PENDING_TOKEN:
                assert len(toks) == 1 and not self.spec_prev.get(rid), "planned ahead of a verify/propose"
                toks[0] = self.last[rid]
                self.pending_fed += 1
            assert len(table) * self.bs >= s.start_pos + len(toks) + s.num_propose, "blocks do not cover"
            hist = self.history.setdefault(rid, [])
            if firsts[rid]:
                hist[:] = self._read(table, s.start_pos)[0]
            del hist[s.start_pos:]
            assert len(hist) == s.start_pos, "the plan skips tokens"
            hist.extend(toks)
            d = self._read(table, s.start_pos)[1] if s.start_pos else 0
            for i, tok in enumerate(toks):  # write the KV of every token run
                pos = s.start_pos + i
                blk = table[pos // self.bs]
                if self.bm is not None:  # a block in the prefix cache holds KV that is never rewritten
                    assert self.bm.ref_cnt[blk] == 1, f"write into shared block {blk}"
                    assert self.bm.block_hash[blk] is None, f"write into block {blk}, named in the prefix cache"
                d = mix(d, tok)
                self.kv[(blk, pos % self.bs)] = (pos, tok, d)
            self.spec_prev[rid] = bool(k or s.num_propose)
            if not s.sample:
                continue
            masks = self._masks(s)
            if s.allowed_token_bitmask is not None:
                self.masks.append((rid, s.output_index, toks[len(toks) - k:] if k else [], masks))
            base = s.start_pos + len(toks) - k  # positions [0, base) precede row 0's draw
            emitted = []
            for i in range(k + 1):
                ctx, dg = self._read(table, base + i)
                allowed = allowed_ids(masks[i], self.vocab) if masks[i] is not None else None
                t = pick(dg, len(ctx), allowed)
                emitted.append(t)
                if i == k or t != toks[len(toks) - k + i]:
                    break
            del hist[base + len(emitted) - 1:]  # rejected drafts leave the history
            hist.append(emitted[-1])
            ctx = self._read(table, base + len(emitted) - 1)[0]
            assert hist == ctx + [emitted[-1]], "the worker's history differs from its KV"
            if k:
                self.verified.append((rid, s.output_index, k, len(emitted) - 1))
            self.emitted.setdefault(rid, []).extend(emitted)
            sampled += emitted
            counts.append(len(emitted))
            self.last[rid] = emitted[-1]
            if s.sampling.logprobs is not None:
                any_lp = True
                lps += [P.TokenLogprob(t, -((t * 37 + s.output_index + j) % 100) / 10.0, 1)
                        for j, t in enumerate(emitted)]
            else:
                lps += [None] * len(emitted)
            if s.num_propose:
                oi = s.output_index + len(emitted)
                drafts[rid] = self._propose(rid, hist, oi, s.num_propose)
                self.proposals.append((rid, oi, drafts[rid]))
        if self.clock is not None and self.step_cost is not None:
            self.clock.t += self.step_cost(plan)
        spec = any(s.num_draft for s in plan.seqs)
        return P.StepResult(plan.step_id, sampled, logprobs=lps if any_lp else [],
                            num_sampled=counts if spec else [], draft_token_ids=drafts)

    def _masks(self, s: P.ScheduledSeq) -> list[bytes | None]:
        b = s.allowed_token_bitmask
        if b is None:
            return [None] * (s.num_draft + 1)
        words = -(-self.vocab // 32) * 4
        assert len(b) == words * (s.num_draft + 1), "not one mask per verified position"
        return [b[i * words:(i + 1) * words] for i in range(s.num_draft + 1)]

    def _propose(self, rid: str, ctx: list[int], output_index: int, n: int) -> list[int]:
        if self.short is not None:
            n = min(n, self.short(rid, output_index))
        if self.proposer is not None:
            out = self.proposer(rid, ctx, output_index, n)
        else:
            out = oracle_continuation(ctx, n)
        return [(t + 1 + i) % self.vocab if self.mistake(rid, output_index + i) else t
                for i, t in enumerate(out[:n])]


class OracleDrafter(Drafter):
    """The oracle worker's drafts as the engine-side drafter's (`Drafter.propose`): for a
    request's known tokens, `worker`'s proposal (its mistakes, short counts and proposer
    apply, keyed by the output index of the first draft), recorded in `worker.proposals`.
    Install with `install(core, worker)`."""

    def __init__(self, worker: OracleWorker):
        self.worker = worker

    def propose(self, req: Request, k: int) -> list[int]:
        ctx = req.prompt_token_ids + req.output_token_ids
        oi = len(req.output_token_ids)
        drafts = self.worker._propose(req.request_id, ctx, oi, k)
        self.worker.proposals.append((req.request_id, oi, drafts))
        return drafts

    @staticmethod
    def install(core, worker: OracleWorker) -> None:
        """Make `worker`'s proposals the drafts of `core`'s scheduler (an `EngineCore` with
        method "ngram")."""
        assert core.scheduler.drafts is not None and core.scheduler.drafts.drafter is not None
        core.scheduler.drafts.drafter = OracleDrafter(worker)
