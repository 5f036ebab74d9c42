"""benchmarks/spec_replay.py: the replay drafter's corruption and acceptance-length
arithmetic, and the drafter injected into a runner (dummy tiny-Qwen3 on the CPU) driven by
the engine core with the fixed policy, against a plain run of the same runner."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from benchmarks.common import load_runner, model_dir, new_core, run_core
from benchmarks.spec_replay import (ReplayProposer, accept_for_length, draft_kept, expected_length, registered,
                                    replay_drafts, without_proposer)
from benchmarks.spec_stats import spec_counters_from_stats
from services.worker import spec as spec_pkg
from shared.protocol import SamplingParams

VOCAB = 10240


def test_replay_drafts_keep_or_corrupt():
    ref = list(range(100, 140))
    assert replay_drafts(ref, 5, 4, 1.0, VOCAB) == ref[5:9]
    bad = replay_drafts(ref, 5, 4, 0.0, VOCAB)
    assert len(bad) == 4 and all(b != r for b, r in zip(bad, ref[5:9]))
    assert replay_drafts(ref, 38, 4, 1.0, VOCAB) == ref[38:]  # fewer near the end
    assert replay_drafts([VOCAB - 1], 0, 1, 0.0, VOCAB) == [0]  # corrupted ids stay in the vocabulary
    assert replay_drafts(ref, 3, 4, 0.6, VOCAB, seed=1) == replay_drafts(ref, 3, 4, 0.6, VOCAB, seed=1)


@pytest.mark.parametrize("accept,k", [(0.5, 4), (0.8, 3), (0.3, 2)])
def test_the_kept_prefix_has_the_expected_acceptance_length(accept, k):
    # a verify step accepts the kept prefix of its drafts: simulate many proposals
    n = 20000
    lengths = []
    for j in range(n):
        m = 0
        while m < k and draft_kept(7, j, m + 1, accept):
            m += 1
        lengths.append(1 + m)
    mean = sum(lengths) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in lengths) / (n - 1))
    assert abs(mean - expected_length(accept, k)) < 5 * sd / math.sqrt(n)  # 5 standard errors


def test_accept_for_length_inverts_expected_length():
    for k in (1, 2, 4, 8):
        for length in (1.0, 1.3, 2.0, k + 0.5, k + 1.0):
            if length <= k + 1:
                assert expected_length(accept_for_length(length, k), k) == pytest.approx(length, abs=1e-6)
    assert accept_for_length(5.0, 4) == 1.0 and accept_for_length(1.0, 4) == 0.0
    with pytest.raises(ValueError):
        accept_for_length(5.5, 4)
    with pytest.raises(ValueError):
        accept_for_length(0.5, 4)


def test_registered_restores_the_registry():
    before = dict(spec_pkg.PROPOSERS)
    with registered():
        assert spec_pkg.PROPOSERS["draft_model"] == ("benchmarks.spec_replay", "ReplayProposer")
    assert spec_pkg.PROPOSERS == before


@pytest.fixture(scope="module")
def replay_runner():
    folder = model_dir("tiny-qwen3")
    spec = json.dumps({"method": "draft_model", "num_speculative_tokens": 3, "policy": "fixed"})
    with registered():
        runner, _ = load_runner({"model": folder, "load_format": "dummy", "device": "cpu", "dtype": "float32",
                                 "kv_cache_gib": 0.05, "max_model_len": 512, "speculative_config": spec})
    yield runner, spec
    shutil.rmtree(folder, ignore_errors=True)


def _run(runner, prompt, n, prefix, spec=None):
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    extra = {"speculative_config": spec, "load_format": "dummy"} if spec else None
    core = new_core(runner, 4, 1024, 1, extra)
    toks: dict[str, list[int]] = {}
    _, steps, out, _ = run_core(core, runner, [(prompt, sp)], prefix, toks)
    return toks[prefix + "0"], steps, core.stats()


@pytest.mark.parametrize("accept", [1.0, 0.0, 0.6])
def test_replay_drafts_decode_as_the_plain_run(replay_runner, accept):
    runner, spec = replay_runner
    proposer = runner.proposer
    assert isinstance(proposer, ReplayProposer)
    prompt = torch.randint(3, 10000, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    n = 30
    with without_proposer(runner):
        ref, plain_steps, _ = _run(runner, prompt, n, f"p{accept}_")
    assert runner.proposer is proposer
    proposer.refs, proposer.accept, proposer.off_track = {f"s{accept}_0": ref}, accept, 0
    toks, steps, stats = _run(runner, prompt, n, f"s{accept}_", spec)
    assert toks == ref and proposer.off_track == 0
    c = spec_counters_from_stats(stats)
    assert c is not None and c["num_drafts"] > 0
    if accept == 1.0:  # every draft accepted: far fewer steps than plain decoding
        assert c["num_accepted_tokens"] == c["num_draft_tokens"] and steps < plain_steps / 2
    elif accept == 0.0:
        assert c["num_accepted_tokens"] == 0
    else:
        assert 0 < c["num_accepted_tokens"] < c["num_draft_tokens"]
