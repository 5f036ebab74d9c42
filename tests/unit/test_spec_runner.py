"""The model runner's multi-token step (docs/ARCHITECTURE.md §5.5), on the CPU with dummy
tiny-Qwen3 weights: verify steps with right, partly wrong and all-wrong drafts emit exactly
the tokens of plain decoding (greedy and seeded sampling; logprobs equal within fp
tolerance); a rejected draft leaves no trace in the next step's logits (the truth: a cold
run on fresh blocks); pending tokens after a verify step are the last emitted token; the
proposer plumbing (registry, second KV cache group sized and bound, observe / propose
calls, draft distributions handed to probabilistic verification). The truth for tokens is
plain decoding through the same runner (`tests.runner_driver.generate`, one token a step)."""

from __future__ import annotations

import shutil

import pytest
import torch

from benchmarks.common import model_dir
from services.worker import spec as spec_pkg
from services.worker.model_runner import ModelRunner
from services.worker.spec import verify
from shared.config import build_config
from shared.protocol import PENDING_TOKEN, SamplingParams, ScheduledSeq, StepPlan
from tests.runner_driver import generate, spec_run, step_logits
from tests.unit.spec_rig import FakeDrafter

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.25, seed=11, logprobs=3)  # low: dummy logits are near-flat
N = 14


def _cfg(folder: str, **extra):
    cli = {"model": folder, "load_format": "dummy", "device": "cpu", "dtype": "float32",
           "kv_cache_gib": 0.05, "max_model_len": 512, **extra}
    return build_config(cli=cli, env={})


@pytest.fixture(scope="module")
def folder():
    d = model_dir("tiny-qwen3")
    yield d
    shutil.rmtree(d, ignore_errors=True)  # the temporary model folder (config.json only)


@pytest.fixture(scope="module")
def runner(folder):
    return ModelRunner(_cfg(folder))


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 10000, (n,), generator=g).tolist() for n in (5, 40, 17)]


def _oracle(ref: list[list[int]], wrong_at: int | None):
    """drafts(i, outputs, proposed): the next tokens of the plain run `ref`, the one at index
    wrong_at of each proposal (when there is one) replaced by another token."""
    def drafts(i: int, outs: list[int], proposed: list[int]) -> list[int]:
        d = list(ref[i][len(outs):len(outs) + 3])
        if wrong_at is not None and wrong_at < len(d):
            d[wrong_at] = (d[wrong_at] + 1) % 10000 + 3
        return d
    return drafts


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("wrong_at", [None, 1, 0], ids=["right", "partly-wrong", "all-wrong"])
def test_verify_steps_emit_the_tokens_of_plain_decoding(runner, sampling, wrong_at):
    prompts = _prompts()
    ref = generate(runner, prompts, N, sampling)
    plain = spec_run(runner, prompts, N, 0, sampling)  # plain decoding, with logprobs
    assert plain.tokens == ref and plain.num_drafts == 0
    run = spec_run(runner, prompts, N, 3, sampling, drafts=_oracle(ref, wrong_at))
    assert run.tokens == ref
    assert run.num_draft_tokens > 0 and any(r.num_sampled for r in run.results)
    if wrong_at is None:  # every draft is the token plain decoding drew: all accepted
        assert run.num_accepted == run.num_draft_tokens
        assert run.steps < plain.steps
    elif wrong_at == 0:  # the first draft of every proposal is wrong: none accepted
        assert run.num_accepted == 0
    else:  # one accepted per proposal with a second draft
        assert 0 < run.num_accepted < run.num_draft_tokens
    if sampling.logprobs is not None:
        for a, b in zip(plain.logprobs, run.logprobs):
            assert len(a) == len(b) == N
            for x, y in zip(a, b):
                assert x.token_id == y.token_id and x.top_ids == y.top_ids
                # dummy weights give near-uniform logits: the rank of a sampled token may move
                # over near-ties within fp tolerance
                assert abs(x.rank - y.rank) <= 10
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert x.top_logprobs == pytest.approx(y.top_logprobs, abs=1e-4)


def test_chunked_prefills_and_verify_seqs_in_one_step(runner):
    """Prefill chunks of a long prompt run in the same plans as other requests' verify seqs."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 10000, (n,), generator=g).tolist() for n in (3, 90, 8)]
    ref = generate(runner, prompts, N, SEEDED)
    run = spec_run(runner, prompts, N, 3, SEEDED, chunk=16, drafts=_oracle(ref, 2))
    assert run.tokens == ref
    mixed = [r for r in run.results if r.num_sampled and len(r.num_sampled) < 3]
    assert mixed, "some plan should have had a prefill chunk beside verify seqs"


def _cold_logits(runner, tokens: list[int], k: int, table: list[int]) -> torch.Tensor:
    """Logits of the last k + 1 positions of `tokens`, run in one seq on `table`'s blocks."""
    seq = ScheduledSeq("cold", tokens, 0, table, True, GREEDY, 0, num_draft=k)
    return step_logits(runner, StepPlan(900, [seq], forget=["cold"]))


def test_after_a_rejected_draft_the_next_logits_equal_a_cold_runs(runner):
    prompt = _prompts(5)[1]
    p = len(prompt)
    table = [40, 41, 42, 43]  # 64 tokens
    out = runner.execute(StepPlan(0, [ScheduledSeq("a", prompt, 0, table, True, GREEDY, 0)]))
    t1 = out.sampled_token_ids[0]
    wrong = [(t1 + 7) % 10000 + 3, 5, 6, 7]
    res = runner.execute(StepPlan(1, [ScheduledSeq("a", [t1, *wrong], p, table, True, GREEDY, 1, num_draft=4)]))
    assert res.num_sampled == [1]  # every draft rejected: their KV (positions p+1..p+4) is stale
    t2 = res.sampled_token_ids[0]
    nxt = [t2, 9, 10]
    got = step_logits(runner, StepPlan(2, [ScheduledSeq("a", nxt, p + 1, table, True, GREEDY, 2, num_draft=2)]))
    cold = _cold_logits(runner, [*prompt, t1, *nxt], 2, [50, 51, 52, 53])
    assert got.shape == cold.shape == (3, runner.spec.vocab_size)
    torch.testing.assert_close(got, cold, atol=1e-4, rtol=1e-4)
    runner.execute(StepPlan(3, [], forget=["a"]))


def test_a_pending_token_after_a_verify_step_is_the_last_emitted_token(runner):
    """Two requests with the same prompt and drafts: one feeds the emitted token, the other
    PENDING_TOKEN (the runner's own copy); both give the same next token. Seeded sampling:
    greedy dummy weights repeat one token, which would hide a wrong pick."""
    sp = SamplingParams(temperature=0.25, seed=5)
    prompt = _prompts(7)[2]
    p = len(prompt)
    ta, tb = [60, 61], [62, 63]
    ref = generate(runner, [prompt], 4, sp)[0]
    assert len(set(ref)) == 4
    seqs = [ScheduledSeq(r, prompt, 0, t, True, sp, 0) for r, t in (("a", ta), ("b", tb))]
    assert runner.execute(StepPlan(0, seqs)).sampled_token_ids == [ref[0]] * 2
    d = [ref[1], ref[2] + 1]  # one right, one wrong: two tokens emitted, the last a recovered one
    seqs = [ScheduledSeq(r, [ref[0], *d], p, t, True, sp, 1, num_draft=2) for r, t in (("a", ta), ("b", tb))]
    res = runner.execute(StepPlan(1, seqs))
    assert res.num_sampled == [2, 2] and res.sampled_token_ids == [ref[1], ref[2]] * 2
    ids, rows = runner._last_sampled  # what a pending input is read from: the last emitted token
    assert [int(ids[rows[r]]) for r in ("a", "b")] == [ref[2], ref[2]]
    seqs = [ScheduledSeq("a", [ref[2]], p + 2, ta, True, sp, 3),
            ScheduledSeq("b", [PENDING_TOKEN], p + 2, tb, True, sp, 3)]
    res = runner.execute(StepPlan(2, seqs))
    assert res.sampled_token_ids == [ref[3], ref[3]] and not res.num_sampled
    runner.execute(StepPlan(3, [], forget=["a", "b"]))


def test_a_seq_whose_drafts_do_not_fit_is_an_error(runner):
    with pytest.raises(ValueError, match="num_draft"):
        runner.execute(StepPlan(0, [ScheduledSeq("x", [5, 6], 0, [70], True, GREEDY, 0, num_draft=2)]))
    with pytest.raises(ValueError, match="num_draft"):
        runner.execute(StepPlan(1, [ScheduledSeq("y", [5, 6], 0, [71], False, GREEDY, 0, num_draft=1)],
                                forget=["x"]))
    runner.execute(StepPlan(2, [], forget=["y"]))


# ---------------------------------------------------------------- proposer plumbing


@pytest.fixture(scope="module")
def drafter_runner(folder):
    mp = pytest.MonkeyPatch()
    mp.setitem(spec_pkg.PROPOSERS, "draft_model", ("tests.unit.spec_rig", "FakeDrafter"))
    try:
        r = ModelRunner(_cfg(folder, speculative_config={"method": "draft_model", "num_speculative_tokens": 3}))
    finally:
        mp.undo()
    assert FakeDrafter.last is not None
    return r, FakeDrafter.last


def test_the_proposers_kv_group_is_allocated_sized_and_bound(drafter_runner, runner):
    r, fake = drafter_runner
    draft_block = 2 * 2 * r.block_size * 1 * 8 * 4  # 2 layers, K and V, 1 head x 8, fp32
    assert r.draft_block_bytes == draft_block
    # the same 0.05 GiB holds both groups' blocks: fewer blocks than the runner without a drafter
    assert r.num_blocks == int(0.05 * 2**30) // (r.kv_layout.block_bytes + draft_block) < runner.num_blocks
    assert r.draft_kv is not None and len(fake.layers) == 2
    assert [h.k for h in fake.layers] == r.draft_kv.k
    assert tuple(fake.layers[0].k.shape) == (r.num_blocks, r.block_size, 1, 8)
    assert getattr(r.model, "aux_hidden_layers", None) == (1,)
    rep = r.report()["speculative"]
    assert rep["method"] == "fake" and rep["num_speculative_tokens"] == 3 and rep["fake"] is True
    assert rep["kv_bytes"] == r.num_blocks * draft_block and rep["kv_bytes_per_block"] == draft_block


def test_observe_and_propose_see_the_step_and_the_emitted_tokens(drafter_runner, runner):
    r, fake = drafter_runner
    prompts = _prompts(9)
    ref = generate(runner, prompts, N)
    fake.oracle = {f"r{i}": ref[i] for i in range(len(prompts))}
    fake.seen.clear()
    fake.requests.clear()
    run = spec_run(r, prompts, N, 3)
    assert run.tokens == ref and run.num_accepted == run.num_draft_tokens > 0
    assert len(fake.seen) == run.steps  # every step with seqs (not the last, forget-only plan)
    for seen in fake.seen:
        t = sum(len(s.token_ids) for s in seen["seqs"])
        assert len(seen["ids"]) == t and seen["hidden"] == (t, r.spec.hidden_size)
        want = [tok for s in seen["seqs"] for tok in s.token_ids]
        assert seen["ids"] == want
        assert seen["positions"] == [s.start_pos + j for s in seen["seqs"] for j in range(len(s.token_ids))]
        # the drafter's KV group is indexed by the target's slot mapping: it holds the ids there
        assert seen["kv"] == [x % 256 for x in want]
        bs = r.block_size
        assert seen["slots"] == [s.block_table[p // bs] * bs + p % bs for s in seen["seqs"]
                                 for p in range(s.start_pos, s.start_pos + len(s.token_ids))]
    for reqs, seen, res in zip(fake.requests, fake.seen, run.results):
        counts = res.num_sampled or [1] * len(reqs)
        flat, off = [], 0
        for c in counts:
            flat.append(res.sampled_token_ids[off:off + c])
            off += c
        for req in reqs:
            i = int(req.request_id[1:])
            s = seen["seqs"][req.seq_index]
            assert s.request_id == req.request_id and req.emitted in flat
            assert ref[i][req.output_index - len(req.emitted):req.output_index] == req.emitted
            assert req.next_pos == len(prompts[i]) + req.output_index - 1
            assert seen["positions"][req.row] == req.next_pos - 1  # its hidden state predicted emitted[-1]
            assert req.block_table == s.block_table
    assert set(fake.forgotten) >= {"r0", "r1", "r2"}


def test_draft_distributions_go_to_probabilistic_verification(drafter_runner, runner, monkeypatch):
    r, fake = drafter_runner
    prompts = _prompts(4)[:2]
    ref = generate(runner, prompts, N)
    fake.oracle = {"r0": ref[0], "r1": [(t + 1) % 10000 + 3 for t in ref[1]]}  # r1's drafts are wrong
    fake.with_probs = True
    calls = []

    def fake_verify(target_logits, seqs, starts, draft_probs, *, default_seed, raw_logits):
        assert default_seed == r.sampler.default_seed and raw_logits.shape == target_logits.shape
        calls.append((len(seqs), [q.shape for q in draft_probs]))
        for s, q in zip(seqs, draft_probs):  # q of exactly the drafts being verified
            assert q.argmax(-1).tolist() == s.token_ids[-s.num_draft:]
        drawn = target_logits.argmax(-1).tolist()  # greedy requests: the point-mass rule
        return verify.accept_point_mass(seqs, starts, drawn)

    monkeypatch.setattr(verify, "verify_probabilistic", fake_verify)
    try:
        run = spec_run(r, prompts, N, 3)
    finally:
        fake.with_probs = False
    assert run.tokens == ref
    assert calls and calls[0][0] == 2  # the first verify step: both requests, each with its q
    assert all(shape[1] == r.spec.vocab_size for _, shapes in calls for shape in shapes)
    # drafts that are not the kept proposal's (hand-made) fall back to point-mass verification
    calls.clear()
    fake.with_probs = True
    try:
        run = spec_run(r, prompts, N, 3, drafts=_oracle(ref, 1))
    finally:
        fake.with_probs = False
    assert run.tokens == ref and not calls


def test_build_proposer_refuses_a_method_that_is_not_built(folder, monkeypatch):
    monkeypatch.setitem(spec_pkg.PROPOSERS, "eagle", ("services.worker.spec.no_such_module", "X"))
    cfg = _cfg(folder, speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not built"):
        spec_pkg.build_proposer(cfg, None)
    assert spec_pkg.build_proposer(_cfg(folder), None) is None
