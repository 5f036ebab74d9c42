"""A hybrid model's decode steps replayed from CUDA graphs (services/worker/cuda_graphs.py
with a state cache; docs/ARCHITECTURE.md §4.7, §6.5), on a tiny random Qwen3-Next
(tests/hybrid_checkpoint.py) in fp32 and bf16, against the same runner's eager steps. The
graphs capture the recurrent layers' decode path (the in-place convolution and
recurrent-step kernels of kernels/gdn_decode.py) over the static state view (slots, has_initial).
Shown, per dtype:
- greedy decoding with graphs equals eager decoding (prompts fed one token a step, so every
  step is a decode: 5 seqs in the graph of 8, then fewer as requests finish), also with
  pending (async) inputs; the second run reuses the slots of the first from start_pos 0;
- one padded step (3 seqs in the graph of 4) gives the eager step's logits, its padding row
  runs on the scratch slot (NaN before, finite after) and every other slot stays bit-identical;
  its one-token prompt on a slot holding NaN gives the logits of that prompt on a clean slot.
The profile's prefill is one token (max_num_batched_tokens 1), so only decode kernels
compile here (fla's chunked kernels autotune; tests/gpu/test_hybrid_gpu.py runs them).
Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("transformers")

from services.worker.model_runner import ModelRunner  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan  # noqa: E402
from tests.hybrid_checkpoint import write_tiny_qwen3_next  # noqa: E402
from tests.runner_driver import generate, step_logits  # noqa: E402

VOCAB = 512
GREEDY = SamplingParams(temperature=0.0)
REL = {"float32": 1e-4, "bfloat16": 3e-2}  # max error over max |logit|: graph (padded) vs eager


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_qwen3_next(tmp_path_factory.mktemp("hybrid_graphs_gpu"), vocab=VOCAB, hidden=256, head_dim=64,
                                 linear_dim=64, moe=64, shared=128, std=0.08)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def runner(request, tiny):
    cli = {"model": str(tiny), "device": "cuda", "dtype": request.param, "block_size": 16, "max_num_seqs": 8,
           "max_model_len": 512, "max_num_batched_tokens": 1, "gpu_memory_utilization": 0.1}
    r = ModelRunner(build_config(cli=cli, env={}))
    rep = r.report()
    assert rep["cuda_graph_sizes"] == [1, 2, 4, 8] and rep["attention"] == "triton"
    assert r.state_cache is not None and r.verify_graphs is None
    return r


def _prompts(lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]


def test_greedy_decode_with_graphs_equals_eager_decode(runner):
    r = runner
    prompts = _prompts((6, 3, 9, 1, 5))
    graphs = r.graphs
    with_graphs = generate(r, prompts, 12, chunk=1)
    r.graphs = None
    try:
        eager = generate(r, prompts, 12, chunk=1)
    finally:
        r.graphs = graphs
    assert with_graphs == eager
    assert generate(r, prompts, 12, chunk=1, pending=True) == with_graphs


def _states(r) -> list[torch.Tensor]:
    return [t.clone() for layer in r.state_cache.layers for t in layer]


def _fill(r, slot: int, value: float | None) -> None:
    for layer in r.state_cache.layers:
        for t in layer:
            t[slot] = torch.randn(t.shape[1:], device=t.device).to(t.dtype) if value is None else value


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def test_a_padded_graph_step_touches_only_its_slots_and_a_reused_slot_starts_from_zeros(runner):
    r = runner
    cache = r.state_cache
    graphs = r.graphs
    prompts = _prompts((7, 4))
    slots, tables = [2, 0], [list(range(0, 4)), list(range(4, 8))]
    r.graphs = None
    try:
        firsts = generate_prefill(r, prompts, slots, tables)
    finally:
        r.graphs = graphs
    reused = 5
    _fill(r, reused, float("nan"))  # a one-token prompt there must read zeros
    for s in [s for s in range(cache.num_slots) if s not in (*slots, reused)]:
        _fill(r, s, None)
    _fill(r, cache.scratch_slot, float("nan"))
    seqs = [ScheduledSeq("a", [firsts[0]], len(prompts[0]), tables[0], True, GREEDY, 1, state_slot=slots[0]),
            ScheduledSeq("c", [42], 0, list(range(8, 12)), True, GREEDY, 0, state_slot=reused),
            ScheduledSeq("b", [firsts[1]], len(prompts[1]), tables[1], True, GREEDY, 1, state_slot=slots[1])]
    before = _states(r)
    graph = step_logits(r, StepPlan(1, seqs))  # 3 seqs: the graph of 4
    after = _states(r)
    for t_0, t_1 in zip(before, after):
        for s in range(cache.num_slots):
            if s not in (*slots, reused):
                assert torch.equal(t_1[s], t_0[s]), f"slot {s} changed"
        assert torch.isfinite(t_1[cache.scratch_slot]).all()  # the padding row ran there, from zeros
        assert all(torch.isfinite(t_1[s]).all() for s in (*slots, reused))
    for t, b in zip((t for layer in cache.layers for t in layer), before):
        t.copy_(b)
    r.graphs = None
    try:
        eager = step_logits(r, StepPlan(2, seqs))
    finally:
        r.graphs = graphs
    dt = str(r.dtype).removeprefix("torch.")
    assert torch.isfinite(graph).all() and _rel(graph, eager) < REL[dt]
    _fill(r, 6, 0.0)
    alone = step_logits(r, StepPlan(3, [ScheduledSeq("c2", [42], 0, list(range(12, 16)), True, GREEDY, 0,
                                                     state_slot=6)]))  # a clean slot, the graph of 1
    assert _rel(graph[1:2], alone) < REL[dt]


def generate_prefill(r, prompts, slots, tables) -> list[int]:
    """Prefill each prompt one token a step (decode kernels only) on its slot and table;
    returns each prompt's first sampled token."""
    firsts = [0] * len(prompts)
    for j in range(max(len(p) for p in prompts)):
        seqs, who = [], []
        for i, p in enumerate(prompts):
            if j < len(p):
                last = j == len(p) - 1
                seqs.append(ScheduledSeq(f"p{i}", [p[j]], j, tables[i], last, GREEDY, 0, state_slot=slots[i]))
                if last:
                    who.append(i)
        for i, t in zip(who, r.execute(StepPlan(0, seqs)).sampled_token_ids):
            firsts[i] = t
    return firsts
