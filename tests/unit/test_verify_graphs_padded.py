"""Verify steps of mixed k (decodes among them) through the verify-graph path of the model
runner (services/worker/verify_graphs.py, verify_layout.py, model_runner._verify_graph), on
the CPU with dummy tiny-Qwen3 weights and the FakeDrafter (tests/unit/spec_rig.py): the
graphs are `EagerReplayGraphs` (tests/unit/verify_graphs_rig.py: the real buffers and
staging, each replay run eagerly with the reference attention). Truths: the same step run
eagerly (logits, emitted tokens, the proposer's view and requests, both KV groups) and plain
decoding (`tests.runner_driver.generate`) for the emitted tokens.
tests/gpu/test_verify_graphs_gpu.py replays real CUDA graphs."""

from __future__ import annotations

import shutil

import pytest
import torch

from benchmarks.common import model_dir
from services.worker import spec as spec_pkg
from services.worker.model_runner import ModelRunner
from shared.config import build_config
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan
from tests.runner_driver import generate, spec_run
from tests.unit.spec_rig import FakeDrafter
from tests.unit.verify_graphs_rig import EagerReplayGraphs, check_mixed_step

K = 4
GREEDY = SamplingParams(temperature=0.0)

@pytest.fixture(autouse=True)
def _mixed_k_on(monkeypatch):
    """Mixed-k steps replay the graph path here (verify_graphs.MIXED_K is off by default)."""
    from services.worker import verify_graphs
    monkeypatch.setattr(verify_graphs, "MIXED_K", True)



@pytest.fixture(scope="module")
def rig():
    d = model_dir("tiny-qwen3")
    mp = pytest.MonkeyPatch()
    mp.setitem(spec_pkg.PROPOSERS, "draft_model", ("tests.unit.spec_rig", "FakeDrafter"))
    try:
        cli = {"model": d, "load_format": "dummy", "device": "cpu", "dtype": "float32", "kv_cache_gib": 0.05,
               "max_model_len": 512, "speculative_config": {"method": "draft_model", "num_speculative_tokens": K}}
        r = ModelRunner(build_config(cli=cli, env={}))
    finally:
        mp.undo()
    fake = FakeDrafter.last
    assert fake is not None and r.proposer is fake and r.verify_graphs is None  # no graphs on the CPU
    scratch = (r.num_blocks - 1) * r.block_size  # the last block: no test seq's
    vg = EagerReplayGraphs(r._verify_graph_forward, 8, K, r.max_model_len, r.block_size, scratch)
    yield r, fake, vg
    shutil.rmtree(d, ignore_errors=True)


def _prompts(lengths):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 10000, (n,), generator=g).tolist() for n in lengths]


def test_a_mixed_k_step_replayed_padded_equals_the_eager_step(rig):
    r, fake, vg = rig
    ks = (3, 0, 1, 4, 2)  # K = 4: every seq padded to 5 rows
    prompts = _prompts((5, 40, 17, 9, 23))
    ref = generate(r, prompts, 6)
    tables = [list(range(40 + 4 * i, 44 + 4 * i)) for i in range(len(prompts))]
    ids = [f"m{i}" for i in range(len(prompts))]
    pre = r.execute(StepPlan(0, [ScheduledSeq(q, p, 0, t, True, GREEDY, 0) for q, p, t in zip(ids, prompts, tables)]))
    assert pre.sampled_token_ids == [x[0] for x in ref]
    seqs = []
    for i, (p, k) in enumerate(zip(prompts, ks)):
        d = list(ref[i][1:1 + k])
        if i == 3:  # a wrong third draft: two accepted, then the recovered token
            d[2] = (d[2] + 1) % 10000 + 3
        seqs.append(ScheduledSeq(ids[i], [ref[i][0], *d], len(p), tables[i], True, GREEDY, 1, num_draft=k,
                                 num_propose=K))
    res = check_mixed_step(r, fake, vg, seqs, 1, list(range(r.num_blocks - 1)), 1e-5)  # the rig's scratch left out
    want = [ref[i][1:2 + k] if i != 3 else ref[i][1:4] for i, k in enumerate(ks)]  # plain decoding's tokens
    assert res.num_sampled == [len(w) for w in want]
    assert res.sampled_token_ids == [t for w in want for t in w]
    r.execute(StepPlan(3, [], forget=ids))


def test_speculation_with_mixed_k_through_the_graph_path_emits_plain_tokens(rig):
    r, fake, vg = rig
    prompts = _prompts((7, 30, 12))
    n = 18
    ref = generate(r, prompts, n)

    def drafts(i, outs, proposed):  # 0..4 drafts, differing per request and step; some wrong
        k = (i + len(outs)) % (K + 1)
        d = list(ref[i][len(outs):len(outs) + k])
        if len(outs) % 3 == 1 and len(d) > 1:
            d[1] = (d[1] + 1) % 10000 + 3
        return d

    fake.seen.clear()
    r.verify_graphs, n0 = vg, vg.replays
    try:
        run = spec_run(r, prompts, n, K, drafts=drafts)
    finally:
        r.verify_graphs = None
    assert run.tokens == ref
    mixed = [s for s in fake.seen if len({q.num_draft for q in s["seqs"]}) > 1 and all(q.sample for q in s["seqs"])]
    assert mixed and vg.replays - n0 >= len(mixed), (len(mixed), vg.replays - n0)
    assert any(0 in {q.num_draft for q in s["seqs"]} for s in mixed)  # decodes padded beside verify seqs
    assert run.num_accepted > 0


def test_with_mixed_k_off_mixed_steps_run_eagerly_and_uniform_ones_replay(rig, monkeypatch):
    """verify_graphs.MIXED_K off (the default): a step of mixed k takes no graph, one of
    uniform k does; the tokens are plain decoding's either way."""
    from services.worker import verify_graphs
    monkeypatch.setattr(verify_graphs, "MIXED_K", False)
    r, fake, vg = rig
    prompts = _prompts((7, 30, 12))
    n = 12
    ref = generate(r, prompts, n)
    r.verify_graphs, n0 = vg, vg.replays
    fake.seen.clear()
    try:
        mixed = spec_run(r, prompts, n, K, drafts=lambda i, outs, p: list(ref[i][len(outs):len(outs) + 1 + i % 2]))
        mid = vg.replays
        steps = [s for s in fake.seen if all(q.sample for q in s["seqs"]) and any(q.num_draft for q in s["seqs"])]
        n_mixed = sum(len({q.num_draft for q in s["seqs"]}) > 1 for s in steps)
        uniform = spec_run(r, prompts, n, K, drafts=lambda i, outs, p: list(ref[i][len(outs):len(outs) + 2]))
    finally:
        r.verify_graphs = None
    assert mixed.tokens == ref and uniform.tokens == ref
    assert n_mixed > 0 and mid - n0 <= len(steps) - n_mixed  # no mixed step replayed
    assert vg.replays > mid
