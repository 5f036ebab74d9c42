"""How the requests the scheduler picked for a step become its `StepPlan` (the workers' input).

docs/ARCHITECTURE.md §5.3, §5.4. One `ScheduledSeq` per request, in the scheduler's order:
- the tokens of its chunk, from `num_computed_tokens` on; a decode whose previous token is
  still being sampled (async scheduling) ends with `PENDING_TOKEN`, which the worker
  replaces with the token it drew last;
- its block table as an increment: only the entries the workers do not hold yet, from
  `table_start` (`Request.worker_blocks`); a request new to the workers (or preempted: it
  sends a whole new table) sends the whole table and its `SamplingParams`
  (shared/plan_state.py rebuilds the tables on the workers' side);
- `sample`: the chunk ends at the request's last known token (a prefill's last chunk, or a
  decode) and max_tokens > 0 (`max_tokens == 0` scores the prompt only: nothing sampled).
Per-request extras, only where used (plans stay small otherwise):
- penalties: `penalty_token_ids` (prompt + outputs so far) and `num_prompt_tokens`;
- prompt logprobs: `num_prompt_tokens` (the worker gathers them chunk by chunk);
- structured output: `allowed_token_bitmask` from the request's grammar, for sampled seqs.
Speculative decoding (§5.5): a decode with drafts runs `[last token, d1..dk]` with
`num_draft = k` (and k + 1 grammar masks, computed by the scheduler); with a worker-side
proposer (the model-based methods) a sampled seq may ask for `num_propose` drafts after the
step (n-gram drafts are found by the engine at plan time: never).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from services.engine.request import Request
from shared.protocol import PENDING_TOKEN, ScheduledSeq, StepPlan


class SeqWork(NamedTuple):
    """One request's share of a step, as the scheduler chose it.

    num_tokens: the request's own tokens to run (a prefill chunk, or a decode's one token),
    drafts excluded. drafts: the draft tokens verified after them (num_draft = len).
    num_propose: drafts the workers propose after the step (sampled seqs only). bitmask: the
    len(drafts) + 1 grammar masks of a verify seq (None: the request's one mask, if any).
    state_restore, state_save: checkpoint slots of a hybrid model's prefix cache
    (services/engine/state_slots.py), -1 for none.
    """

    request: Request
    num_tokens: int
    drafts: Sequence[int] = ()
    num_propose: int = 0
    bitmask: bytes | None = None
    state_restore: int = -1  # a hybrid's prefix hit: the checkpoint slot to resume from
    state_save: int = -1  # the checkpoint slot to save the state into after this chunk


def build_plan(step_id: int, scheduled: list[SeqWork], forget: list[str]) -> StepPlan:
    """The plan of step `step_id` for `scheduled` (in plan order; each request's blocks
    already cover its chunk, drafts and proposals). forget: ids of ended requests whose
    tables the workers drop (`StepPlan.forget`).

    Advances each request as the plan is sent: `num_computed_tokens` over all its tokens
    (drafts included: the KV is written before any later plan runs; `Scheduler.update`
    rolls it back over rejected drafts), `worker_blocks` to its whole table, `inflight` by
    one when its seq samples, `spec_inflight` when it verifies or proposes. The plan has no
    tier copies (the scheduler adds the connector's)."""
    seqs = []
    for work in scheduled:
        req, n, drafts = work.request, work.num_tokens, work.drafts
        start = req.num_computed_tokens
        end = start + n
        known = req.worker_blocks  # the workers hold the rest (shared.plan_state)
        toks = req.token_slice(start, min(end, req.num_tokens))
        if end > req.num_tokens:  # a decode of the token step N is sampling now
            toks.append(PENDING_TOKEN)
        sample = end == req.num_tokens + req.inflight and req.sampling.max_tokens > 0
        if drafts:
            toks.extend(drafts)
        seq = ScheduledSeq(
            request_id=req.request_id,
            token_ids=toks,
            start_pos=start,
            block_table=req.block_ids[known:] if known else list(req.block_ids),
            sample=sample,
            sampling=None if known else req.sampling,
            output_index=len(req.output_token_ids) + req.inflight,
            table_start=known,
            num_draft=len(drafts),
            num_propose=work.num_propose if sample else 0,
            state_slot=req.state_slot,
            state_restore=work.state_restore,
            state_save=work.state_save,
        )
        req.worker_blocks = len(req.block_ids)
        req.num_computed_tokens = end + len(drafts)
        if sample:
            req.inflight += 1
        if seq.num_draft or seq.num_propose:
            req.spec_inflight = True
        if req.has_penalty:
            seq.penalty_token_ids = req.prompt_token_ids + req.output_token_ids
            seq.num_prompt_tokens = req.num_prompt_tokens
        elif req.wants_prompt_logprobs:
            seq.num_prompt_tokens = req.num_prompt_tokens
        if sample and req.grammar is not None:
            seq.allowed_token_bitmask = work.bitmask if drafts else req.grammar.bitmask()
        seqs.append(seq)
    return StepPlan(step_id=step_id, seqs=seqs, forget=forget)


def sampled_counts(plan: StepPlan, num_tokens: int, num_sampled: list[int] | None) -> list[int] | None:
    """Check a step result's token counts against its plan: `num_tokens` sampled tokens and
    `num_sampled` (StepResult's; None: one per sampled seq), each within 1..num_draft + 1.
    Returns num_sampled (or None). Raises ValueError when they do not match."""
    seqs = [s for s in plan.seqs if s.sample]
    if num_sampled is None:
        if num_tokens != len(seqs):
            raise ValueError(f"step {plan.step_id}: {num_tokens} tokens for {len(seqs)} samples")
        return None
    if len(num_sampled) != len(seqs) or sum(num_sampled) != num_tokens:
        raise ValueError(f"step {plan.step_id}: num_sampled {len(num_sampled)} counts summing to "
                         f"{sum(num_sampled)} for {len(seqs)} samples and {num_tokens} tokens")
    for s, c in zip(seqs, num_sampled):
        if not 1 <= c <= s.num_draft + 1:
            raise ValueError(f"step {plan.step_id}: {c} tokens for {s.request_id}, "
                             f"which verified {s.num_draft} drafts")
    return num_sampled
