"""Speculative decoding through the whole engine core on the real SmolLM2-135M-Instruct (CPU,
fp32): `EngineCore` (scheduler, drafts, roll-back, stop checks) on an in-process executor
over a `ModelRunner` with the n-gram proposer (docs/ARCHITECTURE.md §5.5). The truth is the
same requests without speculation through the same runner: greedy tokens, finish reasons
and logprobs equal, with async scheduling and a prefix-cache hit (a first seq that starts
past position 0 carries its context to the proposer)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from services.engine.core import EngineCore
from services.engine.executor import InProcessExecutor
from services.worker.model_runner import ModelRunner
from shared import protocol as P
from shared.config import build_config
from shared.model_spec import model_spec_for
from tests.unit.engine_rig import Outbox, drive

TEXTS = [
    "Copy this list exactly.\nList: apples, oranges, pears, plums, cherries, grapes, lemons, limes.\n"
    "Copy: apples, oranges,",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "Repeat: the quick brown fox jumps over the lazy dog. Repeat: the quick brown fox",
]
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "policy": "fixed"})


def _cfg(smollm2_dir, spec):
    return build_config(cli={"model": str(smollm2_dir), "device": "cpu", "dtype": "float32",
                             "kv_cache_gib": 0.1, "max_num_seqs": 4, "max_model_len": 512,
                             "max_num_batched_tokens": 256, "speculative_config": spec}, env={})


@pytest.fixture(scope="module")
def runner(smollm2_dir):
    return ModelRunner(_cfg(smollm2_dir, SPEC))  # the proposer is the runner's; plain runs ask none


def _run(smollm2_dir, runner, spec, prefix: str, prompts: list[list[int]]):
    cfg = _cfg(smollm2_dir, spec)
    core = EngineCore(cfg, model_spec_for(cfg), runner.num_blocks, seed=0)
    for i, p in enumerate(prompts):  # twice each: the second one hits the first's blocks
        for j in range(2):
            sp = P.SamplingParams(temperature=0, max_tokens=32, logprobs=1, ignore_eos=j == 1)
            assert core.add(b"fe", P.AddRequest(f"{prefix}{i}.{j}", p, sp, float(2 * i + j))) is None
    outbox = Outbox()
    drive(core, InProcessExecutor(runner), True, outbox, timeout_s=600)
    got = {}
    for rid, outs in outbox.outputs.items():
        assert outs[-1].error is None, outs[-1]
        got[rid[len(prefix):]] = (outbox.tokens(rid), outs[-1].finish_reason,
                                  [lp.logprob for o in outs for lp in o.logprobs])
    return got, core.stats()


def test_greedy_outputs_with_ngram_speculation_equal_plain_decoding(smollm2_dir, runner):
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in TEXTS]
    plain, _ = _run(smollm2_dir, runner, None, "p", prompts)
    spec, stats = _run(smollm2_dir, runner, SPEC, "s", prompts)
    assert plain.keys() == spec.keys()
    for rid in plain:
        assert spec[rid][:2] == plain[rid][:2], rid
        assert spec[rid][2] == pytest.approx(plain[rid][2], abs=1e-4), rid
    assert stats["spec_decode_num_accepted_tokens"] > 10, stats
    assert stats["prefix_cache_hits"] > 0
