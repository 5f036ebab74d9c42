"""A step-by-step driver of greedy speculative decoding with the draft-model proposer,
next to a target `ModelRunner` and without an engine (tests/unit/test_spec_draft_model.py):
StepViews come from the runner's `_prepare` and `run_model`, verification is point-mass
(accept while the target's argmax equals the draft), as services/worker/spec/verify.py
does for greedy requests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.kv_cache import KVCache
from services.worker.model_runner import ModelRunner
from services.worker.spec.base import ProposeRequest, StepView
from services.worker.spec.draft_model import DraftModelProposer
from shared.config import KestrelConfig
from shared.protocol import SamplingParams, ScheduledSeq

GREEDY = SamplingParams(temperature=0.0)


def with_draft_kv(cfg: KestrelConfig, runner: ModelRunner) -> DraftModelProposer:
    """The proposer of `cfg`, its KV group allocated as the runner does it (the target's
    num_blocks and block_size) and bound; the cache is its attribute `kv`."""
    prop = DraftModelProposer(cfg, cfg.speculative, runner)
    prop.kv = KVCache(prop.kv_specs(), runner.num_blocks, runner.block_size, runner.dtype,
                      runner.device)
    prop.bind_kv(prop.kv.layers)
    return prop


@dataclass
class Req:
    """One request of `spec_greedy`: `hit` prompt tokens are already in its table's blocks
    (a prefix-cache hit), n tokens to generate."""

    rid: str
    prompt: list[int]
    table: list[int]
    n: int
    hit: int = 0


def spec_greedy(runner: ModelRunner, prop: DraftModelProposer, reqs: list[Req], k: int, chunk: int | None = None):
    """Greedy speculative decoding of `reqs` together, as the runner's step does it: target
    forward, `observe`, point-mass verification (accept while the target's argmax equals the
    draft), `propose` with k drafts; a finished request is forgotten while the others run.
    Returns (outputs per rid, drafted, accepted, log of (rid, context through emitted[-1],
    drafts))."""
    done = {r.rid: r.hit for r in reqs}
    outs: dict[str, list[int]] = {r.rid: [] for r in reqs}
    drafts: dict[str, list[int]] = {r.rid: [] for r in reqs}
    log, drafted, accepted = [], 0, 0
    live = list(reqs)
    with torch.inference_mode():
        while live:
            seqs = []
            for r in live:
                d, o = done[r.rid], outs[r.rid]
                if d < len(r.prompt):
                    m = min(chunk or len(r.prompt), len(r.prompt) - d)
                    last = d + m == len(r.prompt)
                    seqs.append(ScheduledSeq(r.rid, r.prompt[d:d + m], d, r.table, last, GREEDY, 0,
                                             num_propose=k if last else 0))
                    done[r.rid] += m
                else:
                    ds = drafts[r.rid]
                    seqs.append(ScheduledSeq(r.rid, [o[-1]] + ds, len(r.prompt) + len(o) - 1, r.table, True, GREEDY,
                                             len(o), num_draft=len(ds), num_propose=k))
            ids, pos, meta = runner._prepare(seqs)
            hidden = runner.run_model(ids, pos, meta)
            view = StepView(seqs, ids, pos, meta, hidden)
            prop.observe(view)
            ends = meta.cu_seqlens_q[1:].tolist()
            preqs, ended = [], []
            for i, (r, s) in enumerate(zip(live, seqs)):
                if not s.sample:
                    continue
                a = ends[i] - s.num_draft - 1
                drawn = runner.model.compute_logits(hidden[a:ends[i]]).argmax(-1).tolist()
                n = 0
                while n < s.num_draft and drawn[n] == s.token_ids[1 + n]:
                    n += 1
                drafted, accepted = drafted + s.num_draft, accepted + n
                o = outs[r.rid]
                o.extend(drawn[:n + 1][:r.n - len(o)])
                if len(o) >= r.n:
                    ended.append(r.rid)
                    continue
                preqs.append(ProposeRequest(r.rid, i, drawn[:n + 1], len(r.prompt) + len(o) - 1, a + n, k,
                                            r.table, GREEDY, len(o)))
            if preqs:
                for pr, d in zip(preqs, prop.propose(preqs, view).token_ids):
                    drafts[pr.request_id] = d
                    r = next(x for x in live if x.rid == pr.request_id)
                    log.append((pr.request_id, r.prompt + outs[pr.request_id], d))
            if ended:
                prop.forget(ended)
                live = [r for r in live if r.rid not in ended]
    return outs, drafted, accepted, log
