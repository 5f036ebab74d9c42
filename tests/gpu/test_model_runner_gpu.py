"""The model runner end to end on CUDA with dummy weights (Qwen3-0.6B's shape, 4 layers):
finite logits; CUDA-graph decode equal to eager decode; Triton attention close to the
torch reference attention on the same GPU weights. Skipped without CUDA."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from kernels import attention  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from tests.runner_driver import generate, step_logits  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.protocol import PENDING_TOKEN, SamplingParams, ScheduledSeq, StepPlan  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = json.loads((ROOT / "benchmarks/configs/qwen3-0.6b.json").read_text())
    cfg["num_hidden_layers"] = 4
    d = tmp_path_factory.mktemp("qwen3dummy")
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _runner(d, **kw):
    cli = {"model": str(d), "load_format": "dummy", "device": "cuda", "dtype": "bfloat16",
           "max_num_seqs": 16, "max_model_len": 2048, "gpu_memory_utilization": 0.2, **kw}
    return ModelRunner(build_config(cli=cli, env={}))


def test_graph_decode_equals_eager_and_logits_are_finite(model_dir):
    r = _runner(model_dir)
    rep = r.report()
    assert rep["num_blocks"] > 0 and rep["cuda_graph_sizes"][-1] == 16 and rep["attention"] == "triton"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 10000, (n,), generator=g).tolist() for n in (5, 100, 17, 300, 1)]
    with_graphs = generate(r, prompts, 12, chunk=64)
    graphs, r.graphs = r.graphs, None
    eager = generate(r, prompts, 12, chunk=64)
    r.graphs = graphs
    assert with_graphs == eager
    # async scheduling's pending tokens, read on the GPU from the last draw: graphs and eager
    assert generate(r, prompts, 12, chunk=64, pending=True) == with_graphs
    r.graphs = None
    assert generate(r, prompts, 12, chunk=64, pending=True) == eager
    r.graphs = graphs
    # a smaller batch after a larger one: its padding rows must not run the larger step's
    # pending markers (-1) through the embedding (a device-side assert)
    few = generate(r, prompts[:3], 6, pending=True)
    assert few == generate(r, prompts[:3], 6)
    plan = StepPlan(0, [ScheduledSeq("x", prompts[1], 0, list(range(10)), True, SamplingParams(temperature=0.0))])
    assert torch.isfinite(step_logits(r, plan)).all()


def _reordered_run(r, prompts, steps, sp, pending):
    """Prefill every prompt in one step, then decode `steps` steps with the rows rotated every
    step. pending: inputs are PENDING_TOKEN (async scheduling) and block tables go as
    increments, one block when a request needs it (as the engine sends them); else each
    step feeds the token that came back and the whole table. Returns each request's tokens."""
    bs = r.block_size
    rids = [f"q{i}" for i in range(len(prompts))]
    tables = {rid: list(range(i * 40, i * 40 + 40)) for i, rid in enumerate(rids)}
    held = {rid: -(-len(p) // bs) for rid, p in zip(rids, prompts)}
    plan = StepPlan(0, [ScheduledSeq(rid, p, 0, tables[rid][:held[rid]], True, sp, 0) for rid, p in zip(rids, prompts)])
    out = {rid: [t] for rid, t in zip(rids, r.execute(plan).sampled_token_ids)}
    for k in range(1, steps + 1):
        order = rids[k % len(rids):] + rids[:k % len(rids)]
        seqs = []
        for rid in order:
            pos = len(prompts[rids.index(rid)]) + k - 1
            have = held[rid]
            held[rid] = max(pos // bs + 1, have)
            if pending:
                seqs.append(ScheduledSeq(rid, [PENDING_TOKEN], pos, tables[rid][have:held[rid]], True, None, k,
                                         table_start=have))
            else:
                seqs.append(ScheduledSeq(rid, [out[rid][-1]], pos, tables[rid][:held[rid]], True, sp, k))
        for rid, t in zip(order, r.execute(StepPlan(k, seqs)).sampled_token_ids):
            out[rid].append(t)
    return [out[rid] for rid in rids]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_graph_steps_with_reordered_pending_rows_and_table_increments(model_dir, temperature):
    # the graph stages a pending input as a reference to a row of the last draw, resolved on
    # the device, and restages a table only from where it grew (cuda_graphs.DecodeGraphs.run).
    # Truth: the same graphs fed the tokens that came back and whole tables every step.
    r = _runner(model_dir)
    sp = SamplingParams(temperature=temperature, seed=5)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 10000, (n,), generator=g).tolist() for n in (15, 16, 40, 3, 70)]
    got = _reordered_run(r, prompts, 40, sp, pending=True)
    assert got == _reordered_run(r, prompts, 40, sp, pending=False)
    assert len({tuple(t) for t in got}) == len(prompts)  # not a degenerate run


def test_triton_attention_close_to_reference_attention_end_to_end(model_dir):
    r = _runner(model_dir, enforce_eager=True)
    prompt = torch.randint(0, 10000, (77,), generator=torch.Generator().manual_seed(1)).tolist()
    plan = StepPlan(0, [ScheduledSeq("x", prompt, 0, list(range(6)), True, SamplingParams(temperature=0.0))])
    got = step_logits(r, plan)
    r.use_ref_attention = True
    saved = attention.paged_attention_triton
    try:
        ref = step_logits(r, plan)
    finally:
        r.use_ref_attention = False
        attention.paged_attention_triton = saved
    err = float((got - ref).norm() / ref.norm())
    assert err < 3e-2, err
