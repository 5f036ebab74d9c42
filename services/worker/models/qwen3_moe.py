"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (GQA, RoPE, per-head q/k RMSNorm)
with mixture-of-experts MLPs: a softmax top-k router over `num_experts` SwiGLU experts of
width `moe_intermediate_size`, `num_experts_per_tok` of them per token, their weights
renormalised when `norm_topk_prob`. Layer i is a MoE layer when num_experts > 0, i is not in
`mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0; the others have a dense MLP of
`intermediate_size`. No shared expert.

Source of the architecture: Qwen team, "Qwen3 Technical Report" (2025, arXiv 2505.09388),
and Hugging Face's `modeling_qwen3_moe.py` / `Qwen3MoeConfig` (transformers 5.24; parameter
names follow its checkpoints: `mlp.gate.weight`, `mlp.experts.<e>.{gate,up,down}_proj.weight`).
The MoE layers are `services.worker.layers.moe`; on the fused layer path (CUDA decode steps,
`services.worker.fusion`) their norm runs in the router projection's prologue and the residual
add in the experts' down kernel (`SparseMoeBlock.forward_fused`).
"""

from __future__ import annotations

from torch import nn

from services.worker.layers.moe import SparseMoeBlock
from services.worker.models.llama import LlamaArgs, LlamaMLP
from services.worker.models.qwen3 import Qwen3ForCausalLM
from shared.model_spec import ModelSpec


# MoE layers on the fused layer path (`Qwen3MoeForCausalLM.fusable_projections`); False keeps
# Qwen3-MoE unfused, the path before 2026-12-07. Measured on an H100 (2026-12-07, Qwen3-30B-A3B,
# dummy bf16, 1K context, batch 1, two rounds in one process; scripts/gpu_moe_fused.sh ab,
# benchmarks/results/2026-12-07_h100_decode_ab_layers_qwen3-30b-a3b.json): TPOT 3.394 ms unfused,
# 3.350 fused (-1.3%, both rounds); the two-launch MoE path on top 3.675 (slower: GATE_UP stays
# "grouped"). Read when the runner chooses its FusionPlan.
FUSE_MOE_LAYERS = True


def num_experts(hf_config) -> int:
    """Routed experts per MoE layer: config.json `num_experts` (the published files) or
    `num_local_experts` (what transformers 5 writes for the same field); 0 when neither."""
    return int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)


def is_moe_layer(hf_config, layer_idx: int) -> bool:
    """Whether decoder layer `layer_idx` of a Qwen3-MoE config.json has experts (module
    docstring's rule; defaults as Qwen3MoeConfig: decoder_sparse_step 1, no mlp_only_layers)."""
    step = int(hf_config.get("decoder_sparse_step", 1) or 1)
    return (num_experts(hf_config) > 0
            and layer_idx not in (hf_config.get("mlp_only_layers") or [])
            and (layer_idx + 1) % step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """The whole Qwen3-MoE model; interface as `LlamaForCausalLM` (a `CausalLM`). Raises
    ValueError for an unsupported config (sliding window,
    an activation other than SiLU, num_experts_per_tok outside 1..num_experts)."""

    def mlp_for_layer(self, spec: ModelSpec, a: LlamaArgs, layer_idx: int) -> nn.Module | None:
        c = spec.text_config
        if not is_moe_layer(c, layer_idx):
            return None
        return SparseMoeBlock(num_experts(c), int(c.get("num_experts_per_tok", 8)), a.hidden_size,
                              spec.moe_intermediate_size, bool(c.get("norm_topk_prob", False)))

    def fusable_projections(self) -> list:
        """The fused layer path's projections (`services.worker.fusion`): layer 0's attention
        projections and the first MoE layer's router (the MoE block's fused path,
        `SparseMoeBlock.forward_fused`), with the first dense layer's MLP projections when
        `mlp_only_layers` / `decoder_sparse_step` leave some; dense weights as tensors, quantized
        ones as their weight objects (the fusion plan asks their kernels). [] with FUSE_MOE_LAYERS off."""
        layers = self.model.decoder_layers
        if not layers or not FUSE_MOE_LAYERS:
            return []
        a = layers[0].self_attn
        out = [p.weight if p.qweight is None else p.qweight for p in (a.qkv_proj, a.o_proj)]
        moe = next((layer.mlp for layer in layers if isinstance(layer.mlp, SparseMoeBlock)), None)
        dense = next((layer.mlp for layer in layers if isinstance(layer.mlp, LlamaMLP)), None)
        if moe is not None:
            out.append(moe.gate.weight)
        if dense is not None:
            out += [p.weight if p.qweight is None else p.qweight for p in (dense.gate_up_proj, dense.down_proj)]
        return out
