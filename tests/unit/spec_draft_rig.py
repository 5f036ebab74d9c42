"""Greedy speculative decoding with the runner's draft-model proposer, step by step through
`ModelRunner.execute` with hand-made plans (tests/unit/test_spec_draft_model.py): unlike
`tests.runner_driver.spec_run`, each request brings its own block table and may start at a
prefix-cache hit, so that tests can preempt (a request again from position 0, table_start
0, on other blocks), end requests while others run (`StepPlan.forget`) and share blocks."""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.model_runner import ModelRunner
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Req:
    """One request of `spec_greedy`: `hit` prompt tokens are already in its table's blocks
    (a prefix-cache hit), n tokens to generate. The table must cover len(prompt) + n + 2k
    tokens (a verify seq of k drafts, then k more proposed)."""

    rid: str
    prompt: list[int]
    table: list[int]
    n: int
    hit: int = 0


@dataclass
class SpecLog:
    """outputs: n tokens per request id. drafted / accepted: drafts verified and accepted.
    proposals: (request id, its tokens through the last emitted one, the drafts proposed
    after them), one per step that proposed for an unfinished request."""

    outputs: dict[str, list[int]]
    drafted: int
    accepted: int
    proposals: list[tuple[str, list[int], list[int]]]


def spec_greedy(runner: ModelRunner, reqs: list[Req], k: int, chunk: int | None = None) -> SpecLog:
    """Run `reqs` together to n greedy tokens each, every sampled seq asking for k drafts
    and the next one verifying all of them (plans carry whole tables and the sampling
    parameters every step); a request that reached n is named in the next plan's forget
    while the others run on. Prefill in chunks of at most `chunk` tokens (None: whole).
    Raises ValueError for a step result with an error."""
    done = {r.rid: r.hit for r in reqs}
    log = SpecLog({r.rid: [] for r in reqs}, 0, 0, [])
    drafts: dict[str, list[int]] = {r.rid: [] for r in reqs}
    live, forget, step = list(reqs), [], 0
    while live:
        seqs = []
        for r in live:
            d, o = done[r.rid], log.outputs[r.rid]
            if d < len(r.prompt):
                m = min(chunk or len(r.prompt), len(r.prompt) - d)
                last = d + m == len(r.prompt)
                seqs.append(ScheduledSeq(r.rid, r.prompt[d:d + m], d, r.table, last, GREEDY, 0,
                                         num_propose=k if last else 0))
                done[r.rid] += m
            else:
                ds = drafts[r.rid]
                seqs.append(ScheduledSeq(r.rid, [o[-1], *ds], len(r.prompt) + len(o) - 1, r.table, True, GREEDY,
                                         len(o), num_draft=len(ds), num_propose=k))
        result = runner.execute(StepPlan(step, seqs, forget=forget))
        if result.error:
            raise ValueError(f"step {step}: {result.error}")
        step, forget = step + 1, []
        sampled = [(r, s) for r, s in zip(live, seqs) if s.sample]
        counts = result.num_sampled or [1] * len(sampled)
        off = 0
        for (r, s), c in zip(sampled, counts):
            toks, off = result.sampled_token_ids[off:off + c], off + c
            log.drafted, log.accepted = log.drafted + s.num_draft, log.accepted + c - 1
            o = log.outputs[r.rid]
            o.extend(toks[:r.n - len(o)])
            if len(o) >= r.n:
                forget.append(r.rid)
                continue
            drafts[r.rid] = result.draft_token_ids.get(r.rid, [])
            log.proposals.append((r.rid, r.prompt + o, drafts[r.rid]))
        live = [r for r in live if r.rid not in forget]
    runner.execute(StepPlan(step, [], forget=forget))
    return log


def spec_sample(runner: ModelRunner, prompt: list[int], params: list[SamplingParams], n: int,
                k: int) -> tuple[list[list[int]], int, int]:
    """One request per `params` entry (each its own seed), all on `prompt`, run together to
    n tokens each, every sampled seq asking for k drafts and the next verifying them (k = 0:
    plain decoding). Returns (tokens per request, drafts verified, drafts accepted)."""
    bs = runner.block_size
    per = -(-(len(prompt) + n + 2 * k) // bs)
    ids = [f"s{i}" for i in range(len(params))]
    toks: dict[str, list[int]] = {r: [] for r in ids}
    drafted = accepted = step = 0
    seqs = [ScheduledSeq(r, prompt, 0, list(range(i * per, (i + 1) * per)), True, p, 0, num_propose=k)
            for i, (r, p) in enumerate(zip(ids, params))]
    while seqs:
        result = runner.execute(StepPlan(step, seqs))
        if result.error:
            raise ValueError(f"step {step}: {result.error}")
        step, off, nxt = step + 1, 0, []
        for s, c in zip(seqs, result.num_sampled or [1] * len(seqs)):
            o = toks[s.request_id]
            o.extend(result.sampled_token_ids[off:off + c][:n - len(o)])
            off += c
            drafted, accepted = drafted + s.num_draft, accepted + c - 1
            if len(o) < n:
                d = result.draft_token_ids.get(s.request_id, [])[:n - len(o) - 1]
                nxt.append(ScheduledSeq(s.request_id, [o[-1], *d], len(prompt) + len(o) - 1, s.block_table, True,
                                        s.sampling, len(o), num_draft=len(d), num_propose=k))
        seqs = nxt
    runner.execute(StepPlan(step, [], forget=ids))
    return [toks[r] for r in ids], drafted, accepted
