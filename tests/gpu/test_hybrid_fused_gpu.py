"""The hybrid models' fused layer path on CUDA (services/worker/models/qwen3_next.py
`Qwen3NextDecoderLayer.forward_fused`, `qwen3_next.FUSE_LAYERS`; docs/ARCHITECTURE.md §6.3):
the zero-centred norms in the first projections' gemv prologues (xn_out where the
projections are apart), the residual adds in the output projections' epilogues and the MoE
decode path's down kernel.
Shown:
- the runner's plan fuses one-row steps of a hybrid in bf16, and every 1..16-row step of a
  tiny one (its projections fit the skinny kernel); Qwen3.5-35B-A3B's shapes only one row
  (its gated-DeltaNet in_proj is over kernels.linear.SKINNY_MAX_WEIGHT);
- tiny random Qwen3-Next (a dense MLP layer among the MoE ones) and Qwen3.5-MoE in bf16,
  projections stacked and apart: the logits of a prompt fed one token a step from the decode
  CUDA graphs, fused against unfused, within REL; and against the same checkpoint run in
  fp32 (its weights bf16 values: the truth for the rounding), the fused path's mean error at
  most 1.25x the unfused one's;
- Qwen3.5-35B-A3B's shapes cut to 4 layers (3 gated-DeltaNet, 1 attention; dummy weights,
  norm scales not 1): one decode step of 1 and of 4 seqs fused against unfused (4 seqs: the
  projections over the skinny kernel's limit take the norm and add as their own ops), and
  the one-row step's gemv launches: a norm prologue in each layer's two first projections,
  xn_out in the MoE block's, a residual in each mixer's output projection.
Skipped without CUDA. bash scripts/gpu_hybrid_fused.sh runs this file and the A/B timing.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")
pytest.importorskip("transformers")

from kernels import gemv  # noqa: E402
from kernels import linear as L  # noqa: E402
from services.worker.fusion import FusionPlan  # noqa: E402
from services.worker.layers.norm import ZeroCenteredRMSNorm  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from services.worker.models import qwen3_next  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan  # noqa: E402
from tests.gpu.hybrid_runs import bf16_against_fp32  # noqa: E402
from tests.hybrid_checkpoint import write_tiny_qwen3_next  # noqa: E402
from tests.runner_driver import step_logits  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
VOCAB = 512
GREEDY = SamplingParams(temperature=0.0)
# max |fused - unfused| over max |logit|, bf16. The two paths round the residual sums at the same
# points (once, in bf16); the norm's rstd sums its squares in other chunks, so a normalised
# value may take the neighbouring bf16, which the recurrent state carries on
REL = 5e-2


def _tiny_runner(path, dtype: str, stacked: bool, fuse: bool, monkeypatch) -> ModelRunner:
    monkeypatch.setattr(qwen3_next, "STACK_PROJECTIONS", stacked)  # read when the model is built
    monkeypatch.setattr(qwen3_next, "FUSE_LAYERS", fuse)  # read when the runner chooses its plan
    cli = {"model": str(path), "device": "cuda", "dtype": dtype, "block_size": 16, "max_num_seqs": 8,
           "max_model_len": 512, "max_num_batched_tokens": 1, "gpu_memory_utilization": 0.1}
    r = ModelRunner(build_config(cli=cli, env={}))
    assert r.graphs is not None and r.model.stacked == stacked
    if dtype == "bfloat16":
        want = frozenset(range(1, L.SKINNY_MAX_ROWS + 1)) if L.SKINNY_PDL else frozenset({1})
        assert r.fusion.rows == (want if fuse else frozenset()), r.fusion.rows
    return r


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def tiny(request, tmp_path_factory):
    """A tiny random hybrid whose weights are bf16 values (saved in fp32)."""
    arch = request.param
    return write_tiny_qwen3_next(tmp_path_factory.mktemp(f"hybrid_fused_{arch}"), vocab=VOCAB, hidden=256,
                                 head_dim=64, linear_dim=64, moe=64, shared=128, std=0.08, bf16_exact=True,
                                 arch=arch, mlp_only_layers=(3,) if arch == "qwen3_next" else ())


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "apart"])
def test_tiny_hybrid_fused_decode_graphs_match_unfused_and_are_as_close_to_fp32(tiny, stacked, monkeypatch):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (10,), generator=g).tolist() for _ in range(2)]
    runs = bf16_against_fp32(lambda dtype, fuse: _tiny_runner(tiny, dtype, stacked, fuse, monkeypatch), False,
                             (False, True), prompts)
    logits = {fuse: run.logits for fuse, run in runs.items()}
    err = {fuse: run.mean_error for fuse, run in runs.items()}
    rel = max(float((f - u).abs().max() / u.abs().max()) for f, u in zip(logits[True], logits[False]))
    print(f"stacked={stacked}: fused vs unfused {rel:.4f}; mean error against fp32 unfused {err[False]:.4f} "
          f"fused {err[True]:.4f}")
    assert all(torch.isfinite(x).all() for x in logits[True])
    assert rel < REL
    assert err[True] <= 1.25 * err[False] + 1e-3, err


@pytest.fixture(scope="module")
def qwen35_4_layers(tmp_path_factory):
    """An eager CUDA runner of benchmarks/configs/qwen3.5-35b-a3b.json cut to its first 4
    layers and a 4,096-token vocabulary (dummy bf16 weights), the decoder layers' norm
    weights not 0 (scales not 1), so that a norm applied wrongly (the weight for the scale,
    or twice) shows."""
    cfg = json.loads((ROOT / "benchmarks/configs/qwen3.5-35b-a3b.json").read_text())
    text = cfg["text_config"]
    text.update(num_hidden_layers=4, vocab_size=4096, layer_types=text["layer_types"][:4])
    d = tmp_path_factory.mktemp("qwen3_5_4layers")
    (d / "config.json").write_text(json.dumps(cfg))
    cli = {"model": str(d), "load_format": "dummy", "device": "cuda", "dtype": "bfloat16", "max_num_seqs": 8,
           "max_model_len": 1024, "gpu_memory_utilization": 0.3, "enforce_eager": True, "block_size": 16}
    saved = qwen3_next.FUSE_LAYERS
    qwen3_next.FUSE_LAYERS = True  # whatever the default
    try:
        r = ModelRunner(build_config(cli=cli, env={}))
    finally:
        qwen3_next.FUSE_LAYERS = saved
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for layer in r.model.model.decoder_layers:
            for n in (layer.input_layernorm, layer.post_attention_layernorm):
                assert isinstance(n, ZeroCenteredRMSNorm)
                n.weight.copy_(0.3 * torch.randn(n.weight.shape, device="cuda", generator=g))
                n.scale.copy_((1.0 + n.weight.float()).to(n.scale.dtype))  # in place: the same tensor
    return r


@pytest.mark.parametrize("batch", [1, 4])
def test_qwen3_5_shapes_fused_decode_step_matches_unfused(qwen35_4_layers, batch, monkeypatch):
    r = qwen35_4_layers
    assert r.fusion.rows == frozenset({1})  # in_proj [12352, 2048] is over the skinny kernel's limit
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 4096, (int(n),), generator=g).tolist()
               for n in torch.randint(5, 40, (batch,), generator=g)]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(batch)]

    def step(fused: bool) -> torch.Tensor:
        # each run from fresh state (start_pos 0 on the same slots): prefill unfused, one decode step
        r.fusion = FusionPlan(frozenset())
        step_logits(r, StepPlan(0, [ScheduledSeq(f"s{i}", p, 0, tables[i], True, GREEDY, state_slot=i)
                                    for i, p in enumerate(prompts)]))
        r.fusion = FusionPlan(frozenset({batch}) if fused else frozenset())
        return step_logits(r, StepPlan(1, [ScheduledSeq(f"s{i}", [7 + i], len(p), tables[i], True, GREEDY, 1,
                                                        state_slot=i) for i, p in enumerate(prompts)]))

    calls: list[dict] = []
    real = gemv.gemv_triton

    def counting(x, w, *a, **kw):
        calls.append({"norm": kw.get("norm_weight") is not None, "xn_out": kw.get("xn_out") is not None,
                      "residual": kw.get("residual") is not None})
        return real(x, w, *a, **kw)

    default = r.fusion
    try:
        unfused = step(False)
        monkeypatch.setattr(gemv, "gemv_triton", counting)
        fused = step(True)
    finally:
        r.fusion = default
    rel = float((fused - unfused).abs().max() / unfused.abs().max())
    print(f"batch {batch}: fused vs unfused {rel:.5f}; gemv launches {len(calls)}")
    assert torch.isfinite(fused).all() and rel < 2e-2
    if batch == 1:  # 4 layers: mixer in (norm) + MoE in_proj (norm, xn_out); mixer out (residual)
        assert sum(c["norm"] for c in calls) == 8 and sum(c["xn_out"] for c in calls) == 4
        assert sum(c["residual"] for c in calls) == 4
