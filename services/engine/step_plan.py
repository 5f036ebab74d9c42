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
"""

from __future__ import annotations

from services.engine.request import Request
from shared.protocol import PENDING_TOKEN, ScheduledSeq, StepPlan


def build_plan(step_id: int, scheduled: list[tuple[Request, int]], forget: list[str]) -> StepPlan:
    """The plan of step `step_id` for `scheduled` ((request, tokens to compute this step),
    in plan order; each request's blocks already cover its chunk). forget: ids of ended
    requests whose tables the workers drop (`StepPlan.forget`).

    Advances each request as the plan is sent: `num_computed_tokens` to its chunk's end (the
    KV is written before any later plan runs), `worker_blocks` to its whole table, and
    `inflight` by one when its seq samples. The plan has no tier copies (the scheduler adds
    the connector's)."""
    seqs = []
    for req, n in scheduled:
        start = req.num_computed_tokens
        end = start + n
        known = req.worker_blocks  # the workers hold the rest (shared.plan_state)
        toks = req.token_slice(start, min(end, req.num_tokens))
        if end > req.num_tokens:  # a decode of the token step N is sampling now
            toks.append(PENDING_TOKEN)
        seq = ScheduledSeq(
            request_id=req.request_id,
            token_ids=toks,
            start_pos=start,
            block_table=req.block_ids[known:] if known else list(req.block_ids),
            sample=end == req.num_tokens + req.inflight and req.sampling.max_tokens > 0,
            sampling=None if known else req.sampling,
            output_index=len(req.output_token_ids) + req.inflight,
            table_start=known,
        )
        req.worker_blocks = len(req.block_ids)
        req.num_computed_tokens = end
        if seq.sample:
            req.inflight += 1
        if req.has_penalty:
            seq.penalty_token_ids = req.prompt_token_ids + req.output_token_ids
            seq.num_prompt_tokens = req.num_prompt_tokens
        elif req.wants_prompt_logprobs:
            seq.num_prompt_tokens = req.num_prompt_tokens
        if seq.sample and req.grammar is not None:
            seq.allowed_token_bitmask = req.grammar.bitmask()
        seqs.append(seq)
    return StepPlan(step_id=step_id, seqs=seqs, forget=forget)
