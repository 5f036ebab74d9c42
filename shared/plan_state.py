"""The workers' copy of what the engine sends once per request: block tables and sampling
parameters.

A running request's block table only grows (blocks are appended as it computes; a
preemption frees them all and the request starts over), and its SamplingParams never
change. So the engine sends a request's whole table and its parameters in its first
ScheduledSeq (table_start 0), then only the blocks appended since (table_start = the
blocks the workers hold) and sampling None; StepPlan.forget names requests that ended.
At 256 decodes of 1K-token contexts this takes ~18K block ids and 256 parameter structs
out of every plan. Every consumer of plans (each worker's model runner, and the toy
workers of the tests) applies `PlanState.resolve` to each plan, in plan order.
"""

from __future__ import annotations

from shared.protocol import SamplingParams, StepPlan


class PlanState:
    """Block tables and sampling parameters of the requests the engine has sent, by
    request id. Use `resolve(plan)` on every plan, in order."""

    def __init__(self) -> None:
        self.known: dict[str, tuple[list[int], SamplingParams]] = {}

    def resolve(self, plan: StepPlan) -> StepPlan:
        """Make every seq of `plan` whole, in place: block_table becomes the full table
        (a list the next plan may extend: read it before the next resolve), sampling the
        request's parameters, table_start 0; requests in plan.forget are dropped first.
        A held table only grows: an increment that starts inside it gets a new list, so the
        entries of a list once handed out never change. Returns plan. Raises ValueError for
        an increment of a request this state does not hold, or one that starts past its
        table (the engine and workers disagree), and for a first seq without sampling
        parameters."""
        known = self.known
        for rid in plan.forget:
            known.pop(rid, None)
        for s in plan.seqs:
            rid = s.request_id
            if s.table_start == 0:
                if s.sampling is None:
                    raise ValueError(f"request {rid}: first seq without sampling parameters")
                known[rid] = (list(s.block_table), s.sampling)
            else:
                entry = known.get(rid)
                if entry is None or len(entry[0]) < s.table_start:
                    have = "none" if entry is None else f"{len(entry[0])} blocks"
                    raise ValueError(f"request {rid}: table increment from block {s.table_start}, "
                                     f"the worker holds {have}")
                table = entry[0]
                if s.table_start < len(table):  # a list's entries never change once held
                    table = table[:s.table_start]  # (`DecodeGraphs.run` stages only what grew)
                table.extend(s.block_table)
                known[rid] = (table, entry[1] if s.sampling is None else s.sampling)
            table, sampling = known[rid]
            s.block_table, s.sampling, s.table_start = table, sampling, 0
        return plan
