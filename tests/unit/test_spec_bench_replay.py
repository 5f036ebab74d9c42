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
                                    replay_drafts, settle_reference, without_proposer)
from benchmarks.spec_step_kinds import StepKindTimer, step_kind
from benchmarks.spec_stats import spec_counters_from_stats
from services.worker import spec as spec_pkg
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan
from tests.unit.verify_graphs_rig import EagerReplayGraphs

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


def test_settle_reference_moves_the_first_difference_forward():
    # a fake speculative run: on the reference up to its first token that is not the run's
    # own (truth), which it emits, then the plain run's continuation (the reference's tail)
    truth = list(range(200, 240))
    plain = list(truth)
    plain[10], plain[30] = 7, 8

    def run(ref):
        m = next((i for i, (a, b) in enumerate(zip(ref, truth)) if a != b), None)
        return list(truth) if m is None else truth[:m + 1] + plain[m + 1:]

    assert settle_reference(plain, run, 8) == (truth, 3, True)
    assert settle_reference(plain, run, 2) == (truth, 2, False)  # the last run was not checked
    assert settle_reference(truth, run, 8) == (truth, 1, True)


def test_a_wrong_start_reference_settles_on_the_runs_own_tokens(replay_runner):
    runner, spec = replay_runner
    proposer = runner.proposer
    prompt = torch.randint(3, 10000, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    n = 30
    with without_proposer(runner):
        ref, _, _ = _run(runner, prompt, n, "pw_")
    start = list(ref)
    start[10] = (start[10] + 1) % VOCAB  # the "plain" reference leaves the run's output at 10
    runs = []

    def run(tokens):
        prefix = f"sw{len(runs)}_"
        proposer.refs, proposer.accept, proposer.off_track = {prefix + "0": tokens}, 0.8, 0
        runs.append(_run(runner, prompt, n, prefix, spec)[0])
        runs[-1] = (runs[-1], proposer.off_track)
        return runs[-1][0]

    settled, used, ok = settle_reference(start, run, 5)
    assert (settled, used, ok) == (ref, 2, True)  # fp32 on the CPU: speculative output = plain output
    assert runs[0][1] > 0 and runs[1][1] == 0  # off the wrong reference after index 10; on the settled one


def test_step_kind_of_plans():
    def seq(toks, k=0, prop=0):
        return ScheduledSeq("r", toks, 5, [0], True, SamplingParams(), 0, num_draft=k, num_propose=prop)

    assert step_kind(StepPlan(0, [seq([1, 2, 3])]), False, False) == "prefill"
    assert step_kind(StepPlan(0, [seq([1, 2, 3], k=2)]), True, True) == "verify_graph"
    assert step_kind(StepPlan(0, [seq([1, 2, 3], k=2), seq([4])]), False, False) == "verify_eager"
    assert step_kind(StepPlan(0, [seq([1], prop=3)]), False, True) == "no_draft_graph"
    assert step_kind(StepPlan(0, [seq([1])]), False, False) == "decode_eager"


@pytest.mark.parametrize("stand_in", [False, True])
def test_step_kinds_count_the_runs_steps(replay_runner, stand_in):
    runner, spec = replay_runner
    proposer = runner.proposer
    prompt = torch.randint(3, 10000, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    n = 30
    saved = runner.verify_graphs
    if stand_in:  # verify steps through the verify-graph path (tests/unit/verify_graphs_rig.py)
        runner.verify_graphs = EagerReplayGraphs(runner._verify_graph_forward, 1, 3, runner.max_model_len,
                                                 runner.block_size, (runner.num_blocks - 1) * runner.block_size)
    tolist, run_model = torch.Tensor.tolist, runner.run_model
    try:
        with without_proposer(runner):
            ref, _, _ = _run(runner, prompt, n, f"pk{stand_in}_")
            timer = StepKindTimer(runner)
            with timer:
                run_core(new_core(runner, 4, 1024, 1), timer,
                         [(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))], "pt")
        plain = timer.summary()
        assert plain["total"]["steps"] == n and plain["prefill"]["steps"] == 1
        assert plain["decode_eager"]["steps"] == n - 1
        proposer.refs, proposer.accept = {f"sk{stand_in}_0": ref}, 0.6
        timer = StepKindTimer(runner)
        replays = runner.verify_graphs.replays if stand_in else 0
        with timer:
            core = new_core(runner, 4, 1024, 1, {"speculative_config": spec, "load_format": "dummy"})
            toks: dict[str, list[int]] = {}
            _, steps, _, _ = run_core(core, timer, [(prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                                            ignore_eos=True))], f"sk{stand_in}_", toks)
        assert toks[f"sk{stand_in}_0"] == ref
        kinds = timer.summary()
        c = spec_counters_from_stats(core.stats())
        verify = "verify_graph" if stand_in else "verify_eager"
        assert kinds[verify]["steps"] == c["num_drafts"]  # a verify step at batch 1 verifies one proposal
        assert kinds["total"]["steps"] == steps == sum(r["steps"] for k, r in kinds.items() if k != "total")
        if stand_in:
            assert runner.verify_graphs.replays - replays == c["num_drafts"]
        row = kinds[verify]
        assert 0 <= row["before_forward_ms_median"] <= row["wall_ms_median"]
        assert 0 <= row["after_last_read_ms_median"] <= row["wall_ms_median"]
    finally:
        runner.verify_graphs = saved
    assert torch.Tensor.tolist is tolist and runner.run_model == run_model  # the hooks are gone
    assert "run_model" not in runner.__dict__
