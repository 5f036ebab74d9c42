"""The padded layout of a mixed-k verify step (services/worker/verify_layout.py) on the CPU:
its real rows carry the eager step's tokens, positions and slots (the truth:
`step_inputs.prepare_step`), its padding rows write no KV, and attention over the padded
layout gives the eager step's output at every real row (the truth: `paged_attention_ref`
over the eager layout), however large the K/V the padding exposes; the same for the Triton
kernels under the interpreter (tests/unit/verify_padding_interp.py, in a subprocess)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from kernels.attention import paged_attention_ref
from services.worker.step_inputs import prepare_step
from services.worker.verify_layout import graph_k, verify_layout
from shared.protocol import PENDING_TOKEN, SamplingParams, ScheduledSeq
from tests.unit import verify_padding_case as case

ROOT = pathlib.Path(__file__).resolve().parents[2]
BS = 4
GREEDY = SamplingParams(temperature=0.0)


def _seq(rid: str, start: int, k: int, table: list[int]) -> ScheduledSeq:
    return ScheduledSeq(rid, [100 + start, *range(200 + k, 200, -1)], start, table, True, GREEDY, 1, num_draft=k)


def test_a_mixed_step_keeps_the_eager_rows_and_pads_after_them():
    # k = 3, 0, 1 and a seq at the end of max_model_len 64, whose padding passes it
    seqs = [_seq("a", 5, 3, [7, 3, 9]), _seq("b", 0, 0, [1]), _seq("c", 10, 1, [4, 8, 2, 6]),
            _seq("d", 62, 1, list(range(20, 36)))]
    lay = verify_layout(seqs, BS, 64, 16)
    assert lay is not None and lay.k == graph_k(seqs) == 3 and not lay.uniform
    ids_e, pos_e, meta = prepare_step(seqs, BS, 64, torch.device("cpu"), False)
    w = 1 + lay.k
    assert len(lay.ids) == len(lay.positions) == len(lay.slots) == 4 * w
    assert [lay.ids[r] for r in lay.rows] == ids_e.tolist()
    assert [lay.positions[r] for r in lay.rows] == pos_e.tolist()
    assert [lay.slots[r] for r in lay.rows] == meta.slot_mapping.tolist()
    assert lay.offsets == meta.cu_seqlens_q.tolist() and lay.real_seq_lens == meta.seq_lens.tolist()
    assert lay.seq_lens == [s.start_pos + w for s in seqs]
    for i, s in enumerate(seqs):
        block = range(i * w, (i + 1) * w)
        real = [r for r in lay.rows if r in block]
        assert real == list(block)[:len(s.token_ids)]  # the real rows come first in the seq's block
        for j, r in enumerate(block):
            if r not in real:  # padding: no KV write, a position the rotary table has
                assert lay.slots[r] == -1
                assert lay.positions[r] == min(s.start_pos + j, 63)
    assert [lay.positions[r] for r in range(3 * w, 4 * w)] == [62, 63, 63, 63]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_random_steps_keep_the_eager_tokens_positions_and_slots(block_size):
    import random

    rng = random.Random(block_size)
    for _ in range(20):
        seqs = []
        for j in range(rng.randint(1, 9)):
            start, k = rng.randrange(60), rng.randint(0, 4)
            table = rng.sample(range(200), -(-(start + 1 + k) // block_size))
            seqs.append(_seq(f"r{j}", start, k, table))
        if graph_k(seqs) == 0:
            continue
        lay = verify_layout(seqs, block_size, 64, 200)
        assert lay is not None
        ids_e, pos_e, meta = prepare_step(seqs, block_size, 64, torch.device("cpu"), False)
        assert [lay.ids[r] for r in lay.rows] == ids_e.tolist()
        assert [lay.positions[r] for r in lay.rows] == pos_e.tolist()
        assert [lay.slots[r] for r in lay.rows] == meta.slot_mapping.tolist()
        assert sum(sl == -1 for sl in lay.slots) == len(lay.slots) - len(lay.rows)


def test_a_uniform_step_has_no_padding_row():
    seqs = [_seq("a", 5, 2, [7, 3, 9]), _seq("b", 0, 2, [1])]
    lay = verify_layout(seqs, BS, 64, 16)
    assert lay is not None and lay.uniform and lay.rows == list(range(6)) and lay.seq_lens == lay.real_seq_lens


def test_steps_a_graph_cannot_lay_out():
    t = [0, 1, 2, 3]
    cases = {
        "decodes only": [ScheduledSeq("a", [5], 5, t, True, GREEDY, 1)],
        "a decode not sampled": [_seq("a", 5, 1, t), ScheduledSeq("b", [5], 5, t, False, GREEDY, 1)],
        "a sampled prefill chunk": [_seq("a", 5, 1, t), ScheduledSeq("b", [1, 2, 3], 0, t, True, GREEDY)],
        "a pending decode": [_seq("a", 5, 1, t), ScheduledSeq("b", [PENDING_TOKEN], 5, t, True, GREEDY, 1)],
        "past its block table": [_seq("a", 5, 1, t), _seq("b", 14, 2, t)],
        "past max_model_len": [_seq("a", 63, 1, list(range(16)))],
        "a table longer than max_blocks": [_seq("a", 5, 1, list(range(17)))],
    }
    for name, seqs in cases.items():
        assert verify_layout(seqs, BS, 64, 16) is None, name


def test_attention_over_the_padded_layout_gives_the_eager_rows():
    lay, (q, cu, lens, tables), (qp, cup, lensp, staged), (kc, vc) = case.build(torch.float32)
    want = paged_attention_ref(q, kc, vc, cu, lens, tables, case.D ** -0.5)
    got = paged_attention_ref(qp, kc, vc, cup, lensp, staged, case.D ** -0.5)
    torch.testing.assert_close(case.real_rows(lay, got), want, atol=1e-5, rtol=1e-5)
    # the truth is sensitive to what the padding exposes: real seq_lens with padded queries differ
    wrong = paged_attention_ref(qp, kc, vc, cup, torch.tensor(lay.real_seq_lens, dtype=torch.int32).clamp(min=5),
                                staged, case.D ** -0.5)
    assert not torch.allclose(case.real_rows(lay, wrong), want, atol=1e-2)


@pytest.fixture(scope="module")
def interp_errors() -> dict[str, float]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests/unit/verify_padding_interp.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode == 3:
        pytest.skip("triton is not installed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_triton_kernels_give_the_eager_rows_over_the_padded_layout(interp_errors):
    assert "prefill" in interp_errors, interp_errors
    for name, err in interp_errors.items():
        assert err < 1e-5, (name, err)
