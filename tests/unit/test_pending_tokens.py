"""Async scheduling's pending tokens in the model runner (CPU, dummy tiny-Qwen3 weights):
a decode that feeds PENDING_TOKEN, which the runner reads from its own copy of the last
draw, gives the same tokens as feeding the token that came back. The truth is the same
runner driven with explicit tokens. The GPU twin (CUDA graphs) is in tests/gpu."""

from __future__ import annotations

import shutil

import pytest
import torch

from benchmarks.common import model_dir
from services.worker.model_runner import ModelRunner
from tests.runner_driver import generate
from shared.config import build_config
from shared.protocol import PENDING_TOKEN, SamplingParams, ScheduledSeq, StepPlan


@pytest.fixture(scope="module")
def runner():
    folder = model_dir("tiny-qwen3")
    try:
        cfg = build_config(cli={"model": folder, "load_format": "dummy", "device": "cpu",
                                "dtype": "float32", "kv_cache_gib": 0.05, "max_model_len": 512}, env={})
        yield ModelRunner(cfg)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the temporary model folder (config.json only)


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 10000, (n,), generator=g).tolist() for n in (5, 70, 17, 1, 33)]


@pytest.mark.parametrize("chunk", [None, 16])
def test_pending_tokens_give_the_tokens_of_explicit_ones(runner, chunk):
    """chunk 16: plans mix prefill chunks and decodes, so the pending rows sit at other
    flat positions than the last draw's rows (the gather path)."""
    prompts = _prompts(0)
    explicit = generate(runner, prompts, 9, chunk=chunk)
    assert generate(runner, prompts, 9, chunk=chunk, pending=True) == explicit
    sp = SamplingParams(temperature=0.8, seed=7)  # seeded random draws follow too
    assert generate(runner, prompts, 9, sp, chunk=chunk, pending=True) == generate(runner, prompts, 9, sp, chunk=chunk)


def test_a_pending_token_with_no_draw_of_the_last_step_is_an_error(runner):
    sp = SamplingParams(temperature=0.0)
    runner.execute(StepPlan(0, [ScheduledSeq("a", [5, 6, 7], 0, [0], True, sp)]))
    with pytest.raises(ValueError, match="pending token"):
        runner.execute(StepPlan(1, [ScheduledSeq("b", [PENDING_TOKEN], 3, [1], True, sp, 1)]))
    # a failed step leaves no draw behind: its requests' pending tokens are errors too
    with pytest.raises(ValueError, match="pending token"):
        runner.execute(StepPlan(2, [ScheduledSeq("a", [PENDING_TOKEN], 3, [0], True, sp, 1)]))


def test_pending_ids_reference_rows_of_the_last_draw():
    # how the CUDA graphs stage a pending input: -(row + 1) of the last draw, resolved on the device
    from kernels.pending_ids import encode_pending, resolve_pending_ids, resolve_pending_ids_ref
    last = torch.tensor([50, 60, 70])
    ids = torch.tensor([1, encode_pending(2), 0, encode_pending(0), 9])
    assert resolve_pending_ids(ids, last) is ids
    assert ids.tolist() == [1, 70, 0, 50, 9]
    assert resolve_pending_ids_ref(torch.tensor([3, 4]), last).tolist() == [3, 4]
