"""The hybrid models' launch savings on CUDA (docs/ARCHITECTURE.md §6.3): the glue kernels of
kernels/hybrid_glue.py against their torch references at Qwen3.5-35B-A3B's decode shapes, and
a tiny random Qwen3-Next (tests/hybrid_checkpoint.py) with qwen3_next.STACK_PROJECTIONS and
qwen3_next_blocks.FUSED_GLUE on and off, decoding from CUDA graphs.
Shown:
- sigmoid_gate_mul (16 heads of 256, the gate the strided second half of each head of the
  q projection) and shared_expert_combine (hidden 2048, the gate a column of the stacked
  [T, 256 + 2 * 512 + 1] output) at 1, 3 and 8 rows, fp32 / fp16 / bf16, within two ulps of
  the largest output of the references (they round at the same points; the fp32 exp may
  differ in its last bits); and kernels.moe.moe_block with a shared expert (added in the
  decode path's down kernel, or by the combine kernel after it) as the block then the combine;
- each of stacked+glue, apart+glue, apart without glue decodes (graphs; prompts fed one
  token a step) within REL of the default (stacked, no glue) in every step's logits, and in
  fp32 greedily the same tokens.
Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("transformers")

from kernels import hybrid_glue  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from services.worker.models import qwen3_next, qwen3_next_blocks  # noqa: E402
from shared.config import build_config  # noqa: E402
from tests.gpu.hybrid_runs import bf16_against_fp32, decode_logits, release  # noqa: E402
from tests.hybrid_checkpoint import write_tiny_qwen3_next  # noqa: E402
from tests.runner_driver import generate  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ULP = {"float32": 2 ** -23, "float16": 2 ** -10, "bfloat16": 2 ** -7}  # relative spacing at 1
VOCAB = 512
# max logit error over max |logit| against the default (projections apart, torch glue). H200,
# 2026-12-03: stacked alone 0.0 in bf16 (the same products), fused glue 0.037 in bf16 (stacked or
# not: where the residual sums are rounded), fp32 within 1e-4 with equal greedy tokens
REL = {"float32": 1e-4, "bfloat16": 5e-2}


def _two_ulps(ref: torch.Tensor, dtype: str) -> float:
    return ULP[dtype] * float(ref.float().abs().max()) * 2  # two ulps at the largest value's binade


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_sigmoid_gate_mul_matches_torch_at_the_gated_attention_shape(rows, dtype):
    dt = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(rows)
    qg = (3 * torch.randn(rows, 16, 512, device="cuda", generator=g)).to(dt)
    gate, o = qg[..., 256:], torch.randn(rows, 16 * 256, device="cuda", generator=g).to(dt)
    got, want = hybrid_glue.sigmoid_gate_mul(o, gate), hybrid_glue.sigmoid_gate_mul_ref(o, gate)
    assert got.dtype == dt and got.shape == want.shape
    assert float((got.float() - want.float()).abs().max()) <= _two_ulps(want, dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_shared_expert_combine_matches_torch_at_the_moe_block_shape(rows, dtype):
    dt = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(10 + rows)
    stacked = (3 * torch.randn(rows, 256 + 2 * 512 + 1, device="cuda", generator=g)).to(dt)
    gate = stacked[:, -1:]
    moe_out, shared = (torch.randn(rows, 2048, device="cuda", generator=g).to(dt) for _ in range(2))
    got = hybrid_glue.shared_expert_combine(moe_out, gate, shared)
    want = hybrid_glue.shared_expert_combine_ref(moe_out, gate, shared)
    assert got.dtype == dt and got.shape == want.shape
    assert float((got.float() - want.float()).abs().max()) <= _two_ulps(want, dtype)


@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("rows", [1, 4])
def test_moe_block_with_a_shared_expert_equals_the_block_then_the_combine(monkeypatch, rows, fold):
    """kernels.moe.moe_block(..., shared=(gate, out)) at Qwen3.5-35B-A3B's MoE shape (256
    experts of 512, 8 a token, hidden 2048), bf16: the decode path with the shared expert in
    its down kernel (SHARED_IN_DOWN) or the combine kernel after it, against the block without
    it followed by shared_expert_combine_ref (the same routing and rounding points: the two
    differ by the fp32 exp of the sigmoid only); the five-launch path's likewise."""
    from kernels import moe

    monkeypatch.setattr(moe, "SHARED_IN_DOWN", fold)
    e, k, h, inter = 256, 8, 2048, 512
    g = torch.Generator(device="cuda").manual_seed(20 + rows)
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) / h ** 0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) / inter ** 0.5).bfloat16()
    x = torch.randn(rows, h, device="cuda", generator=g).bfloat16()
    logits = (torch.stack([torch.randperm(e, device="cuda", generator=g) for _ in range(rows)]).float() / 16).bfloat16()
    wide = (3 * torch.randn(rows, 2 * inter + 1, device="cuda", generator=g)).bfloat16()
    gate, shared = wide[:, -1:], torch.randn(rows, h, device="cuda", generator=g).bfloat16()
    for fused in (True, False):
        monkeypatch.setattr(moe, "DECODE_FUSED", fused)
        alone = moe.moe_block(x, logits, w13, w2, k, True)
        got = moe.moe_block(x, logits, w13, w2, k, True, (gate, shared))
        want = hybrid_glue.shared_expert_combine_ref(alone, gate, shared)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, h)
        assert float((got.float() - want.float()).abs().max()) <= _two_ulps(want, "bfloat16"), fused


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_qwen3_next(tmp_path_factory.mktemp("hybrid_glue_gpu"), vocab=VOCAB, hidden=256, head_dim=64,
                                 linear_dim=64, moe=64, shared=128, std=0.08)


def _runner(path, dtype: str, stack: bool, glue: bool, monkeypatch) -> ModelRunner:
    monkeypatch.setattr(qwen3_next, "STACK_PROJECTIONS", stack)  # read when the model is built
    monkeypatch.setattr(qwen3_next_blocks, "FUSED_GLUE", glue)  # read when the graphs are captured
    cli = {"model": str(path), "device": "cuda", "dtype": dtype, "block_size": 16, "max_num_seqs": 8,
           "max_model_len": 512, "max_num_batched_tokens": 1, "gpu_memory_utilization": 0.1}
    r = ModelRunner(build_config(cli=cli, env={}))
    assert r.graphs is not None and r.model.stacked == stack
    return r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stacked_and_glue_paths_decode_as_the_default(tiny, dtype, monkeypatch):
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, VOCAB, (9,), generator=g).tolist()
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (6, 3, 9)]
    base = _runner(tiny, dtype, False, False, monkeypatch)  # the defaults' baseline: torch glue, apart
    want, want_tokens = decode_logits(base, prompt), generate(base, prompts, 12, chunk=1)
    del base
    release()
    rels, tokens_same = {}, {}
    for stack, glue in ((False, True), (True, False), (True, True)):
        r = _runner(tiny, dtype, stack, glue, monkeypatch)
        got = decode_logits(r, prompt)
        assert torch.isfinite(got).all()
        rels[(stack, glue)] = float((got - want).abs().max() / want.abs().max())
        tokens_same[(stack, glue)] = generate(r, prompts, 12, chunk=1) == want_tokens
        del r
        release()
    print("max-abs logit difference over max |logit| (stack, glue):", rels, "greedy equal:", tokens_same)
    assert all(v < REL[dtype] for v in rels.values()), rels
    if dtype == "float32":
        assert all(tokens_same.values()), tokens_same


@pytest.fixture(scope="module")
def tiny_bf16w(tmp_path_factory):
    return write_tiny_qwen3_next(tmp_path_factory.mktemp("hybrid_glue_bf16w"), vocab=VOCAB, hidden=256, head_dim=64,
                                 linear_dim=64, moe=64, shared=128, std=0.08, bf16_exact=True)


def test_bf16_fused_glue_is_as_close_to_fp32_as_the_torch_glue(tiny_bf16w, monkeypatch):
    """The independent truth for the bf16 paths: the same checkpoint (its weights bf16
    values) run in fp32 on the default path, whose fp32 paths agree within 1e-4 above. Each
    bf16 path's logits (a prompt fed one token a step, decode graphs) are measured against
    it position by position as max |bf16 - fp32| over max |fp32|, averaged over positions
    and prompts. The fused glue rounds its residual sums at other points than the torch
    glue, so the two bf16 paths differ from each other; neither may be much further from
    fp32 than the torch glue is (a 1.25x margin over the baseline's own bf16 error).
    H200, 2026-12-03, fp32 weights not bf16 values: all three paths 0.54 max over 12
    positions (the weights' own rounding dominated), 0.537-0.539 apart."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (12,), generator=g).tolist() for _ in range(3)]
    runs = bf16_against_fp32(lambda dtype, v: _runner(tiny_bf16w, dtype, *v, monkeypatch), (False, False),
                             ((False, False), (False, True), (True, True)), prompts)
    err = {v: run.mean_error for v, run in runs.items()}
    for v, run in runs.items():
        print(v, "per-position error of prompt 0:", [round(float(x), 4) for x in run.errors[0]])
    print("bf16 mean relative logit error against fp32 (stack, glue):", err)
    base = err[(False, False)]
    assert all(v <= 1.25 * base + 1e-3 for v in err.values()), err
