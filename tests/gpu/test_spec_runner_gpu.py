"""The model runner's multi-token step on CUDA (docs/ARCHITECTURE.md §5.5), dummy weights of
Qwen3-0.6B's shape (4 layers): verify steps run eagerly beside CUDA-graph decode steps and
emit the tokens of plain (graph) decoding; a pending token after a verify step is read by
the next graph replay; a proposer observes graph-replayed decode steps through the graph's
buffers (its own KV group written at their slots); n-gram speculation equals plain
decoding. Skipped without CUDA; the CPU twins are tests/unit/test_spec_runner.py and
test_ngram.py.

Token equality is checked in fp32: a verify step runs other kernels than a decode step
(paged prefill attention and full-width matmuls instead of the decode kernel and the
batch-1 gemv), and the dummy weights' near-flat logits put near-ties within bf16's
rounding, so bf16 argmaxes may flip (seen: one token in 16). In bf16 the verify step's
logits are compared with those of one-token decode steps, within bf16 tolerance."""

from __future__ import annotations

import gc
import json
import pathlib

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from services.worker import spec as spec_pkg  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.protocol import PENDING_TOKEN, SamplingParams, ScheduledSeq, StepPlan  # noqa: E402
from tests.runner_driver import generate, spec_run, step_logits  # noqa: E402
from tests.unit.spec_rig import FakeDrafter  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
N = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = json.loads((ROOT / "benchmarks/configs/qwen3-0.6b.json").read_text())
    cfg["num_hidden_layers"] = 4
    d = tmp_path_factory.mktemp("qwen3dummy")
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _runner(d, dtype="float32", util=0.5, **kw):
    """A runner on CUDA; util: its gpu_memory_utilization, which counts the memory that the
    module's other runners still hold (the shared `runner` takes 0.2)."""
    cli = {"model": str(d), "load_format": "dummy", "device": "cuda", "dtype": dtype,
           "max_num_seqs": 16, "max_model_len": 2048, "gpu_memory_utilization": util, **kw}
    return ModelRunner(build_config(cli=cli, env={}))


@pytest.fixture
def own_runner(model_dir):
    """A factory of runners for one test (keyword arguments as `_runner`), whose memory is
    given back after the test."""
    made: list[ModelRunner] = []

    def make(**kw):
        made.append(_runner(model_dir, **kw))
        return made[-1]

    yield make
    made.clear()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def runner(model_dir):
    r = _runner(model_dir, util=0.2)
    assert r.graphs is not None
    return r


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 10000, (n,), generator=g).tolist() for n in (5, 100, 17, 1)]


def test_verify_logits_equal_decode_logits_in_bf16(own_runner):
    r = own_runner(dtype="bfloat16")
    sp = SamplingParams(temperature=0.0)
    prompt = _prompts()[1]
    p = len(prompt)
    toks = [11, 22, 33, 44]
    table = list(range(300, 310))
    r.execute(StepPlan(0, [ScheduledSeq("a", prompt, 0, table, False, sp, 0)]))
    verify_logits = step_logits(r, StepPlan(1, [ScheduledSeq("a", toks, p, table, True, sp, 0, num_draft=3)]))
    dec = [step_logits(r, StepPlan(2 + j, [ScheduledSeq("a", [t], p + j, table, True, sp, j)]))[0]
           for j, t in enumerate(toks)]  # graph replays over the same KV
    torch.testing.assert_close(verify_logits, torch.stack(dec), atol=0.05, rtol=0.05)
    r.execute(StepPlan(9, [], forget=["a"]))


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.3, seed=4)],
                         ids=["greedy", "seeded"])
def test_verify_steps_beside_graph_decode_emit_plain_tokens(runner, sampling):
    prompts = _prompts()
    ref = generate(runner, prompts, N, sampling, chunk=64)
    for wrong_at in (None, 1, 0):
        def drafts(i, outs, proposed, wrong_at=wrong_at):
            d = list(ref[i][len(outs):len(outs) + 3])
            if wrong_at is not None and wrong_at < len(d):
                d[wrong_at] = (d[wrong_at] + 1) % 10000
            return d
        run = spec_run(runner, prompts, N, 3, sampling, chunk=64, drafts=drafts)
        assert run.tokens == ref, wrong_at
        if wrong_at is None:
            assert run.num_accepted == run.num_draft_tokens > 0
        if wrong_at == 0:
            assert run.num_accepted == 0


def test_a_pending_token_after_a_verify_step_replays_in_a_graph(runner):
    sp = SamplingParams(temperature=0.0)
    prompt = _prompts()[1]
    p = len(prompt)
    ref = generate(runner, [prompt], 6, sp)[0]
    tables = {"a": list(range(200, 210)), "b": list(range(210, 220))}
    seqs = [ScheduledSeq(r, prompt, 0, t, True, sp, 0) for r, t in tables.items()]
    assert runner.execute(StepPlan(0, seqs)).sampled_token_ids == [ref[0]] * 2
    d = [ref[1], (ref[2] + 1) % 10000]
    seqs = [ScheduledSeq(r, [ref[0], *d], p, t, True, sp, 1, num_draft=2) for r, t in tables.items()]
    res = runner.execute(StepPlan(1, seqs))
    assert res.num_sampled == [2, 2] and res.sampled_token_ids == ref[1:3] * 2
    seqs = [ScheduledSeq("a", [ref[2]], p + 2, tables["a"], True, sp, 3),
            ScheduledSeq("b", [PENDING_TOKEN], p + 2, tables["b"], True, sp, 3)]
    assert runner.execute(StepPlan(2, seqs)).sampled_token_ids == [ref[3]] * 2  # a graph step
    seqs = [ScheduledSeq(r, [PENDING_TOKEN], p + 3, t, True, sp, 4) for r, t in tables.items()]
    assert runner.execute(StepPlan(3, seqs)).sampled_token_ids == [ref[4]] * 2
    runner.execute(StepPlan(4, [], forget=["a", "b"]))


def test_a_proposer_observes_graph_decode_steps(own_runner, monkeypatch):
    monkeypatch.setitem(spec_pkg.PROPOSERS, "draft_model", ("tests.unit.spec_rig", "FakeDrafter"))
    r = own_runner(speculative_config={"method": "draft_model", "num_speculative_tokens": 3})
    fake = FakeDrafter.last
    assert fake is not None and r.graphs is not None and r.draft_kv is not None
    assert r.draft_kv.k[0].shape[0] == r.num_blocks and r.draft_kv.k[0].is_cuda
    prompts = _prompts()
    ref = generate(r, prompts, N, chunk=64)
    fake.seen.clear()
    run = spec_run(r, prompts, N, 3, chunk=64)  # no oracle: no drafts, every decode step replays a graph
    assert run.tokens == ref and run.num_drafts == 0
    graph_steps = [s for s in fake.seen if all(len(q.token_ids) == 1 for q in s["seqs"])]
    assert len(graph_steps) >= N - 2
    bs = r.block_size
    for seen in fake.seen:
        want = [t for q in seen["seqs"] for t in q.token_ids]
        assert seen["ids"] == want and seen["kv"] == [t % 256 for t in want]
        assert seen["slots"] == [q.block_table[p // bs] * bs + p % bs for q in seen["seqs"]
                                 for p in range(q.start_pos, q.start_pos + len(q.token_ids))]
    fake.oracle = {f"r{i}": ref[i] for i in range(len(prompts))}
    run = spec_run(r, prompts, N, 3, chunk=64)
    assert run.tokens == ref and run.num_accepted == run.num_draft_tokens > 0


def test_ngram_speculation_on_cuda_equals_plain_decoding(own_runner):
    r = own_runner(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                       "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    base = _prompts()[2]
    prompts = [base * 3, _prompts()[1]]
    ref = generate(r, prompts, 32, chunk=64)
    run = spec_run(r, prompts, 32, 4, chunk=64)
    assert run.tokens == ref and run.num_accepted > 0
