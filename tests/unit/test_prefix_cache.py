"""Prefix cache (block manager + scheduler) against a toy model whose KV cache is keyed by
block id and slot, as the workers' real cache is.

The toy writes each scheduled token into the slot its block table names and reads the whole
context back through the block table. Each slot also holds the position and a digest of the
context it was computed under (real KV depends on every token before it), so a block reused
with the wrong contents, at the wrong position or under another prefix fails the run. The
truth is the same requests run one at a time with prefix caching off and ample memory.
"""

import os
import random
import subprocess
import sys
from collections import Counter

import pytest

from services.engine import block_manager as bm_mod
from services.engine.block_manager import BlockManager
from services.engine.request import Request
from services.engine.scheduler import Scheduler
from shared import hashing
from shared import protocol as P
from shared.plan_state import PlanState

VOCAB = 50
EOS = 0


def mix(digest, token):
    return (digest * 31 + token + 7) % 1000003


def next_token(ctx):
    """The toy model's output: a pure function of the whole context."""
    d = 0
    for t in ctx:
        d = mix(d, t)
    return 1 + d % (VOCAB - 1) if len(ctx) % 13 else EOS


class BlockKVModel:
    """Toy model with a paged 'KV cache': (block id, slot) -> (position, token, digest).
    bm: the block manager, where the test holds one: a write into a block it shares (ref
    count above 1) fails. Without it only the tables are checked."""

    def __init__(self, block_size: int, bm=None):
        self.block_size = block_size
        self.bm = bm
        self.kv = {}
        self.state = PlanState()  # whole tables from the engine's increments, as a worker

    def read(self, table, pos):
        bs = self.block_size
        slot = self.kv.get((table[pos // bs], pos % bs))
        assert slot is not None, f"position {pos} reads a slot never written"
        assert slot[0] == pos, f"position {pos} reads KV written for position {slot[0]}"
        return slot

    def execute(self, plan):
        self.state.resolve(plan)
        bs, out, writer = self.block_size, [], {}
        for s in plan.seqs:
            table, end = s.block_table, s.start_pos + len(s.token_ids)
            assert len(set(table)) == len(table), "a block twice in one table"
            assert len(table) * bs >= end, "blocks do not cover tokens"
            digest = self.read(table, s.start_pos - 1)[2] if s.start_pos else 0
            for i, tok in enumerate(s.token_ids):
                pos = s.start_pos + i
                blk = table[pos // bs]
                assert self.bm is None or self.bm.ref_cnt[blk] == 1, f"write into shared block {blk}"
                assert writer.setdefault(blk, s.request_id) == s.request_id
                digest = mix(digest, tok)
                self.kv[(blk, pos % bs)] = (pos, tok, digest)
            if s.sample:
                ctx, d = [], 0
                for pos in range(end):  # attention reads every slot of the context
                    _, tok, stored = self.read(table, pos)
                    d = mix(d, tok)
                    assert stored == d, f"KV of position {pos} was computed under another prefix"
                    ctx.append(tok)
                out.append(next_token(ctx))
        return out


def check_blocks(bm, sched):
    """Ref counts match the tables; free + evictable + in use == total, all disjoint."""
    holders = Counter(b for r in sched.requests.values() for b in r.block_ids)
    assert all(c >= 0 for c in bm.ref_cnt)
    assert [bm.ref_cnt[b] for b in range(bm.num_blocks)] == [holders[b] for b in range(bm.num_blocks)]
    free, evict = set(bm.free_blocks), set(bm.evictable)
    assert len(free) == len(bm.free_blocks)
    assert free.isdisjoint(evict) and free.isdisjoint(holders) and evict.isdisjoint(holders)
    assert len(free) + len(evict) + len(holders) == bm.num_blocks
    assert bm.num_free_blocks == len(free) + len(evict)
    assert all(bm.block_hash[b] == h for h, b in bm.cached.items())
    assert sum(h is not None for h in bm.block_hash) == len(bm.cached)
    assert all(bm.block_hash[b] is not None for b in evict)


class Harness:
    def __init__(self, num_blocks=1000, budget=16, max_num_seqs=8, block_size=4,
                 max_model_len=200, caching=True):
        self.budget, self.max_num_seqs = budget, max_num_seqs
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.sched = Scheduler(self.bm, max_num_seqs, budget, max_model_len, [EOS])
        self.model = BlockKVModel(block_size, self.bm)
        self.steps = 0

    def step(self):
        out = self.sched.schedule()
        assert out is not None, "scheduler stalled with work left"
        assert sum(len(s.token_ids) for s in out.plan.seqs) <= self.budget
        assert len(out.plan.seqs) <= self.max_num_seqs
        ids = [s.request_id for s in out.plan.seqs]
        assert len(ids) == len(set(ids))
        self.sched.update(out, self.model.execute(out.plan))
        check_blocks(self.bm, self.sched)
        self.steps += 1
        assert self.steps < 20000
        return out

    def run(self, requests, stagger=0):
        """Add request i at step i * stagger, run until all finish; outputs by id."""
        pending = list(requests)
        while pending or self.sched.has_work():
            while pending and self.steps >= (len(requests) - len(pending)) * stagger:
                self.sched.add(pending.pop(0))
            if self.sched.has_work():
                self.step()
            else:
                self.steps += 1
        assert self.bm.num_free_blocks == self.bm.num_blocks and not any(self.bm.ref_cnt)
        return {r.request_id: (r.output_token_ids, r.finish_reason) for r in requests}


def req(rid, prompt, max_tokens=8, ignore_eos=True, arrival=0.0):
    sp = P.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return Request(rid, b"fe", prompt, sp, arrival_time=arrival)


def shared_prefix_requests(seed, n=12, ignore_eos=False):
    rng = random.Random(seed)
    systems = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    reqs = []
    for i in range(n):
        if reqs and rng.random() < 0.2:  # an exact repeat of an earlier prompt
            prompt = list(rng.choice(reqs).prompt_token_ids)
        else:
            sys_p = rng.choice(systems)
            prompt = sys_p[:rng.randrange(len(sys_p) // 2, len(sys_p) + 1)]
            prompt += [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 12))]
        reqs.append(req(f"r{i}", prompt, rng.randrange(1, 20), ignore_eos, float(i)))
    return reqs


def reference(requests):
    out = {}
    for r in requests:
        fresh = req(r.request_id, r.prompt_token_ids, r.sampling.max_tokens, r.sampling.ignore_eos)
        out.update(Harness(budget=1000, caching=False).run([fresh]))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stagger", [0, 3])
def test_shared_prefix_outputs_equal_with_caching_on_and_off(seed, stagger):
    on, off = Harness(), Harness(caching=False)
    got_on = on.run(shared_prefix_requests(seed), stagger)
    assert got_on == off.run(shared_prefix_requests(seed), stagger)
    assert got_on == reference(shared_prefix_requests(seed))
    assert on.bm.hit_tokens > 0, "test did not exercise a cache hit"
    assert off.bm.hit_tokens == 0 and off.bm.num_cached_blocks == 0


@pytest.mark.parametrize("seed", range(6))
def test_memory_pressure_with_preemption_and_eviction_keeps_outputs(seed):
    reqs = shared_prefix_requests(seed, n=14, ignore_eos=True)
    h = Harness(num_blocks=24, budget=16)
    assert h.run(reqs, stagger=2) == reference(reqs)
    assert any(r.num_preemptions for r in reqs), "test did not exercise preemption"
    assert h.bm.num_evictions > 0, "test did not exercise eviction"
    assert h.bm.hit_tokens > 0


def test_second_identical_request_hits_all_but_the_last_partial_block():
    prompt = list(range(1, 11))  # 10 tokens, blocks of 4: two full blocks and a partial one
    h = Harness()
    first = h.run([req("a", prompt, 3)])
    b = req("b", prompt, 3)
    h.sched.add(b)
    out = h.step()
    (seq,) = out.plan.seqs
    assert (seq.start_pos, seq.token_ids) == (8, prompt[8:])
    assert b.num_cached_tokens == 8 and h.bm.hit_tokens == 8 and h.bm.query_tokens == 20
    assert (h.bm.hit_blocks, h.bm.query_blocks) == (2, 4)
    while h.sched.has_work():
        h.step()
    assert b.output_token_ids == first["a"][0]


@pytest.mark.parametrize("prompt_len,hit", [(12, 8), (13, 12), (4, 0), (5, 4), (1, 0)])
def test_prompt_on_a_block_boundary_recomputes_its_last_block(prompt_len, hit):
    prompt = [7 + i % 40 for i in range(prompt_len)]
    h = Harness()
    h.run([req("a", prompt, 5)])
    b = req("b", prompt, 5)
    h.sched.add(b)
    (seq,) = h.step().plan.seqs
    assert seq.start_pos == hit and seq.token_ids == prompt[hit:] and seq.sample
    assert b.num_cached_tokens == hit


def test_follow_up_turn_hits_blocks_filled_by_generated_tokens():
    prompt = list(range(1, 11))
    h = Harness()
    a = req("a", prompt, 7)
    h.run([a])
    # a computed 16 tokens (its last sampled token never runs), so blocks 0-3 are cached.
    turn2 = prompt + a.output_token_ids + [3, 4, 5]
    b = req("b", turn2, 4)
    got = h.run([b])
    assert b.num_cached_tokens == 16
    assert got == reference([b])


def test_running_request_shares_its_cached_blocks():
    prompt = [5 + i % 30 for i in range(16)]
    h = Harness(budget=64)
    a, b = req("a", prompt, 10), req("b", prompt, 10)
    h.sched.add(a)
    h.step()  # a's whole prompt is computed and its 4 full blocks are cached
    h.sched.add(b)
    h.step()
    assert b.block_ids[:3] == a.block_ids[:3] and b.block_ids[3] != a.block_ids[3]
    assert [h.bm.ref_cnt[x] for x in a.block_ids[:4]] == [2, 2, 2, 1]
    while h.sched.has_work():
        h.step()
    assert a.output_token_ids == b.output_token_ids == reference([a])["a"][0]


def test_request_restarting_from_token_0_caches_its_blocks_again():
    prompt = [5 + i % 30 for i in range(12)]
    h = Harness(budget=64)
    a = req("a", prompt, 6)
    h.sched.add(a)
    h.step()
    h.sched._preempt(a)
    assert h.bm.reset_prefix_cache() and h.bm.num_cached_blocks == 0
    h.step()  # a recomputes prompt + its first output from token 0 (nothing is cached)
    assert a.num_preemptions == 1 and a.num_computed_tokens == 13
    assert sorted(h.bm.cached.values()) == sorted(a.block_ids[:3])
    while h.sched.has_work():
        h.step()
    assert a.output_token_ids == reference([a])["a"][0]


def test_same_prompt_computed_twice_at_once_caches_one_copy():
    prompt = list(range(1, 14))
    h = Harness(budget=64)
    a, b = req("a", prompt, 1), req("b", prompt, 1)
    h.run([a, b])
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    assert h.bm.num_cached_blocks == 3 and len(h.bm.evictable) == 3
    assert len(h.bm.free_blocks) == h.bm.num_blocks - 3


def test_allocation_takes_plain_free_blocks_then_evicts_least_recently_freed():
    bm = BlockManager(6, 2)

    def compute(r, n):
        assert bm.allocate(r, n, computed_blocks=[])
        r.num_computed_tokens = n
        bm.cache_full_blocks(r)

    a, b = req("a", [1, 2, 3, 4]), req("b", [5, 6, 7, 8])
    compute(a, 4)
    compute(b, 4)
    a_blocks = list(a.block_ids)
    bm.free(a)
    bm.free(b)
    assert (len(bm.free_blocks), len(bm.evictable), bm.num_free_blocks) == (2, 4, 6)
    c = req("c", [9, 9, 9, 9])
    assert bm.allocate(c, 4) and bm.num_evictions == 0  # never-cached blocks first
    d = req("d", [9])
    assert bm.allocate(d, 1) and bm.num_evictions == 1
    assert d.block_ids == [a_blocks[1]]  # a was freed first, tail first: its last block goes
    assert bm.get_computed_blocks(req("a2", [1, 2, 3, 4, 0])) == ([a_blocks[0]], 2)
    assert bm.get_computed_blocks(req("b2", [5, 6, 7, 8, 0]))[1] == 4
    assert not bm.allocate(req("e", [1] * 9), 9)  # 3 left, 5 needed: nothing changes
    assert bm.num_free_blocks == 3 and bm.num_evictions == 1


def test_reset_prefix_cache_refuses_while_in_use_then_empties_the_cache():
    prompt = list(range(1, 20))
    h = Harness()
    h.run([req("a", prompt, 4)])
    cached = h.bm.num_cached_blocks
    assert cached > 0
    h.sched.add(req("b", prompt, 4))
    h.step()
    assert h.bm.reset_prefix_cache() is False and h.bm.num_cached_blocks == cached
    while h.sched.has_work():
        h.step()
    assert h.bm.reset_prefix_cache() is True
    assert h.bm.num_cached_blocks == 0 and not h.bm.evictable
    assert len(h.bm.free_blocks) == h.bm.num_blocks and h.bm.num_free_blocks == h.bm.num_blocks
    c = req("c", prompt, 4)
    h.run([c])
    assert c.num_cached_tokens == 0


def test_caching_off_names_and_shares_nothing():
    prompt = list(range(1, 20))
    h = Harness(caching=False)
    reqs = [req("a", prompt, 4), req("b", prompt, 4)]
    h.run(reqs, stagger=10)
    assert [r.num_cached_tokens for r in reqs] == [0, 0]
    assert h.bm.stats()["prefix_cache_queries"] == 0 and h.bm.num_cached_blocks == 0


# Block [3,3,3,3] at position 4 in A, then at position 0 in B: only the chain tells them apart.
A, B = [1, 2, 3, 4] + [3] * 4 + [5], [3] * 4 + [6, 7]


def test_same_block_tokens_after_another_prefix_do_not_hit():
    h = Harness()
    h.run([req("a", A, 2)])
    b = req("b", B, 2)
    assert h.run([b]) == reference([b]) and b.num_cached_tokens == 0


def test_toy_model_catches_a_hash_without_the_parent_chain(monkeypatch):
    monkeypatch.setattr(bm_mod, "hash_block_tokens", lambda parent, toks: hashing.hash_block_tokens(b"", toks))
    h = Harness()
    h.run([req("a", A, 2)])
    h.sched.add(req("b", B, 2))
    with pytest.raises(AssertionError, match="written for position"):
        h.step()


HASH_SCRIPT = """
from shared import hashing
root = hashing.model_identity_hash("m", "bfloat16", "bfloat16", 16, 1)
print(root.hex(), *[h.hex() for h in hashing.hash_block_chain(root, list(range(40)), 16, ("img", 7))])
"""


def test_block_hashes_are_stable_across_processes(repo_root):
    root = hashing.model_identity_hash("m", "bfloat16", "bfloat16", 16, 1)
    here = [root.hex()] + [h.hex() for h in hashing.hash_block_chain(root, list(range(40)), 16, ("img", 7))]
    assert len(here) == 3 and all(len(bytes.fromhex(x)) == 32 for x in here)
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", HASH_SCRIPT], cwd=repo_root, env=env,
                             capture_output=True, text=True, check=True).stdout.split()
        assert out == here


def test_block_names_depend_on_parent_tokens_extras_and_model_identity():
    base = dict(model="m", dtype="bfloat16", kv_dtype="bfloat16", block_size=16, tensor_parallel_size=1)
    roots = {hashing.model_identity_hash(**base)}
    for k, v in [("model", "n"), ("dtype", "float16"), ("kv_dtype", "fp8_e4m3"),
                 ("block_size", 32), ("tensor_parallel_size", 2)]:
        roots.add(hashing.model_identity_hash(**{**base, k: v}))
    assert len(roots) == 6
    r = hashing.model_identity_hash(**base)
    names = {hashing.hash_block_tokens(r, [1, 2]), hashing.hash_block_tokens(b"x" * 32, [1, 2]),
             hashing.hash_block_tokens(r, [2, 1]), hashing.hash_block_tokens(r, [1, 2], ("a",)),
             hashing.hash_block_tokens(r, [1, 2], (b"a",))}
    assert len(names) == 5


def test_engine_utilities_report_and_reset_the_prefix_cache():
    from services.engine.core import EngineCore
    from services.engine.executor import InProcessExecutor
    from services.engine.frontend_link import FrontendLink
    from tests.unit.engine_rig import Outbox, core_config, drive, toy_info

    cfg = core_config(block_size=4, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=200)
    core = EngineCore(cfg, toy_info(VOCAB, EOS, cfg.max_model_len), num_blocks=1000)
    model = BlockKVModel(cfg.block_size)  # the core's block manager is its own

    class Runner:  # the toy model behind the runner's execute(plan) -> StepResult
        def execute(self, plan):
            return P.StepResult(plan.step_id, model.execute(plan))

    outbox, executor = Outbox(), InProcessExecutor(Runner())
    for rid in ("a", "b"):  # one after the other: b finds a's blocks cached
        sp = P.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        assert core.add(b"fe", P.AddRequest(rid, list(range(1, 20)), sp, 0.0)) is None
        drive(core, executor, False, outbox)
    link = FrontendLink(core, lambda ident, msg: None, cfg, "engine-0")
    stats = link.utility(P.UtilityCall(1, "stats")).result
    assert stats["enable_prefix_caching"] is True
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (38, 16)
    assert link.utility(P.UtilityCall(2, "reset_prefix_cache")).result == {"ok": True}
    assert link.utility(P.UtilityCall(3, "stats")).result["num_cached_blocks"] == 0
    assert [outbox.outputs[r][0].num_cached_tokens for r in ("a", "b")] == [0, 16]


@pytest.mark.parametrize("argv,want", [([], True), (["--enable-prefix-caching", "false"], False),
                                       (["--no-enable-prefix-caching"], False),
                                       (["--enable-prefix-caching"], True)])
def test_enable_prefix_caching_cli(argv, want):
    import argparse

    from shared.config import add_cli_arguments, build_config

    p = argparse.ArgumentParser()
    add_cli_arguments(p)
    assert build_config(vars(p.parse_args(argv)), env={}).enable_prefix_caching is want
