"""The EAGLE head and the DFlash drafter on CUDA (tiny random Llama, fp32, Triton kernels,
CUDA graphs): the aux_hidden seam inside a captured decode graph equals the eager forward's;
greedy output with speculation equals plain decoding; drafts proposed from graph steps equal
those of eager steps; after forced acceptance lengths the draft distributions equal the
dense references (tests/unit/spec_head_dense.py) on the same GPU. Skipped without CUDA."""

from __future__ import annotations

import gc
import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from shared.protocol import SamplingParams  # noqa: E402
from tests.runner_driver import generate, spec_run  # noqa: E402
from tests.unit.spec_head_dense import dflash_dense, eagle_dense  # noqa: E402
from tests.unit.spec_head_rig import SpecRig, sharpen, tiny_runner  # noqa: E402

METHODS = {"eagle": (3, eagle_dense), "dflash": (4, dflash_dense)}


def _prompts(seed: int, sizes=(5, 40, 17, 1, 33, 9)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 32, (n,), generator=g).tolist() for n in sizes]


@pytest.fixture(scope="module", params=sorted(METHODS))
def spec_runner(request, tmp_path_factory):
    k = METHODS[request.param][0]
    runner, _ = tiny_runner(tmp_path_factory.mktemp(request.param),
                            f'{{"method": "{request.param}", "num_speculative_tokens": {k}, "policy": "fixed"}}',
                            device="cuda")
    assert runner.graphs is not None and not runner.use_ref_attention
    yield request.param, runner
    # the next method's runner sizes its KV from the free GPU memory (gpu_memory_utilization
    # 0.05): give this one's back first
    del runner
    gc.collect()
    torch.cuda.empty_cache()


def test_greedy_output_with_speculation_equals_plain_decoding(spec_runner):
    method, runner = spec_runner
    k = METHODS[method][0]
    prompts = _prompts(0)
    base = generate(runner, prompts, 16)  # decode steps from CUDA graphs
    run = spec_run(runner, prompts, 16, k, chunk=16)
    assert run.tokens == base and run.num_draft_tokens > 0


def test_drafts_from_graph_steps_equal_drafts_from_eager_steps(spec_runner):
    """No draft is ever verified, so every decode step is a graph replay that proposes:
    observe and propose read the graph's buffers and its captured aux_hidden."""
    method, runner = spec_runner
    k = METHODS[method][0]
    prompts = _prompts(1, (7, 20, 3))
    graphs = spec_run(runner, prompts, 10, k, drafts=lambda i, outs, proposed: [])
    saved, runner.graphs = runner.graphs, None
    try:
        eager = spec_run(runner, prompts, 10, k, drafts=lambda i, outs, proposed: [])
    finally:
        runner.graphs = saved
    assert graphs.tokens == eager.tokens
    g = [r.draft_token_ids for r in graphs.results]
    assert g == [r.draft_token_ids for r in eager.results] and sum(len(d) for d in g) > 10


def test_draft_distributions_equal_the_dense_reference(spec_runner):
    method, runner = spec_runner
    k, dense = METHODS[method]
    p = runner.proposer
    sharpen(p.head if method == "eagle" else p.drafter, seed=1)
    p.probabilistic = True
    try:
        rig = SpecRig(runner, p, k, SamplingParams(temperature=1.0, seed=5))
        rig.next_block = 256  # past the blocks spec_run's requests used
        lengths = iter([0, 1, 3, 2, 0, 3] * 100)
        rig.run(_prompts(2, (7, 30, 3)), 10, chunk=8, join=[0, 2, 0], preempt={5: 0},
                verify=lambda d: min(len(d), next(lengths)), rng=random.Random(3))
        assert rig.accepted > 5
        with torch.inference_mode():
            for entry in rig.log:
                ref = (eagle_dense(p, runner, entry.context, entry.drafts, 1.0, rig.blocks(len(entry.context)))
                       if method == "eagle" else
                       dflash_dense(p, runner, entry.context, len(entry.drafts), 1.0, rig.blocks(len(entry.context))))
                torch.testing.assert_close(entry.probs, ref, rtol=5e-3, atol=1e-3)  # tf32 matmuls (H200: 5.6e-4 seen)
                rig.next_block -= -(-len(entry.context) // runner.block_size)
    finally:
        p.probabilistic = False
