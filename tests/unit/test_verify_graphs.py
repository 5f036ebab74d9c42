"""Which verify steps take a CUDA graph and what they stage (services/worker/verify_graphs.py,
services/worker/verify_layout.py), on the CPU: `replay_verify` against a recording stand-in
for `VerifyGraphs` (capture needs CUDA; tests/gpu/test_verify_graphs_gpu.py replays real
graphs). The staged tokens, positions, slots and seq_lens, and the real rows of a padded
(mixed k) step, are checked against `step_inputs.prepare_step`, the eager step's inputs."""

from __future__ import annotations

import pytest

import torch

from services.worker.step_inputs import prepare_step
from services.worker.verify_graphs import replay_verify, verify_sizes
from shared.protocol import PENDING_TOKEN, SamplingParams, ScheduledSeq

BS = 4  # block size
GREEDY = SamplingParams(temperature=0.0)

@pytest.fixture(autouse=True)
def _mixed_k_on(monkeypatch):
    """Mixed-k steps replay the graph path here (verify_graphs.MIXED_K is off by default)."""
    from services.worker import verify_graphs
    monkeypatch.setattr(verify_graphs, "MIXED_K", True)



class _Graphs:
    """Serves k in {1, 2} up to batch 4 (padded to a power of two); records `run`."""

    max_model_len = 64
    max_blocks = 16

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def padded_size(self, b: int, k: int) -> int | None:
        return next((s for s in (1, 2, 4) if s >= b), None) if k in (1, 2) else None

    def run(self, lay, tables):
        self.calls.append((lay.k, list(lay.ids), list(lay.positions), list(lay.slots), list(lay.seq_lens), tables))
        return torch.zeros(len(lay.rows), 2), None


def _seq(rid: str, start: int, k: int, table: list[int], **kw) -> ScheduledSeq:
    return ScheduledSeq(rid, [100 + start, *range(200, 200 + k)], start, table, True, GREEDY, 1,
                        num_draft=k, **kw)


def test_verify_sizes_are_the_decode_sizes_up_to_32():
    assert verify_sizes(256) == [1, 2, 4, 8, 16, 24, 32]
    assert verify_sizes(16) == [1, 2, 4, 8, 16]
    assert verify_sizes(40) == [1, 2, 4, 8, 16, 24, 32]
    assert verify_sizes(3) == [1, 2, 3]


def test_a_uniform_step_stages_the_eager_steps_tokens_positions_and_slots():
    g = _Graphs()
    seqs = [_seq("a", 5, 2, [7, 3, 9]), _seq("b", 0, 2, [1]), _seq("c", 10, 2, [4, 8, 2, 6])]
    hidden, aux, lay = replay_verify(g, seqs, BS)
    assert lay.k == 2 and lay.uniform and hidden.shape == (9, 2) and aux is None
    (kk, ids, pos, slots, lens, tables), = g.calls
    ids_e, pos_e, meta = prepare_step(seqs, BS, g.max_model_len, torch.device("cpu"), False)
    assert kk == 2 and ids == ids_e.tolist() and pos == pos_e.tolist()
    assert slots == meta.slot_mapping.tolist()
    assert lens == meta.seq_lens.tolist() == [8, 3, 13]
    assert tables == [s.block_table for s in seqs]


def test_steps_that_are_not_uniform_verify_steps_run_eagerly():
    t = [0, 1, 2, 3]
    cases = {
        "a plain decode": [ScheduledSeq("a", [5], 5, t, True, GREEDY, 1)],
        "k without a graph beside a decode": [_seq("a", 5, 3, t), ScheduledSeq("b", [5], 5, t, True, GREEDY, 1)],
        "a pending decode beside": [_seq("a", 5, 1, t), ScheduledSeq("b", [PENDING_TOKEN], 5, t, True, GREEDY, 1)],
        "a sampled prefill chunk beside": [_seq("a", 5, 1, t), ScheduledSeq("b", [1, 2], 0, t, True, GREEDY)],
        "a prefill chunk beside": [_seq("a", 5, 1, t), ScheduledSeq("b", [1, 2], 0, t, False, GREEDY)],
        "pending first token": [ScheduledSeq("a", [PENDING_TOKEN, 7], 5, t, True, GREEDY, 1, num_draft=1)],
        "k without a graph": [_seq("a", 5, 3, t)],
        "batch without a graph": [_seq(f"s{i}", 5, 1, t) for i in range(5)],
        "past the block table": [_seq("a", 14, 2, t)],
        "past max_model_len": [_seq("a", 63, 1, list(range(16)))],
        "prompt logprobs": [_seq("a", 1, 1, t, num_prompt_tokens=3)],
    }
    with_lp = SamplingParams(temperature=0.0, prompt_logprobs=1)
    cases["prompt logprobs"][0].sampling = with_lp
    for name, seqs in cases.items():
        g = _Graphs()
        assert replay_verify(g, seqs, BS) is None, name
        assert g.calls == [], name
    g = _Graphs()
    assert replay_verify(g, [_seq("a", 5, 1, t, num_prompt_tokens=3)], BS) is not None  # decode past the prompt
