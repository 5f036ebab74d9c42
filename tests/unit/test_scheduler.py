"""Scheduler and block manager against a toy model whose next token is a pure function of
the whole context. The truth is the same requests run one at a time with ample memory:
chunking, batching and preemption must not change any output."""

import random

import pytest

from services.engine.block_manager import BlockManager, blocks_needed
from services.engine.request import Request
from services.engine.scheduler import Scheduler
from shared.plan_state import PlanState
from shared.protocol import PENDING_TOKEN, SamplingParams

VOCAB = 50
EOS = 0


class ToyModel:
    """Keeps a per-request 'KV cache' of the tokens it has seen, to check that the plan
    gives each request exactly the next tokens at the right positions and block coverage."""

    def __init__(self, block_size):
        self.kv: dict[str, list[int]] = {}
        self.block_size = block_size
        self.state = PlanState()  # whole tables from the engine's increments, as a worker
        self.last: dict[str, int] = {}  # the last sampling plan's draws (PENDING_TOKEN)
        self.pending_fed = 0

    def execute(self, plan):
        self.state.resolve(plan)
        out, drawn = [], {}
        self.prompt_lps = {}  # request id -> one entry per prompt position scored (1..p-1)
        for s in plan.seqs:
            p = s.num_prompt_tokens
            if s.sampling.prompt_logprobs is not None and s.start_pos < p:
                n = min(len(s.token_ids), p - s.start_pos) - (s.start_pos == 0)
                self.prompt_lps[s.request_id] = [("lp", s.start_pos)] * n
            cache = self.kv.setdefault(s.request_id, [])
            del cache[s.start_pos:]  # recompute after preemption rewrites from start_pos
            assert len(cache) == s.start_pos, "plan skips tokens"
            toks = list(s.token_ids)
            if PENDING_TOKEN in toks:
                assert toks.index(PENDING_TOKEN) == len(toks) - 1 == 0, "pending token not a decode's"
                toks[-1] = self.last[s.request_id]  # KeyError: not drawn by the last plan
                self.pending_fed += 1
            cache.extend(toks)
            assert len(s.block_table) * self.block_size >= len(cache), "blocks do not cover tokens"
            if s.sample:
                out.append(self.next_token(cache))
                drawn[s.request_id] = out[-1]
        if out:
            self.last = drawn
        return out

    @staticmethod
    def next_token(ctx):
        h = 0
        for t in ctx:
            h = (h * 31 + t + 7) % 1000003
        return 1 + h % (VOCAB - 1) if len(ctx) % 13 else EOS  # EOS now and then


def run(requests, num_blocks, budget=32, max_num_seqs=8, block_size=4, max_model_len=200,
        overlap=False, stats=None):
    """Run to the end. overlap: as the engine's async scheduling, plan step N+1 before
    applying step N's result (the toy model runs each plan when it is made, as the worker
    runs plans in order); decodes then feed PENDING_TOKEN."""
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_num_seqs, budget, max_model_len, [EOS])
    model = ToyModel(block_size)
    for r in requests:
        sched.add(r)
    steps = 0
    inflight = None
    while sched.has_work() or inflight:
        out = None
        if inflight is None or (overlap and sched.can_schedule_ahead()):
            out = sched.schedule()
            assert out is not None or inflight, "scheduler stalled with work left"
        if out is not None:
            assert all(s.token_ids for s in out.plan.seqs), "a seq with no tokens"
            total = sum(len(s.token_ids) for s in out.plan.seqs)
            assert total <= budget
            assert len(out.plan.seqs) <= max_num_seqs
            ids = [s.request_id for s in out.plan.seqs]
            assert len(ids) == len(set(ids))
            result = (model.execute(out.plan), None, model.prompt_lps)
        if inflight is not None:
            sched.update(inflight[0], *inflight[1])
        inflight = None
        if out is not None:
            if overlap:
                inflight = (out, result)
            else:
                sched.update(out, *result)
        used = sum(len(r.block_ids) for r in sched.requests.values())
        assert used + bm.num_free_blocks == num_blocks, "blocks leaked or double-counted"
        steps += 1
        assert steps < 10000
    assert bm.num_free_blocks == num_blocks
    if stats is not None:
        stats.update(steps=steps, pending_fed=model.pending_fed)
    return {r.request_id: (r.output_token_ids, r.finish_reason) for r in requests}


def make_requests(seed, n=8, ignore_eos=False):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 40))]
        sp = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 30), ignore_eos=ignore_eos)
        reqs.append(Request(f"r{i}", b"fe", prompt, sp, arrival_time=float(i)))
    return reqs


def reference(seed, ignore_eos=False):
    out = {}
    for r in make_requests(seed, ignore_eos=ignore_eos):
        out.update(run([r], num_blocks=1000, budget=1000))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_batched_chunked_outputs_equal_one_at_a_time(seed):
    assert run(make_requests(seed), num_blocks=1000, budget=16) == reference(seed)


@pytest.mark.parametrize("seed", range(5))
def test_async_scheduling_outputs_equal_one_at_a_time(seed):
    """Steps planned before the previous result (pending tokens), with chunking, EOS found
    one step late and max_tokens: the same outputs as one request at a time."""
    stats = {}
    assert run(make_requests(seed), num_blocks=1000, budget=16, overlap=True, stats=stats) == reference(seed)
    assert stats["pending_fed"] > 0, "test did not exercise pending tokens"


@pytest.mark.parametrize("seed", range(5))
def test_async_scheduling_with_preemption_keeps_outputs(seed):
    reqs = make_requests(seed, ignore_eos=True)
    assert run(reqs, num_blocks=20, budget=16, block_size=4, overlap=True) == reference(seed, ignore_eos=True)
    assert any(r.num_preemptions for r in reqs), "test did not exercise preemption"


@pytest.mark.parametrize("seed", range(8))
def test_async_preemption_keeps_prompt_logprobs_whole(seed):
    """Prompt logprobs under preemption with async scheduling: a request preempted while
    its first token is in flight keeps that token, which may end it (max_tokens 1 or 2):
    its prompt logprobs must still cover positions 1..p-1 (found by a fresh-user pass:
    they were dropped, and the API answered null logprobs)."""
    def reqs():
        rng = random.Random(seed)
        return [Request(f"r{i}", b"fe", [rng.randrange(1, VOCAB) for _ in range(rng.choice([8, 25, 40]))],
                        SamplingParams(temperature=0, max_tokens=rng.choice([1, 1, 1, 2]), ignore_eos=True,
                                       prompt_logprobs=1), arrival_time=float(i)) for i in range(10)]
    got = reqs()
    out = run(got, num_blocks=12, budget=16, block_size=4, overlap=True)
    assert any(r.num_preemptions for r in got), "test did not exercise preemption"
    for r in got:
        assert r.finish_reason == "length"
        assert [pos for _, pos in r.prompt_logprobs] == sorted(pos for _, pos in r.prompt_logprobs)
        assert len(r.prompt_logprobs) >= r.num_prompt_tokens - 1, (r.request_id, len(r.prompt_logprobs))
    assert out == run(reqs(), num_blocks=1000, budget=1000)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("prompt_logprobs", [1, None])
def test_max_tokens_0_finishes_after_the_prompt_with_or_without_prompt_logprobs(overlap, prompt_logprobs):
    """max_tokens 0 (score the prompt only): its last chunk samples nothing, the plan made
    before that result must not give it a 0-token seq, and it finishes once the prompt is
    computed, whether or not it asked for prompt logprobs (without them it once never
    finished: the HTTP request hung)."""
    r = Request("a", b"fe", list(range(1, 31)),
                SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=prompt_logprobs))
    other = Request("b", b"fe", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    out = run([r, other], num_blocks=100, budget=16, block_size=4, overlap=overlap)  # asserts plan validity
    assert r.finish_reason == "length" and r.output_token_ids == []
    assert len(r.prompt_logprobs) == (29 if prompt_logprobs else 0)
    assert out["b"][1] == "length" and len(out["b"][0]) == 3


@pytest.mark.parametrize("seed", range(5))
def test_preemption_under_memory_pressure_keeps_outputs(seed):
    reqs = make_requests(seed, ignore_eos=True)
    got = run(reqs, num_blocks=20, budget=16, block_size=4)
    assert got == reference(seed, ignore_eos=True)
    assert any(r.num_preemptions for r in reqs), "test did not exercise preemption"


def test_max_tokens_and_ignore_eos_and_stop_ids():
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    r = Request("a", b"fe", [1, 2, 3], sp)
    out = run([r], num_blocks=100)
    assert len(out["a"][0]) == 5 and out["a"][1] == "length"
    # stop on a stop token id: find the first generated token and stop on it
    first = ToyModel.next_token([1, 2, 3])
    sp2 = SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[first], ignore_eos=True)
    r2 = Request("b", b"fe", [1, 2, 3], sp2)
    out2 = run([r2], num_blocks=100)
    assert out2["b"] == ([first], "stop") and r2.stop_token_id == first


def test_max_model_len_finishes_with_length():
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    r = Request("a", b"fe", list(range(1, 11)), sp)
    out = run([r], num_blocks=100, max_model_len=16)
    assert len(out["a"][0]) == 6 and out["a"][1] == "length"


def test_blocks_needed():
    assert [blocks_needed(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
