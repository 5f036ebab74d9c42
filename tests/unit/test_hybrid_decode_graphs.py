"""A hybrid model's decode graphs on the CPU (services/worker/cuda_graphs.py with a state
cache; docs/ARCHITECTURE.md §4.7, §6.5): the graph body a CUDA graph captures, run eagerly
over the real static buffers (tests/unit/decode_graphs_rig.py), on a tiny random Qwen3-Next
(tests/hybrid_checkpoint.py), against the runner's normal eager step. Shown:
- a padded decode step (5 seqs in the graph of 8) gives the eager step's logits and states:
  seqs continuing from their slots, a one-token prompt on a reused slot holding NaN (starts
  from zeros: has_initial through the static buffer), a prefix hit restored from its
  checkpoint slot; its padding rows run on the scratch slot (NaN before, finite after) and
  every other slot stays bit-identical;
- greedy decoding through the graph body equals eager decoding, with chunked prefills and
  with pending (async) inputs;
- a seq without a state slot is refused (ValueError), as in the eager step.
tests/gpu/test_hybrid_graphs_gpu.py replays real CUDA graphs on the H200.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from services.worker.model_runner import ModelRunner  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan  # noqa: E402
from tests.hybrid_checkpoint import write_tiny_qwen3_next  # noqa: E402
from tests.runner_driver import generate, step_logits  # noqa: E402
from tests.unit.decode_graphs_rig import EagerReplayDecodeGraphs  # noqa: E402

VOCAB = 101
GREEDY = SamplingParams(temperature=0.0)
MAX_SEQS = 8
TOL = 1e-4  # fp32; padding changes the reference MoE's per-expert matmul shapes only


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    path = write_tiny_qwen3_next(tmp_path_factory.mktemp("hybrid_graphs"), vocab=VOCAB)
    cli = {"model": str(path), "device": "cpu", "dtype": "float32", "kv_cache_gib": 0.02, "block_size": 8,
           "max_num_seqs": MAX_SEQS, "max_model_len": 256}
    r = ModelRunner(build_config(cli=cli, env={}))
    assert r.graphs is None and r.state_cache is not None  # no graphs on the CPU: the rig stands in
    assert r.state_cache.num_slots == 2 * MAX_SEQS  # request slots + prefix-cache checkpoints
    scratch_kv = (r.num_blocks - 1) * r.block_size  # the last block: no test seq's
    g = EagerReplayDecodeGraphs(r._graph_forward, MAX_SEQS, r.max_model_len, r.block_size, r.state_cache,
                                scratch_kv)
    return r, g


def _prompts(lengths) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _states(r) -> list[torch.Tensor]:
    return [t.clone() for layer in r.state_cache.layers for t in layer]


def _put_states(r, saved: list[torch.Tensor]) -> None:
    for t, s in zip((t for layer in r.state_cache.layers for t in layer), saved):
        t.copy_(s)


def _fill_slot(r, slot: int, value: float | None) -> None:
    """Every layer's state of `slot`: `value`, or random normals when None."""
    for layer in r.state_cache.layers:
        for t in layer:
            t[slot] = torch.randn(t.shape[1:]).to(t.dtype) if value is None else value


def test_a_padded_graph_step_equals_the_eager_step_and_padding_touches_only_the_scratch_slot(rig):
    r, g = rig
    cache = r.state_cache
    r.graphs = None
    prompts = _prompts((9, 17, 12, 5))  # A, B, D, E: prefilled; C: a one-token prompt
    slots = {"A": 2, "B": 5, "D": 3, "E": 0, "C": 7}
    tables = {k: list(range(10 * i, 10 * i + 10)) for i, k in enumerate("ABDEC")}
    names = "ABDE"
    out = r.execute(StepPlan(0, [ScheduledSeq(k, p, 0, tables[k], True, GREEDY, 0, state_slot=slots[k])
                                 for k, p in zip(names, prompts)])).sampled_token_ids
    checkpoint = 9  # D resumes from a checkpoint of its own state (a prefix hit's restore)
    cache.copy_slot(slots["D"], checkpoint)
    _fill_slot(r, slots["D"], float("nan"))  # restored before the step, or the step turns NaN
    _fill_slot(r, slots["C"], float("nan"))  # a reused slot: a start_pos 0 seq reads zeros
    used = set(slots.values()) | {checkpoint}
    others = [s for s in range(cache.num_slots) if s not in used]
    for s in others:
        _fill_slot(r, s, None)
    _fill_slot(r, cache.scratch_slot, float("nan"))
    seqs = [ScheduledSeq(k, [t], len(p), tables[k], True, GREEDY, 1, state_slot=slots[k],
                         state_restore=checkpoint if k == "D" else -1) for k, p, t in zip(names, prompts, out)]
    seqs.insert(2, ScheduledSeq("C", [42], 0, tables["C"], True, GREEDY, 0, state_slot=slots["C"]))
    before = _states(r)

    eager = step_logits(r, StepPlan(1, seqs))
    eager_states = _states(r)
    _put_states(r, before)
    r.graphs, n0 = g, len(g.replays)
    try:
        graph = step_logits(r, StepPlan(2, seqs))
    finally:
        r.graphs = None
    graph_states = _states(r)

    assert g.replays[n0:] == [8]  # 5 seqs, 3 padding rows
    assert torch.isfinite(eager).all() and eager.shape == (5, VOCAB)
    torch.testing.assert_close(graph, eager, atol=TOL, rtol=TOL)
    for t_g, t_e, t_0 in zip(graph_states, eager_states, before):
        for s in used - {checkpoint}:  # the step's slots: the eager step's states
            torch.testing.assert_close(t_g[s], t_e[s], atol=TOL, rtol=TOL)
            assert torch.isfinite(t_g[s]).all()
        for s in [*others, checkpoint]:  # every other slot untouched, bit for bit
            assert torch.equal(t_g[s], t_0[s]), f"slot {s} changed"
        assert torch.isfinite(t_g[cache.scratch_slot]).all()  # padding rows ran there, from zeros
        assert t_e[cache.scratch_slot].isnan().all()  # the eager step has no padding rows
    # the one-token prompt's logits are those of the same prompt on a clean slot
    _fill_slot(r, 11, 0.0)
    alone = step_logits(r, StepPlan(3, [ScheduledSeq("C2", [42], 0, tables["C"], True, GREEDY, 0, state_slot=11)]))
    torch.testing.assert_close(graph[2:3], alone, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("pending", [False, True])
def test_greedy_decoding_through_the_graph_body_equals_eager_decoding(rig, pending):
    r, g = rig
    prompts = _prompts((5, 23, 11, 1, 16))  # 5 seqs: the graph of 8; one a one-token prompt
    r.graphs = None
    eager = generate(r, prompts, 10, chunk=7)
    r.graphs, n0 = g, len(g.replays)
    try:
        got = generate(r, prompts, 10, chunk=7, pending=pending)
    finally:
        r.graphs = None
    assert got == eager
    # every all-decode step replayed: 5 seqs in the graph of 8, then 3 in the graph of 4 as
    # requests finish
    assert len(g.replays) - n0 >= 9 and {8, 4} <= set(g.replays[n0:])


def test_a_graph_step_refuses_a_seq_without_a_state_slot(rig):
    r, g = rig
    r.graphs = g
    try:
        with pytest.raises(ValueError, match="state slot"):
            step_logits(r, StepPlan(0, [ScheduledSeq("x", [3], 4, [0], True, GREEDY, 1)]))
        with pytest.raises(ValueError, match="state_slots"):
            g.run([3], [4], [4], [5], [[0]])
    finally:
        r.graphs = None
