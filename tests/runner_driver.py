"""Drive a `ModelRunner` with hand-made StepPlans, without an engine: for tests and
benchmarks (the parity tests, the pending-token tests, the GPU tests, decode_latency.py).

`generate` runs prompts to n new tokens through `ModelRunner.execute`; `step_logits` runs
one step like `execute` (the KV cache is written the same way) and returns the logits
instead of sampling, which is the runner's forward half (`ModelRunner._forward`), read here
so that serving keeps one entry point. `spec_run` / `spec_generate` drive speculative
decoding as the engine does (docs/ARCHITECTURE.md §5.5): each step's drafts (the runner's
proposer's, or a test's own) go into the request's next seq as `num_draft` tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.worker.model_runner import ModelRunner
from shared.ngram import NgramIndex
from shared.protocol import PENDING_TOKEN, SamplingParams, ScheduledSeq, StepPlan, StepResult, TokenLogprob


def step_logits(runner: ModelRunner, plan: StepPlan) -> torch.Tensor:
    """Run `plan`'s forward and return the logits: [num sample=True seqs, vocab] fp32, plan
    order (a seq with drafts has num_draft + 1 rows). Nothing is sampled and no KV tier copy runs. Raises ValueError like execute, and
    when no sequence samples."""
    with torch.inference_mode():
        runner.plan_state.resolve(plan)
        logits = runner._forward(plan).logits
    if logits is None:
        raise ValueError(f"step {plan.step_id}: no sequence samples")
    return logits


def generate(runner: ModelRunner, prompts: list[list[int]], n: int,
             sampling: SamplingParams | None = None, chunk: int | None = None,
             pending: bool = False) -> list[list[int]]:
    """n new token ids per prompt, through `runner.execute`.

    Each prompt gets its own blocks (0, 1, ... in prompt order). Prefills run in chunks of
    at most `chunk` tokens (None = whole prompt); a sequence decodes as soon as its prefill
    is done, so chunked runs mix prefill chunks and decodes in one step. pending: decodes
    feed PENDING_TOKEN (the runner's own copy of the last draw, as under async scheduling)
    instead of the token that came back. A hybrid model's prompt i runs on state slot i
    (the runner's state cache, docs/ARCHITECTURE.md §4.7).
    Raises ValueError when the KV cache is too small.
    """
    sampling = sampling or SamplingParams(temperature=0.0)
    bs = runner.block_size
    has_state = getattr(runner, "state_cache", None) is not None

    def slot(i: int) -> int:
        return i if has_state else -1

    tables, nxt = [], 0
    for p in prompts:
        need = -(-(len(p) + n) // bs)
        tables.append(list(range(nxt, nxt + need)))
        nxt += need
    if nxt > runner.num_blocks:
        raise ValueError(f"needs {nxt} KV blocks, the runner has {runner.num_blocks}")
    done = [0] * len(prompts)  # prompt tokens already run
    outs: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(len(o) < n for o in outs):
        seqs, who = [], []
        for i, p in enumerate(prompts):
            if done[i] < len(p):
                m = min(chunk or len(p), len(p) - done[i])
                last = done[i] + m == len(p)
                seqs.append(ScheduledSeq(f"r{i}", p[done[i]:done[i] + m], done[i], tables[i], last, sampling, 0,
                                         state_slot=slot(i)))
                done[i] += m
                if last:
                    who.append(i)
            elif len(outs[i]) < n:
                o = outs[i]
                seqs.append(ScheduledSeq(f"r{i}", [PENDING_TOKEN if pending else o[-1]], len(p) + len(o) - 1,
                                         tables[i], True, sampling, len(o), state_slot=slot(i)))
                who.append(i)
        for i, tok in zip(who, runner.execute(StepPlan(step, seqs)).sampled_token_ids):
            outs[i].append(tok)
        step += 1
    return outs


def greedy_generate(runner: ModelRunner, prompt_ids: list[int], n: int, chunk: int | None = None) -> list[int]:
    """n greedy tokens after prompt_ids (see `generate`)."""
    return generate(runner, [prompt_ids], n, chunk=chunk)[0]


# drafts(i, outputs, proposed) -> the drafts to verify next for prompt i: given its outputs so
# far and the runner's proposal for it ([] without a proposer)
DraftFn = Callable[[int, list[int], list[int]], list[int]]


@dataclass
class SpecRun:
    """What `spec_run` produced. tokens: n per prompt. logprobs: per prompt, one per token
    when sampling.logprobs is set (else empty lists). steps: plans executed. num_drafts:
    verify seqs with at least one draft; num_draft_tokens: drafts verified; num_accepted:
    drafts accepted (emitted tokens beyond the first of each sampled seq). results: every
    StepResult, in order."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprob]]
    steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    results: list[StepResult] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per verify seq: 1 + accepted / drafts (1.0 without drafts)."""
        return 1.0 + self.num_accepted / self.num_drafts if self.num_drafts else 1.0


def ngram_drafts(prompts: list[list[int]], min_n: int, max_n: int, k: int = 16) -> DraftFn:
    """A `DraftFn` that plays the engine's n-gram drafter (services/engine/ngram_drafts.py):
    up to k drafts looked up in prompt i + its outputs (one `NgramIndex` per prompt)."""
    index = [NgramIndex(min_n, max_n) for _ in prompts]

    def draft(i: int, outs: list[int], proposed: list[int]) -> list[int]:
        ctx = prompts[i] + outs
        return index[i].lookup(lambda a, b: ctx[a:b], len(ctx), k)
    return draft


def spec_run(runner: ModelRunner, prompts: list[list[int]], n: int, k: int,
             sampling: SamplingParams | None = None, chunk: int | None = None,
             drafts: DraftFn | None = None) -> SpecRun:
    """n new tokens per prompt with speculative decoding through `runner.execute`, the loop
    of plan -> result -> next plan that the engine runs (§5.5).

    Every sampled seq asks for k drafts (num_propose = k); the next seq of the request is
    [last token, d1..dj] with num_draft = j, where the drafts are the runner's proposal
    (`StepResult.draft_token_ids`), for method "ngram" (no worker proposer: its drafts are
    the engine's) the engine's lookup over prompt + outputs (`shared.ngram.NgramIndex`, the
    runner's prompt_lookup range), or, with `drafts` given, what it returns (truncated to k,
    e.g. a test's right or wrong guesses). Drafts are also cut so that no step emits past
    n tokens. Tokens emitted past n are dropped; finished requests are named in the next
    plan's `forget`. Prefill in chunks of at most `chunk` tokens (None: whole prompts),
    each prompt on its own blocks (0, 1, ... in prompt order). With k = 0 and no `drafts`,
    this is plain decoding. A hybrid model's prompt i runs on state slot i. Raises
    ValueError when the KV cache is too small, and for a step result with an error.
    """
    sampling = sampling or SamplingParams(temperature=0.0)
    if drafts is None and runner.proposer is None and getattr(runner, "spec_method", None) == "ngram":
        drafts = ngram_drafts(prompts, *runner.prompt_lookup)
    bs = runner.block_size
    slot = -1 if getattr(runner, "state_cache", None) is None else 0
    tables, nxt = [], 0
    for p in prompts:
        need = -(-(len(p) + n + k + 1) // bs)
        tables.append(list(range(nxt, nxt + need)))
        nxt += need
    if nxt > runner.num_blocks:
        raise ValueError(f"needs {nxt} KV blocks, the runner has {runner.num_blocks}")
    run = SpecRun([[] for _ in prompts], [[] for _ in prompts])
    done = [0] * len(prompts)
    pending_drafts: list[list[int]] = [[] for _ in prompts]
    forget: list[str] = []
    finished = [False] * len(prompts)
    while not all(finished):
        seqs, who = [], []
        for i, p in enumerate(prompts):
            o = run.tokens[i]
            if finished[i]:
                continue
            if done[i] < len(p):
                m = min(chunk or len(p), len(p) - done[i])
                last = done[i] + m == len(p)
                seqs.append(ScheduledSeq(f"r{i}", p[done[i]:done[i] + m], done[i], tables[i], last, sampling, 0,
                                         num_propose=k if last else 0, state_slot=slot + i if slot >= 0 else -1))
                done[i] += m
            else:
                d = pending_drafts[i][:max(0, min(k, n - len(o) - 1))]
                seqs.append(ScheduledSeq(f"r{i}", [o[-1], *d], len(p) + len(o) - 1, tables[i], True, sampling,
                                         len(o), num_draft=len(d), num_propose=k,
                                         state_slot=slot + i if slot >= 0 else -1))
                run.num_drafts += bool(d)
                run.num_draft_tokens += len(d)
            if seqs[-1].sample:
                who.append(i)
        result = runner.execute(StepPlan(run.steps, seqs, forget=forget))
        if result.error:
            raise ValueError(f"step {run.steps}: {result.error}")
        run.results.append(result)
        run.steps += 1
        forget = []
        counts = result.num_sampled or [1] * len(who)
        off = 0
        for i, c in zip(who, counts):
            toks = result.sampled_token_ids[off:off + c]
            lps = result.logprobs[off:off + c] if result.logprobs else []
            off += c
            run.num_accepted += c - 1
            room = n - len(run.tokens[i])
            run.tokens[i].extend(toks[:room])
            run.logprobs[i].extend(lp for lp in lps[:room] if lp is not None)
            proposed = result.draft_token_ids.get(f"r{i}", [])
            pending_drafts[i] = drafts(i, list(run.tokens[i]), proposed)[:k] if drafts else proposed
            if len(run.tokens[i]) >= n:
                finished[i] = True
                forget.append(f"r{i}")
    if forget:
        runner.execute(StepPlan(run.steps, [], forget=forget))  # the runner drops their state
    return run


def spec_generate(runner: ModelRunner, prompts: list[list[int]], n: int, k: int,
                  sampling: SamplingParams | None = None, chunk: int | None = None,
                  drafts: DraftFn | None = None) -> list[list[int]]:
    """n new token ids per prompt with speculative decoding (`spec_run`'s tokens)."""
    return spec_run(runner, prompts, n, k, sampling, chunk, drafts).tokens
