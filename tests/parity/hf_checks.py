"""Checks shared by the parity tests of the MoE and hybrid families against transformers:
logits of prefills (whole or in chunks) and decode steps, greedy generation, batching,
and speculative decoding against plain greedy output."""

from __future__ import annotations

import torch

from shared.protocol import SamplingParams, ScheduledSeq, StepPlan
from tests.runner_driver import generate, spec_run, step_logits

GREEDY = SamplingParams(temperature=0.0)


def assert_logits_match(runner, hf, prompts: list[list[int]], cut_sets: list[list[int]], atol: float,
                        decode_steps: int = 4, with_slots: bool = False) -> None:
    """For each prompt and each chunking of `cut_sets` (chunk ends; the prompt's length is
    appended), prefill it through `runner` chunk by chunk, then greedy-decode
    `decode_steps` tokens, and compare the logits at every chunk end and decode step with
    transformers' forward over the same tokens (max abs difference < atol). with_slots:
    prompt i runs on state slot i (a hybrid model)."""
    for p, prompt in enumerate(prompts):
        table = list(range(-(-(len(prompt) + decode_steps) // runner.block_size)))
        slot = p if with_slots else -1
        for cuts in cut_sets:
            ends = [c for c in cuts if c < len(prompt)] + [len(prompt)]
            ours, start, toks = {}, 0, []
            for end in ends:
                seq = ScheduledSeq("r", prompt[start:end], start, table, True, GREEDY, state_slot=slot)
                ours[end - 1] = step_logits(runner, StepPlan(0, [seq]))[0]
                start = end
            for i in range(decode_steps):
                toks.append(int(ours[max(ours)].argmax()))
                pos = len(prompt) + i
                seq = ScheduledSeq("r", [toks[-1]], pos, table, True, GREEDY, i + 1, state_slot=slot)
                ours[pos] = step_logits(runner, StepPlan(0, [seq]))[0]
            with torch.no_grad():
                ref = hf(torch.tensor([prompt + toks])).logits[0].float()
            for pos, logits in ours.items():
                diff = (logits - ref[pos]).abs().max().item()
                assert diff < atol, f"prompt {p}, cuts {ends}, position {pos}: max abs diff {diff}"


def assert_greedy_matches_generate(runner, hf, prompts: list[list[int]], n: int, chunk: int) -> None:
    """`generate` through the runner (chunked prefills, batched) equals transformers'
    greedy `generate` of n tokens, prompt by prompt."""
    for prompt, got in zip(prompts, generate(runner, prompts, n, chunk=chunk)):
        with torch.no_grad():
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == ref, (prompt, got, ref)


def assert_together_equals_alone(runner, prompts: list[list[int]], n: int, chunk: int) -> None:
    """The prompts run together (mixed chunks and decodes in one step) give what each gives alone."""
    assert generate(runner, prompts, n, chunk=chunk) == [generate(runner, [p], n)[0] for p in prompts]


def assert_speculation_is_lossless(runner, plain: list[list[int]], prompts: list[list[int]], n: int, k: int,
                                   vocab: int) -> None:
    """Speculative decoding through `runner` gives `plain` (the greedy output without it),
    with the proposer's own drafts and with drafts that are the truth's next k tokens with
    the second one wrong (so some are accepted and the rest rolled back)."""
    assert spec_run(runner, prompts, n, k, chunk=9).tokens == plain

    def half_right(i, outputs, proposed):
        truth = plain[i][len(outputs):len(outputs) + k]
        return [t if j != 1 else (t + 1) % vocab for j, t in enumerate(truth)]

    forced = spec_run(runner, prompts, n, k, chunk=9, drafts=half_right)
    assert forced.tokens == plain
    assert 0 < forced.num_accepted < forced.num_draft_tokens
