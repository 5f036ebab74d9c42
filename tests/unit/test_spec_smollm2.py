"""Speculative decoding in the model runner on the real SmolLM2-135M-Instruct (CPU, fp32),
whose outputs follow their context (the dummy models of test_spec_runner.py mostly repeat a
token): verify steps with right, partly wrong and all-wrong drafts, n-gram prompt lookup on
text that repeats, a pending token after a verify step, and a first seq that starts past
position 0 with its context tokens (a prefix-cache hit). The truth is plain decoding through
the same runner (`tests.runner_driver.generate`, one token a step)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from services.worker.model_runner import ModelRunner
from shared.config import build_config
from shared.protocol import PENDING_TOKEN, SamplingParams, ScheduledSeq, StepPlan
from tests.runner_driver import generate, spec_run

GREEDY = SamplingParams(temperature=0.0, logprobs=2)
N = 24
TEXTS = [
    "Copy this list exactly.\nList: apples, oranges, pears, plums, cherries, grapes, lemons, limes.\n"
    "Copy: apples, oranges,",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
]


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def runner(smollm2_dir):
    cfg = build_config(cli={"model": str(smollm2_dir), "device": "cpu", "dtype": "float32",
                            "kv_cache_gib": 0.1, "max_model_len": 1024,
                            "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                   "prompt_lookup_min": 1, "prompt_lookup_max": 3}},
                       env={})
    return ModelRunner(cfg)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(t).ids for t in TEXTS]


@pytest.fixture(scope="module")
def plain(runner, prompts):
    """Plain decoding (no drafts: k = 0) with logprobs, and `generate`'s tokens equal to it."""
    run = spec_run(runner, prompts, N, 0, GREEDY)
    assert run.tokens == generate(runner, prompts, N) and run.num_drafts == 0
    assert all(len(set(t)) > 4 for t in run.tokens)  # a real continuation, not one token repeated
    return run


@pytest.mark.parametrize("wrong_at", [None, 1, 0], ids=["right", "partly-wrong", "all-wrong"])
def test_verify_steps_emit_the_tokens_and_logprobs_of_plain_decoding(runner, prompts, plain, wrong_at):
    ref = plain.tokens

    def drafts(i, outs, proposed):
        d = list(ref[i][len(outs):len(outs) + 4])
        if wrong_at is not None and wrong_at < len(d):
            d[wrong_at] = d[wrong_at] + 1
        return d

    run = spec_run(runner, prompts, N, 4, GREEDY, drafts=drafts)
    assert run.tokens == ref
    if wrong_at is None:
        assert run.num_accepted == run.num_draft_tokens > 0
    elif wrong_at == 0:
        assert run.num_accepted == 0 and run.num_draft_tokens > 0
    for a, b in zip(plain.logprobs, run.logprobs):
        assert [x.token_id for x in a] == [y.token_id for y in b] == [x.top_ids[0] for x in a]
        assert [x.rank for x in a] == [y.rank for y in b]
        assert [x.logprob for x in a] == pytest.approx([y.logprob for y in b], abs=1e-3)
        assert [x.top_logprobs for x in a] == [pytest.approx(y.top_logprobs, abs=1e-3) for y in b]


def test_ngram_lookup_on_text_that_repeats_is_lossless_and_accepts(runner, prompts, plain):
    run = spec_run(runner, prompts, N, 4, GREEDY)
    assert run.tokens == plain.tokens
    assert run.num_accepted > 0 and run.steps < plain.steps  # the copied list and code are found
    assert spec_run(runner, prompts, N, 4, GREEDY, chunk=8).tokens == plain.tokens  # prefill chunks beside verifies
    sp = SamplingParams(temperature=0.7, seed=17)
    assert spec_run(runner, prompts, N, 4, sp).tokens == generate(runner, prompts, N, sp)


def test_a_pending_token_after_a_verify_step_is_the_last_emitted_token(runner, prompts, plain):
    prompt, ref = prompts[1], plain.tokens[1]
    p = len(prompt)
    tables = {"a": [100, 101, 102], "b": [103, 104, 105]}
    sp = SamplingParams(temperature=0.0)
    seqs = [ScheduledSeq(r, prompt, 0, t, True, sp, 0) for r, t in tables.items()]
    assert runner.execute(StepPlan(0, seqs)).sampled_token_ids == [ref[0]] * 2
    d = [ref[1], ref[2], ref[3] + 1]  # two right, one wrong: three tokens emitted
    seqs = [ScheduledSeq(r, [ref[0], *d], p, t, True, sp, 1, num_draft=3) for r, t in tables.items()]
    res = runner.execute(StepPlan(1, seqs))
    assert res.num_sampled == [3, 3] and res.sampled_token_ids == ref[1:4] * 2
    seqs = [ScheduledSeq("a", [ref[3]], p + 3, tables["a"], True, sp, 4),
            ScheduledSeq("b", [PENDING_TOKEN], p + 3, tables["b"], True, sp, 4)]
    assert runner.execute(StepPlan(2, seqs)).sampled_token_ids == [ref[4], ref[4]]
    runner.execute(StepPlan(3, [], forget=["a", "b"]))
