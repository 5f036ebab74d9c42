"""Shared steps of the hybrid GPU tests that build one `ModelRunner` after another on a tiny
checkpoint and compare their decode logits (test_hybrid_fused_gpu.py, test_hybrid_glue_gpu.py):
a prompt fed one token a step from the decode graphs, a deleted runner's memory freed before
the next is built, and bf16 paths measured against the same checkpoint run in fp32 (its
weights bf16 values: the independent truth for the rounding), position by position.
Needs CUDA (the callers skip without it).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch

from services.worker.model_runner import ModelRunner
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan
from tests.runner_driver import step_logits

V = TypeVar("V", bound=Hashable)
GREEDY = SamplingParams(temperature=0.0)


def release() -> None:
    """Free a deleted runner's memory before the next is built: its graphs hold a bound
    method of it (a reference cycle), and the next runner sizes its KV cache from
    gpu_memory_utilization minus what is in use (services/worker/gpu_memory.py)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def decode_logits(r: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """Logits [len(prompt), vocab] fp32 of each token of prompt fed one a step (decode graphs
    of 1) on slot 0, blocks 0..3."""
    table = list(range(4))
    out = [step_logits(r, StepPlan(j, [ScheduledSeq("a", [tok], j, table, True, GREEDY, 0, state_slot=0)]))
           for j, tok in enumerate(prompt)]
    return torch.cat(out).float()


@dataclass
class Bf16Run:
    """One bf16 path's decode of each prompt against the fp32 truth. logits: per prompt
    [len(prompt), vocab] fp32; errors: per prompt [len(prompt)], at each position
    max |bf16 - fp32| over max |fp32|."""

    logits: list[torch.Tensor]
    errors: list[torch.Tensor]

    @property
    def mean_error(self) -> float:
        """The per-position errors averaged over positions and prompts."""
        return float(torch.cat(self.errors).mean())


def bf16_against_fp32(build: Callable[[str, V], ModelRunner], truth: V, variants: Iterable[V],
                      prompts: list[list[int]]) -> dict[V, Bf16Run]:
    """Decode each prompt (`decode_logits`) with build("float32", truth), then with
    build("bfloat16", v) for each of variants, one runner at a time (each deleted and its
    memory released before the next is built); returns each variant's `Bf16Run` against the
    fp32 logits. build(dtype, variant): a fresh runner of that dtype on the variant's path."""
    r = build("float32", truth)
    want = [decode_logits(r, p) for p in prompts]
    del r
    release()
    runs: dict[V, Bf16Run] = {}
    for v in variants:
        r = build("bfloat16", v)
        got = [decode_logits(r, p) for p in prompts]
        del r
        release()
        runs[v] = Bf16Run(got, [(x - t).abs().amax(-1) / t.abs().amax(-1) for x, t in zip(got, want)])
    return runs
