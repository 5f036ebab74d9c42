"""The hybrid models' fused layer path (services/worker/models/qwen3_next.py
`Qwen3NextDecoderLayer.forward_fused`, `qwen3_next.FUSE_LAYERS`; docs/ARCHITECTURE.md §6.3):
the zero-centred norms inside the first projections' prologues (their `scale` as the norm
weight), the residual adds inside the output projections and the MoE down path, on tiny random
Qwen3-Next (gated DeltaNet, gated attention, a dense MLP layer among the MoE ones) and
Qwen3.5-MoE (Qwen3.5's gated-DeltaNet projections) checkpoints (tests/hybrid_checkpoint.py),
with the projections stacked and apart (apart, the first projection stores the normalised
input, xn_out, for the others), with the fused glue on and off.
Shown, on the CPU with the path forced (FusionPlan(None): every step; the reference ops):
- every step's logits equal the unfused path's bit for bit in fp32: a prefill, a decode
  beside a prefill chunk (the gathered gated-DeltaNet path, where the norm and the add run as
  their own ops) and in-place decodes of two seqs; the layers ran forward_fused, and the
  only norm module call a step is the final norm;
- speculative decoding (n-gram runner, drafts half right: verify steps over tracked state)
  on the fused path gives the unfused greedy output;
- fusable_projections names the projections with the prologues / epilogues of each layer
  kind, [] with FUSE_LAYERS off, and the CPU plan fuses nothing.
The kernels themselves (the gemv with the zero-centred scale, xn_out, the residual) under the
Triton interpreter: test_hybrid_fused_interp.py; on CUDA: tests/gpu/test_hybrid_fused_gpu.py.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from services.worker.fusion import FusionPlan  # noqa: E402
from services.worker.layers.norm import ZeroCenteredRMSNorm  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from services.worker.models import qwen3_next, qwen3_next_blocks  # noqa: E402
from shared.config import build_config  # noqa: E402
from shared.protocol import SamplingParams, ScheduledSeq, StepPlan  # noqa: E402
from tests.hybrid_checkpoint import write_tiny_qwen3_next  # noqa: E402
from tests.parity.hf_checks import assert_speculation_is_lossless  # noqa: E402
from tests.runner_driver import generate, step_logits  # noqa: E402

VOCAB = 101
GREEDY = SamplingParams(temperature=0.0)
ARCHS = ("qwen3_next", "qwen3_5_moe")
DENSE_LAYER = 3  # Qwen3-Next's dense MLP layer (a linear-attention layer of tests/hybrid_checkpoint.LAYERS)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    """(arch, folder) of a tiny random hybrid checkpoint of each architecture."""
    arch = request.param
    dense = (DENSE_LAYER,) if arch == "qwen3_next" else ()
    return arch, write_tiny_qwen3_next(tmp_path_factory.mktemp(arch), vocab=VOCAB, arch=arch, mlp_only_layers=dense)


def _runner(path, monkeypatch, stacked: bool, **kw) -> ModelRunner:
    monkeypatch.setattr(qwen3_next, "STACK_PROJECTIONS", stacked)  # read when the model is built
    cli = {"model": str(path), "device": "cpu", "dtype": "float32", "kv_cache_gib": 0.02, "block_size": 4,
           "max_model_len": 256, **kw}
    r = ModelRunner(build_config(cli=cli, env={}))
    assert r.model.stacked == stacked
    return r


def run_steps(r: ModelRunner) -> list[torch.Tensor]:
    """Logits of: A's 9-token prefill; A's decode beside B's 7-token prefill; three decodes
    of A and B together (A on state slot 0, B on 1, both from zeros)."""
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (9, 7))
    ta, tb = list(range(0, 8)), list(range(8, 16))
    out = [step_logits(r, StepPlan(0, [ScheduledSeq("a", a, 0, ta, True, GREEDY, state_slot=0)]))]
    tok_a = int(out[-1][0].argmax())
    out.append(step_logits(r, StepPlan(1, [ScheduledSeq("a", [tok_a], 9, ta, True, GREEDY, 1, state_slot=0),
                                           ScheduledSeq("b", b, 0, tb, True, GREEDY, state_slot=1)])))
    for i in range(3):
        tok_a, tok_b = (int(x) for x in out[-1].argmax(-1))
        out.append(step_logits(r, StepPlan(2 + i, [
            ScheduledSeq("a", [tok_a], 10 + i, ta, True, GREEDY, 2 + i, state_slot=0),
            ScheduledSeq("b", [tok_b], 7 + i, tb, True, GREEDY, 1 + i, state_slot=1)])))
    return out


def _count(monkeypatch, cls, name: str) -> list[int]:
    """Count calls of cls.<name> (a one-element list), calling through."""
    real, n = getattr(cls, name), [0]

    def counting(self, *a, **kw):
        n[0] += 1
        return real(self, *a, **kw)
    monkeypatch.setattr(cls, name, counting)
    return n


@pytest.mark.parametrize("glue", [True, False], ids=["glue", "torch_glue"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "apart"])
def test_fused_layer_path_forced_on_cpu_equals_unfused_path_bit_for_bit(tiny, stacked, glue, monkeypatch):
    arch, path = tiny
    monkeypatch.setattr(qwen3_next_blocks, "FUSED_GLUE", glue)  # read at each forward
    r = _runner(path, monkeypatch, stacked)
    layers = r.model.model.decoder_layers
    assert any(layer.is_attention for layer in layers) and any(not layer.is_attention for layer in layers)
    assert any(isinstance(layer.mlp, qwen3_next.LlamaMLP) for layer in layers) == (arch == "qwen3_next")
    assert r.fusion.rows == frozenset() and not r.fusion.fused(1)  # the CPU keeps the unfused path
    unfused = run_steps(r)
    fused_calls = _count(monkeypatch, qwen3_next.Qwen3NextDecoderLayer, "forward_fused")
    norm_calls = _count(monkeypatch, ZeroCenteredRMSNorm, "forward")
    r.fusion = FusionPlan(None)  # every step on the fused path
    fused = run_steps(r)
    assert fused_calls[0] == len(layers) * len(fused)
    assert norm_calls[0] == len(fused)  # the final norm only: the layers' norms ran in their projections
    for i, (f, u) in enumerate(zip(fused, unfused)):
        assert torch.isfinite(u).all()
        assert torch.equal(f, u), (i, float((f - u).abs().max()))


def test_speculative_verify_steps_on_the_fused_path_give_the_greedy_output(tiny, monkeypatch):
    _, path = tiny
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (11, 6)]
    n, k = 10, 3
    plain = generate(_runner(path, monkeypatch, True, block_size=8), prompts, n)
    r = _runner(path, monkeypatch, True, block_size=8,
                speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": k}))
    r.fusion = FusionPlan(None)
    assert_speculation_is_lossless(r, plain, prompts, n, k, VOCAB)


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "apart"])
def test_fusable_projections_name_each_layer_kinds_fused_projections(tiny, stacked, monkeypatch):
    arch, path = tiny
    r = _runner(path, monkeypatch, stacked)
    layers = r.model.model.decoder_layers
    attn = next(lay.self_attn for lay in layers if lay.self_attn is not None)
    gdn = next(lay.linear_attn for lay in layers if lay.linear_attn is not None)
    moe = next(lay.mlp for lay in layers if isinstance(lay.mlp, qwen3_next_blocks.SharedExpertMoeBlock))
    want = [attn.qkv_proj, attn.o_proj, gdn.in_proj if stacked else gdn.in_proj_qkvz, gdn.out_proj,
            moe.in_proj if stacked else moe.gate]
    if arch == "qwen3_next":
        dense = layers[DENSE_LAYER].mlp
        want += [dense.gate_up_proj, dense.down_proj]
    got = r.model.fusable_projections()
    assert [id(w) for w in got] == [id(p.weight) for p in want]
    assert FusionPlan.choose(got, torch.device("cpu"), torch.bfloat16).rows == frozenset()
    monkeypatch.setattr(qwen3_next, "FUSE_LAYERS", False)
    assert r.model.fusable_projections() == []
