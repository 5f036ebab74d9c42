"""The loader's checkpoint-name mapping (`services.worker.loader._target`): keys of a model's
packed_modules that span several name parts, against the names written out by hand."""

from __future__ import annotations

from services.worker.layers.gated_deltanet import GatedDeltaNet
from services.worker.loader import _target
from services.worker.models.qwen3_next import Qwen3NextForCausalLM
from services.worker.models.qwen3_next_blocks import MOE_STACKED

PACKED = {**Qwen3NextForCausalLM.packed_modules, **GatedDeltaNet.packed_modules("qwen3_5", True), **MOE_STACKED}


def test_a_multi_part_key_wins_over_the_one_part_key_inside_it():
    # the shared expert's gate_proj goes to the MoE block's stacked in_proj, not to gate_up_proj
    assert _target("model.layers.3.mlp.shared_expert.gate_proj.weight", PACKED) == ("model.layers.3.mlp.in_proj.weight", 1)
    assert _target("model.layers.3.mlp.shared_expert.up_proj.weight", PACKED) == ("model.layers.3.mlp.in_proj.weight", 2)
    assert _target("model.layers.3.mlp.shared_expert_gate.weight", PACKED) == ("model.layers.3.mlp.in_proj.weight", 3)
    assert _target("model.layers.3.mlp.gate.weight", PACKED) == ("model.layers.3.mlp.in_proj.weight", 0)
    # a dense MLP's gate_proj / up_proj keep the one-part keys
    assert _target("model.layers.2.mlp.gate_proj.weight", PACKED) == ("model.layers.2.mlp.gate_up_proj.weight", 0)
    assert _target("model.layers.2.mlp.up_proj.weight", PACKED) == ("model.layers.2.mlp.gate_up_proj.weight", 1)
    # the shared expert's down_proj and the experts are no stacked projection's
    assert _target("model.layers.3.mlp.shared_expert.down_proj.weight", PACKED) == \
        ("model.layers.3.mlp.shared_expert.down_proj.weight", None)
    assert _target("model.layers.3.mlp.experts.5.gate_proj.weight", PACKED) == \
        ("model.layers.3.mlp.experts.w13_weight", (5, 0))


def test_qwen3_5_linear_attention_projections_go_to_one_in_proj_in_checkpoint_order():
    got = [_target(f"model.layers.0.linear_attn.{n}.weight", PACKED)
           for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]
    assert got == [("model.layers.0.linear_attn.in_proj.weight", i) for i in range(4)]
    assert GatedDeltaNet.packed_modules("qwen3_next", True) == {"in_proj_qkvz": ("in_proj", 0),
                                                                "in_proj_ba": ("in_proj", 1)}
    assert GatedDeltaNet.packed_modules("qwen3_next", False) == {}
    assert GatedDeltaNet.packed_modules("qwen3_5", False) == GatedDeltaNet.QWEN3_5_PACKED


def test_projections_stay_apart_under_fp8_or_4bit_weights(monkeypatch):
    """A stacked weight must be one format (the loader refuses a mix), and a checkpoint may
    quantize some of the parts only: the hybrid stacks only with plain weights."""
    from kernels import fp8_linear, w4a16_linear
    from services.worker.models import qwen3_next

    monkeypatch.setattr(fp8_linear, "MODE", "off")
    monkeypatch.setattr(w4a16_linear, "MODE", "off")
    monkeypatch.setattr(qwen3_next, "STACK_PROJECTIONS", True)
    assert qwen3_next.stacks_projections()
    monkeypatch.setattr(qwen3_next, "STACK_PROJECTIONS", False)
    assert not qwen3_next.stacks_projections()
    monkeypatch.setattr(qwen3_next, "STACK_PROJECTIONS", True)
    for module, mode in ((fp8_linear, "checkpoint"), (fp8_linear, "quantize"), (w4a16_linear, "checkpoint")):
        monkeypatch.setattr(module, "MODE", mode)
        assert not qwen3_next.stacks_projections(), (module.__name__, mode)
        monkeypatch.setattr(module, "MODE", "off")
