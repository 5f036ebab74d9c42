"""The model runner's speculative half of a step (docs/ARCHITECTURE.md §5.5): which logits
rows a step keeps, verification of the sampled seqs' drafts, the draft distributions kept
between a proposal and its verification, and the `ProposeRequest`s of a step.

A sampled seq with num_draft = k keeps the logits of its last k + 1 tokens (`logit_rows`);
those rows are expanded per position (`verify.expand_rows`) and verified (`verify_drafts`):
point-mass drafts with the ordinary sampler and `verify.accept_point_mass`, drafts whose
proposal came with a distribution q (`Proposal.probs`, kept in `DraftProbs`) with
`verify.verify_probabilistic`. A seq's emitted tokens are then at positions
`emitted_pos(seq)` onwards, and the last one is the next step's first input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.cuda_graphs import DecodeGraphs
from services.worker.layers.attention import AttentionMetadata
from services.worker.sampler import Sampler, make_token_logprobs
from services.worker.spec import verify
from services.worker.spec.base import Proposer, ProposeRequest, StepView
from shared.protocol import ScheduledSeq, StepResult, TokenLogprob


def emitted_pos(seq: ScheduledSeq) -> int:
    """Position of the first token a sampled seq emits: just past its tokens that are not
    drafts (start_pos + len(token_ids) - num_draft)."""
    return seq.start_pos + len(seq.token_ids) - seq.num_draft


def check_drafts(seqs: list[ScheduledSeq]) -> None:
    """Raise ValueError for a seq whose num_draft does not fit it: drafts on a seq that does
    not sample, or not at least one token before the drafts."""
    for s in seqs:
        k = s.num_draft
        if k and (k < 0 or not s.sample or k >= len(s.token_ids)):
            raise ValueError(f"request {s.request_id}: num_draft {k} with {len(s.token_ids)} tokens "
                             f"(sample={s.sample}): a verify seq is [last token, d1..dk]")


def logit_rows(seqs: list[ScheduledSeq], rows: list[int], offsets: list[int]) -> list[int]:
    """The flat token indexes whose logits a step keeps: for each sampled seq (plan indexes
    `rows`) its last num_draft + 1 tokens, in order. offsets: [num_seqs + 1] host ints, the
    first flat index of each seq (cu_seqlens_q)."""
    out: list[int] = []
    for i in rows:
        end = offsets[i + 1]
        out.extend(range(end - seqs[i].num_draft - 1, end))
    return out


class DraftProbs:
    """The draft distributions of each request's last proposal, by request id, until it is
    verified (a proposal the engine does not schedule is replaced by the next one)."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[int, list[int], torch.Tensor]] = {}

    def keep(self, request_id: str, first_pos: int, token_ids: list[int], probs: torch.Tensor) -> None:
        """Keep q [len(token_ids), vocab] fp32 of drafts proposed for positions first_pos..."""
        self._kept[request_id] = (first_pos, token_ids, probs)

    def __len__(self) -> int:
        """Requests with a kept proposal (0: `take` would give None for every seq)."""
        return len(self._kept)

    def drop(self, request_ids: list[str]) -> None:
        """Forget these requests' kept proposals (ended, or proposed again without q)."""
        for r in request_ids:
            self._kept.pop(r, None)

    def take(self, seq: ScheduledSeq) -> torch.Tensor | None:
        """q [num_draft, vocab] of a verify seq's drafts, removed from the store, when they are
        the first num_draft tokens of the request's kept proposal at the same positions; else
        None (the drafts are then verified as point masses, which is lossless for any draft)."""
        kept = self._kept.pop(seq.request_id, None)
        k = seq.num_draft
        if kept is None or k == 0:
            return None
        first, toks, probs = kept
        if first != emitted_pos(seq) or k > len(toks) or list(seq.token_ids[-k:]) != toks[:k]:
            return None
        return probs[:k]


@dataclass
class Verified:
    """Per sampled seq (plan order of the sampled seqs): its emitted tokens (accepted drafts,
    then the recovered or bonus token) and their logprobs (None: the request did not ask)."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprob] | None]

    def fill(self, result: StepResult) -> None:
        """Into `result`: the tokens flat (`sampled_token_ids`), their counts
        (`num_sampled`) and, when any seq asked, the logprobs flat and aligned (None for the
        tokens of seqs that did not ask)."""
        result.sampled_token_ids = [t for toks in self.tokens for t in toks]
        result.num_sampled = [len(toks) for toks in self.tokens]
        if any(lp is not None for lp in self.logprobs):
            result.logprobs = [x for toks, lp in zip(self.tokens, self.logprobs)
                               for x in (lp if lp is not None else [None] * len(toks))]


# The greedy fast path of `verify_drafts` (verify.plain_greedy): one argmax, no per-position
# rows. A switch for the A/B of benchmarks/spec_verify_cost.py --parts host; on by default.
FAST_VERIFY = True


def verify_drafts(sampler: Sampler, logits: torch.Tensor, seqs: list[ScheduledSeq],
                  store: DraftProbs) -> Verified:
    """Verify the sampled seqs of a step with drafts (module doc).

    logits: [sum(num_draft + 1), vocab] fp32, the rows of `logit_rows` (raw: not processed).
    seqs: the sampled seqs (resolved), in plan order. store: the kept draft distributions;
    a seq whose drafts have one is verified by rejection sampling against it.
    A step whose seqs are all plain greedy (`verify.plain_greedy`) and hold no kept q
    takes one argmax over every row and `verify.accept_greedy` (`FAST_VERIFY`): the same
    tokens, without the per-position rows and the sampler's processor checks.
    Raises ValueError like `Sampler.sample` and `verify.expand_rows`.
    """
    probs = [store.take(s) for s in seqs] if store else [None] * len(seqs)
    if FAST_VERIFY and verify.plain_greedy(seqs) and all(q is None for q in probs):
        drawn = logits.argmax(dim=-1).tolist()  # the one host read of the step
        return Verified(verify.accept_greedy(seqs, drawn), [None] * len(seqs))
    rows, starts = verify.expand_rows(seqs)
    tokens: list[list[int]] = [[] for _ in seqs]
    lps: list[list[TokenLogprob] | None] = [None] * len(seqs)
    point = [j for j, q in enumerate(probs) if q is None]
    rejection = [j for j, q in enumerate(probs) if q is not None]
    for group, is_point in ((point, True), (rejection, False)):
        if not group:
            continue
        if len(group) == len(seqs):
            sub_seqs, sub_rows, sub_starts, sub_logits = seqs, rows, starts, logits
        else:
            sub_seqs = [seqs[j] for j in group]
            flat = [r for j in group for r in range(starts[j], starts[j + 1])]
            sub_rows = [rows[r] for r in flat]
            sub_starts = [0]
            for j in group:
                sub_starts.append(sub_starts[-1] + starts[j + 1] - starts[j])
            sub_logits = logits.index_select(0, torch.tensor(flat, device=logits.device))
        if is_point:
            out = sampler.sample(sub_logits, sub_rows)
            vo = verify.accept_point_mass(sub_seqs, sub_starts, out.token_ids, out.logprobs)
        else:
            processed = sampler.process(sub_logits, sub_rows)
            qs = [q for j in group if (q := probs[j]) is not None]
            vo = verify.verify_probabilistic(processed, sub_seqs, sub_starts, qs,
                                             default_seed=sampler.default_seed, raw_logits=sub_logits)
            vo.logprobs = _raw_logprobs(sub_logits, sub_seqs, sub_starts, vo.tokens, vo.logprobs)
        for n, j in enumerate(group):
            tokens[j], lps[j] = vo.tokens[n], vo.logprobs[n]
    return Verified(tokens, lps)


def _raw_logprobs(logits: torch.Tensor, seqs: list[ScheduledSeq], starts: list[int], tokens: list[list[int]],
                  given: list[list[TokenLogprob] | None]) -> list[list[TokenLogprob] | None]:
    """Raw logprobs (`services.worker.sampler`: before any processor) of each seq's emitted
    tokens where the request asks and the verifier gave none: emitted token i was drawn
    at row starts[j] + i."""
    out: list[list[TokenLogprob] | None] = list(given) if given else [None] * len(seqs)
    want = [j for j, s in enumerate(seqs) if s.sampling is not None and s.sampling.logprobs is not None
            and out[j] is None]
    if not want:
        return out
    idx = [starts[j] + i for j in want for i in range(len(tokens[j]))]
    toks = [t for j in want for t in tokens[j]]
    ks = [seqs[j].sampling.logprobs or 0 for j in want for _ in tokens[j]]  # type: ignore[union-attr]
    dev = logits.device
    raw = torch.log_softmax(logits.index_select(0, torch.tensor(idx, device=dev)).float(), dim=-1)
    made = make_token_logprobs(raw, torch.tensor(toks, dtype=torch.long, device=dev), ks)
    pos = 0
    for j in want:
        out[j] = made[pos:pos + len(tokens[j])]
        pos += len(tokens[j])
    return out


def propose_requests(seqs: list[ScheduledSeq], rows: list[int], emitted: list[list[int]],
                     offsets: list[int]) -> list[ProposeRequest]:
    """The `ProposeRequest`s of a step: one per sampled seq with num_propose > 0. rows: the
    plan indexes of the sampled seqs; emitted: their emitted tokens (aligned with rows);
    offsets: [num_seqs + 1] host ints, each seq's first flat token index."""
    out: list[ProposeRequest] = []
    for j, i in enumerate(rows):
        s = seqs[i]
        if s.num_propose <= 0:
            continue
        em = emitted[j]
        next_pos = emitted_pos(s) + len(em) - 1
        assert s.sampling is not None  # resolved plan
        out.append(ProposeRequest(
            request_id=s.request_id, seq_index=i, emitted=em, next_pos=next_pos,
            row=offsets[i] + next_pos - 1 - s.start_pos, num_propose=s.num_propose,
            block_table=s.block_table, sampling=s.sampling, output_index=s.output_index + len(em)))
    return out


def propose(proposer: Proposer, requests: list[ProposeRequest], view: StepView, vocab_size: int,
            max_model_len: int, store: DraftProbs) -> dict[str, list[int]]:
    """Call the proposer once for `requests` (non-empty) and return request id -> drafts
    (0..num_propose each, and no more than fit before max_model_len in the next step; a
    draft id outside [0, vocab_size) ends that request's drafts). The drafts' q, when the
    proposal has probs, is kept in `store` for their verification; a request proposed again
    without q drops what was kept."""
    prop = proposer.propose(requests, view)
    out: dict[str, list[int]] = {}
    for n, r in enumerate(requests):
        room = min(r.num_propose, max_model_len - 1 - r.next_pos)  # the next seq is [emitted[-1], drafts]
        toks = [int(t) for t in prop.token_ids[n][:max(0, room)]] if n < len(prop.token_ids) else []
        bad = next((m for m, t in enumerate(toks) if not 0 <= t < vocab_size), None)
        if bad is not None:
            toks = toks[:bad]
        out[r.request_id] = toks
        if prop.probs is not None and toks:
            store.keep(r.request_id, r.next_pos + 1, toks, prop.probs[n][:len(toks)])
        else:
            store.drop([r.request_id])
    return out


def graph_view(graphs: DecodeGraphs, seqs: list[ScheduledSeq], hidden: torch.Tensor, max_model_len: int,
               aux: torch.Tensor | None) -> StepView:
    """The proposer's view of a decode step replayed from a CUDA graph: the graph's input
    buffers (pending ids resolved inside the graph), metadata over them and its outputs,
    first b = len(seqs) rows. The buffers are overwritten by the next replay: a proposer
    reads them in `observe` / `propose`, it does not keep them. aux: the replayed graph's
    aux hidden output [padded b, ...] (None: the model stores none)."""
    b = len(seqs)
    g = graphs
    meta = AttentionMetadata(g.cu[:b + 1], g.seq_lens[:b], g.tables[:b], g.slots[:b], None,
                             max_q_len=1, max_seq_len=max_model_len)
    return StepView(seqs, g.ids[:b], g.pos[:b], meta, hidden, None if aux is None else aux[:b])
