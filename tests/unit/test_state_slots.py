"""State slots of a hybrid model's recurrent layers (services/engine/state_slots.py, the
scheduler's part, services/worker/state_cache.py; docs/ARCHITECTURE.md §4.7).

The truth is tests/unit/test_scheduler.py's: the same requests one at a time with ample
memory. Here the toy worker keeps its state per state slot, not per request, as a recurrent
layer does: a running hash of every token it was given. It starts a slot from zeros at
start_pos 0 and otherwise continues from whatever the slot holds, so two running requests on
one slot, a slot continued by the wrong request, or a slot handed out again without a reset
change outputs (and the slot's token count no longer matches start_pos)."""

from __future__ import annotations

import pytest
import torch

from services.engine.block_manager import BlockManager
from services.engine.scheduler import Scheduler
from services.engine.state_slots import StateSlots
from services.worker.state_cache import StateCache, StateSpec, StepState
from shared.protocol import PENDING_TOKEN, SamplingParams, ScheduledSeq
from tests.unit.test_scheduler import EOS, VOCAB, make_requests, reference


class RecurrentToy:
    """A worker whose only memory is a fixed state per slot: (tokens seen, running hash)."""

    def __init__(self, num_slots: int):
        self.slots: list[tuple[int, int]] = [(0, 0)] * num_slots
        self.last: dict[str, int] = {}
        self.restores = 0

    def execute(self, plan) -> list[int]:
        out, drawn = [], {}
        running = [s.state_slot for s in plan.seqs]
        assert len(running) == len(set(running)), f"two seqs of one step share a slot: {running}"
        for s in plan.seqs:
            assert s.state_slot >= 0, "a seq without a state slot"
            if s.state_restore >= 0:  # a prefix hit resumes from its checkpoint
                self.slots[s.state_slot] = self.slots[s.state_restore]
                self.restores += 1
            n, h = (0, 0) if s.start_pos == 0 else self.slots[s.state_slot]
            assert n == s.start_pos, f"{s.request_id}: slot {s.state_slot} holds {n} tokens, start_pos {s.start_pos}"
            for t in s.token_ids:
                t = self.last[s.request_id] if t == PENDING_TOKEN else t
                n, h = n + 1, (h * 31 + t + 7) % 1000003
            self.slots[s.state_slot] = (n, h)
            if s.state_save >= 0:
                assert s.state_save >= len(self.slots) // 2, "a checkpoint saved into a request slot"
                self.slots[s.state_save] = (n, h)
            if s.sample:
                out.append(1 + h % (VOCAB - 1) if n % 13 else EOS)
                drawn[s.request_id] = out[-1]
        if out:
            self.last = drawn
        return out


def run_with_slots(requests, num_blocks, budget=16, max_num_seqs=8, block_size=4, overlap=False,
                   prefix_caching=False, stats=None):
    """test_scheduler.run's loop over the recurrent toy, slots from a StateSlots (and as many
    checkpoint slots with the prefix cache on)."""
    slots = StateSlots(max_num_seqs, max_num_seqs if prefix_caching else 0)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    sched = Scheduler(bm, max_num_seqs, budget, 200, [EOS], state_slots=slots)
    model = RecurrentToy(2 * max_num_seqs)
    for r in requests:
        sched.add(r)
    inflight, steps = None, 0
    while sched.has_work() or inflight:
        out = None
        if inflight is None or (overlap and sched.can_schedule_ahead()):
            out = sched.schedule()
            assert out is not None or inflight, "scheduler stalled with work left"
        result = model.execute(out.plan) if out is not None else None
        if inflight is not None:
            sched.update(*inflight)
        inflight = None
        if out is not None:
            if overlap:
                inflight = (out, result)
            else:
                sched.update(out, result)
        held = [r.state_slot for r in sched.running]
        assert -1 not in held and len(held) == len(set(held)), held
        assert slots.num_free + len(held) == max_num_seqs, "a slot leaked"
        steps += 1
        assert steps < 10000
    assert slots.num_free == max_num_seqs
    if stats is not None:
        stats.update(bm.stats(), restores=model.restores, checkpoint_evictions=slots.num_checkpoint_evictions)
    return {r.request_id: (r.output_token_ids, r.finish_reason) for r in requests}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("overlap", [False, True])
def test_outputs_through_per_slot_state_equal_one_at_a_time(seed, overlap):
    assert run_with_slots(make_requests(seed, n=12), num_blocks=1000, max_num_seqs=4,
                          overlap=overlap) == reference_n(seed, 12)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("overlap", [False, True])
def test_preempted_requests_restart_from_zeros_in_their_next_slot(seed, overlap):
    reqs = make_requests(seed, ignore_eos=True)
    got = run_with_slots(reqs, num_blocks=20, overlap=overlap)
    assert any(r.num_preemptions for r in reqs), "test did not exercise preemption"
    assert got == reference(seed, ignore_eos=True)


def _shared_prefix_requests(seed: int):
    """Requests whose prompts repeat and extend each other (a chat's turns), with prompt
    lengths on a block boundary, one past it and mid-block, twice each."""
    import random

    from services.engine.request import Request

    rng = random.Random(seed)
    base = [rng.randrange(1, VOCAB) for _ in range(40)]
    prompts = [base[:n] for n in (8, 9, 14, 24, 25, 30)] * 2
    rng.shuffle(prompts)
    return [Request(f"p{i}", b"fe", p, SamplingParams(temperature=0, max_tokens=rng.randrange(2, 12), ignore_eos=True),
                    arrival_time=float(i)) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("overlap", [False, True])
def test_prefix_hits_resume_from_state_checkpoints_and_equal_cold_runs(seed, overlap):
    from tests.unit.test_scheduler import run

    cold = {}
    for r in _shared_prefix_requests(seed):
        cold.update(run([r], num_blocks=1000, budget=1000))
    stats: dict = {}
    # one at a time (a budget that never batches two prefills) so later requests hit earlier ones
    got = run_with_slots(_shared_prefix_requests(seed), num_blocks=200, budget=16, max_num_seqs=1,
                         overlap=overlap, prefix_caching=True, stats=stats)
    assert got == cold
    assert stats["prefix_cache_hits"] > 0 and stats["restores"] > 0, stats


def test_a_hit_without_a_checkpoint_is_no_hit_and_checkpoints_evict_lru():
    s = StateSlots(2, 2)
    assert s.new_checkpoint(b"a") == 2 and s.new_checkpoint(b"b") == 3
    assert s.new_checkpoint(b"a") is None  # already checkpointed (pending)
    assert s.checkpoint_of(b"a") is None, "a pending checkpoint is read before its plan came back"
    assert s.commit(2) == b"a" and s.commit(3) == b"b" and s.commit(3) is None
    assert s.checkpoint_of(b"a") == 2  # a is now the most recent
    assert s.new_checkpoint(b"c") == 3 and s.checkpoint_of(b"b") is None  # b evicted
    assert s.num_checkpoint_evictions == 1
    assert StateSlots(2).new_checkpoint(b"a") is None  # no checkpoint slots
    s.forget_checkpoints()
    assert s.checkpoint_of(b"a") is None and s.new_checkpoint(b"d") == 2  # c is still pending in 3


def test_pending_and_pinned_checkpoints_are_never_evicted_and_a_failed_plan_drops_its_own():
    s = StateSlots(1, 2)
    a, b = s.new_checkpoint(b"a"), s.new_checkpoint(b"b")
    assert not s.can_add_checkpoint(b"c") and s.new_checkpoint(b"c") is None  # both pending
    s.drop(b)  # b's step failed: its slot is free again, b has no checkpoint
    assert not s.has_checkpoint(b"b") and s.new_checkpoint(b"c") == b
    s.commit(a)
    s.commit(b)
    s.pin(a)  # a's copy into the kvstore is in flight: c (more recent) is the one evicted
    s.checkpoint_of(b"c")
    assert s.new_checkpoint(b"d") == b and s.holds(a, b"a") and not s.holds(b, b"c")
    s.commit(b)
    s.pin(b)
    assert s.new_checkpoint(b"e") is None, "a pinned checkpoint was evicted"
    s.forget_checkpoints()  # pinned ones go free at their last unpin, not before
    assert not s.holds(a, b"a") and s.new_checkpoint(b"e") is None
    s.unpin(a)
    assert s.new_checkpoint(b"e") == a
    with pytest.raises(RuntimeError):
        s.unpin(a)


def reference_n(seed: int, n: int):
    from tests.unit.test_scheduler import run

    out = {}
    for r in make_requests(seed, n=n):
        out.update(run([r], num_blocks=1000, budget=1000))
    return out


def test_state_slots_refuse_double_free_and_exhaustion():
    s = StateSlots(2)
    a, b = s.take(), s.take()
    assert {a, b} == {0, 1} and s.num_free == 0
    with pytest.raises(RuntimeError):
        s.take()
    s.give_back(a)
    with pytest.raises(ValueError):
        s.give_back(a)
    with pytest.raises(ValueError):
        s.give_back(5)
    with pytest.raises(ValueError):
        Scheduler(BlockManager(10, 4), 4, 16, 100, [EOS], state_slots=StateSlots(2))


def test_step_state_gathers_zeros_at_start_pos_0_and_scatters_back():
    spec = StateSpec(((3, 2), (2,)), (torch.float32, torch.float16))
    cache = StateCache([spec, spec], num_slots=4, device="cpu")
    # 4 slots and the scratch slot of CUDA-graph padding rows (never a request's)
    assert cache.bytes == 2 * 5 * (6 * 4 + 2 * 2) and cache.scratch_slot == 4
    assert cache.layers[0][0].shape == (5, 3, 2)
    for t in cache.layers[1]:
        t.fill_(5.0)
    g = SamplingParams(temperature=0)
    seqs = [ScheduledSeq("a", [1, 2], 0, [0], True, g, state_slot=2),
            ScheduledSeq("b", [3], 7, [1], True, g, state_slot=0)]
    step = StepState.for_seqs(cache, seqs, torch.device("cpu"))
    assert step.cu_seqlens.tolist() == [0, 2, 3] and step.seq_lens_host == [2, 1]
    conv, ssm = step.gather(1)
    assert conv.shape == (2, 3, 2) and ssm.dtype == torch.float16
    assert conv[0].eq(0).all() and conv[1].eq(5).all()  # a: new (zeros); b continues slot 0
    step.scatter(1, [conv + 1, ssm + 1])
    assert cache.layers[1][0][2].eq(1).all() and cache.layers[1][0][0].eq(6).all()
    assert cache.layers[1][0][1].eq(5).all() and cache.layers[0][0].eq(0).all()  # others untouched
    with pytest.raises(ValueError, match="state slot"):
        StepState.for_seqs(cache, [ScheduledSeq("c", [1], 0, [0], True, g)], torch.device("cpu"))
    with pytest.raises(ValueError, match="state slot"):  # the scratch slot is no request's
        StepState.for_seqs(cache, [ScheduledSeq("c", [1], 0, [0], True, g, state_slot=4)], torch.device("cpu"))
    with pytest.raises(ValueError, match="outside"):
        cache.copy_slot(0, cache.scratch_slot)


def _hybrid_folder(tmp_path, layer_types=("linear_attention", "full_attention")):
    import json

    cfg = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 64,
           "num_attention_heads": 4, "num_hidden_layers": len(layer_types), "vocab_size": 100,
           "layer_types": list(layer_types)}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_a_hybrid_model_keeps_cuda_graphs_and_refuses_what_its_state_cannot_run(tmp_path):
    from shared.config import build_config
    from shared.model_spec import load_model_spec

    model = _hybrid_folder(tmp_path)
    spec = load_model_spec(model)
    assert spec.has_recurrent_state and spec.attention_layer_ids == (1,)
    cfg = build_config(cli={"model": model, "device": "cpu"}, env={})
    assert cfg.enable_prefix_caching is True  # with state checkpoints
    assert cfg.enforce_eager is False and cfg.sources["enforce_eager"] == "default"
    # decode graphs read the state slots (docs/ARCHITECTURE.md §6.5): graphs stay on on CUDA
    cuda = build_config(cli={"model": model, "device": "cuda"}, env={})
    assert cuda.enforce_eager is False and cuda.sources["enforce_eager"] == "default"
    ngram = '{"method": "ngram", "num_speculative_tokens": 2}'  # works: the state rolls back (§4.7)
    assert build_config(cli={"model": model, "device": "cpu", "speculative_config": ngram}, env={}).speculative
    # the kvstore tiers work: they keep the state checkpoints too (§4.5)
    assert build_config(cli={"model": model, "device": "cpu", "kv_offload_cpu_gib": "1"}, env={}).kv_offload_cpu_gib
    with pytest.raises(ValueError, match="setting kv_offload_state_fraction: must be in"):
        build_config(cli={"model": model, "device": "cpu", "kv_offload_state_fraction": "1"}, env={})
    for extra, setting in (({"speculative_config": '{"method": "eagle", "num_speculative_tokens": 2, '
                                                   '"load_format": "dummy"}'}, "speculative_config"),
                           ({"speculative_config": '{"method": "draft_model", "num_speculative_tokens": 2, '
                                                   '"load_format": "dummy"}'}, "speculative_config")):
        with pytest.raises(ValueError, match=f"setting {setting}: not supported .* recurrent"):
            build_config(cli={"model": model, "device": "cpu", **extra}, env={})


def test_layer_types_from_full_attention_interval_and_bad_lists(tmp_path):
    import json

    from shared.model_spec import ModelFolderError, load_model_spec

    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 8, "vocab_size": 100,
           "full_attention_interval": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_model_spec(str(tmp_path))
    assert spec.attention_layer_ids == (3, 7) and spec.layer_types[0] == "linear_attention"
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"layer_types": ["full_attention"] * 7}))
    with pytest.raises(ModelFolderError, match="layer_types"):
        load_model_spec(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "full_attention_interval"}))
    spec = load_model_spec(str(tmp_path))
    assert not spec.has_recurrent_state and spec.attention_layer_ids == tuple(range(8))


def test_a_failed_step_drops_the_checkpoint_it_saved_and_a_good_one_makes_it_readable():
    from services.engine.request import Request

    for failed in (True, False):
        slots = StateSlots(1, 1)
        sched = Scheduler(BlockManager(64, 4), 1, 64, 200, [EOS], state_slots=slots)
        r = Request("a", b"fe", list(range(1, 11)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        sched.add(r)
        out = sched.schedule()
        seq = out.plan.seqs[0]
        assert len(seq.token_ids) == 8 and seq.state_save == 1  # cut at the last full block: saves there
        name = r.block_hashes[1]
        assert not slots.has_checkpoint(name), "readable before its step came back"
        if failed:
            sched.step_failed(out.plan)
            sched.finish(r, "error")
        else:
            sched.update(out, [])
        assert slots.has_checkpoint(name) is not failed
        assert slots.can_add_checkpoint(b"other"), "a dropped checkpoint's slot is not free again"
