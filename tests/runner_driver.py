"""Drive a `ModelRunner` with hand-made StepPlans, without an engine: for tests and
benchmarks (the parity tests, the pending-token tests, the GPU tests, decode_latency.py).

`generate` runs prompts to n new tokens through `ModelRunner.execute`; `step_logits` runs
one step like `execute` (the KV cache is written the same way) and returns the logits
instead of sampling, which is the runner's forward half (`ModelRunner._forward`), read here
so that serving keeps one entry point.
"""

from __future__ import annotations

import torch

from services.worker.model_runner import ModelRunner
from shared.protocol import PENDING_TOKEN, SamplingParams, ScheduledSeq, StepPlan


def step_logits(runner: ModelRunner, plan: StepPlan) -> torch.Tensor:
    """Run `plan`'s forward and return the logits: [num sample=True seqs, vocab] fp32, plan
    order. Nothing is sampled and no KV tier copy runs. Raises ValueError like execute, and
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
    instead of the token that came back.
    Raises ValueError when the KV cache is too small.
    """
    sampling = sampling or SamplingParams(temperature=0.0)
    bs = runner.block_size
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
                seqs.append(ScheduledSeq(f"r{i}", p[done[i]:done[i] + m], done[i], tables[i], last, sampling, 0))
                done[i] += m
                if last:
                    who.append(i)
            elif len(outs[i]) < n:
                o = outs[i]
                seqs.append(ScheduledSeq(f"r{i}", [PENDING_TOKEN if pending else o[-1]], len(p) + len(o) - 1,
                                         tables[i], True, sampling, len(o)))
                who.append(i)
        for i, tok in zip(who, runner.execute(StepPlan(step, seqs)).sampled_token_ids):
            outs[i].append(tok)
        step += 1
    return outs


def greedy_generate(runner: ModelRunner, prompt_ids: list[int], n: int, chunk: int | None = None) -> list[int]:
    """n greedy tokens after prompt_ids (see `generate`)."""
    return generate(runner, [prompt_ids], n, chunk=chunk)[0]
