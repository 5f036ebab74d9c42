"""The blocks of Qwen3-Next's layers that Qwen3-MoE does not have (`qwen3_next.py`, which
builds the layers from them; Qwen3.5-MoE's the same): the gated full attention
(`GatedAttention`) and the MoE block with a shared expert (`SharedExpertMoeBlock`), and
`FUSED_GLUE`, the switch between their elementwise decode glue in fused kernels and in torch.

Source: Hugging Face's `modeling_qwen3_next.py` (transformers 5.24; parameter names follow its
checkpoints):
- gated attention: q_proj also yields an output gate (per head, q then gate), the output is
  attn * sigmoid(gate) before o_proj; partial rotary (the model's rotary table); zero-centred
  q/k RMSNorms, applied by the attention backend;
- the MoE block adds a shared expert (a SwiGLU MLP of shared_expert_intermediate_size) times
  sigmoid(shared_expert_gate(x)) to the routed experts' output.

With `FUSED_GLUE` (read at each forward, so at graph capture) the glue runs in one kernel
each (`kernels.hybrid_glue` through `services.worker.layers.glue`: the attention's output
gate; the shared expert's combine, which the MoE decode path folds into its down kernel:
`kernels.moe.SHARED_IN_DOWN`), and the model's residual adds go into the next norm
(`Qwen3NextDecoderLayer.forward_residual`). Stacked (`qwen3_next.STACK_PROJECTIONS`), a MoE
block's router, shared expert gate_up and shared_expert_gate are one Linear `in_proj`
(`MOE_STACKED`, docs/ARCHITECTURE.md §6.3).
"""

from __future__ import annotations

import dataclasses

import torch

from services.worker.layers.attention import AttentionBackend, AttentionSpec
from services.worker.layers.glue import sigmoid_gate_mul
from services.worker.layers.linear import Linear
from services.worker.layers.moe import SparseMoeBlock
from services.worker.layers.module import Module
from services.worker.layers.norm import RMSNorm, ZeroCenteredRMSNorm
from services.worker.models.llama import LlamaArgs, LlamaMLP
from services.worker.models.qwen3_moe import num_experts

# The decode glue in fused kernels (module doc); read at each forward. 14-16% faster at batch 1
# on the H200, its bf16 logits as close to fp32's as the torch glue's (docs/ARCHITECTURE.md §6.3).
FUSED_GLUE = True


class GatedAttention(Module):
    """Qwen3-Next's full attention of the kv_index-th attention layer: qkv_proj stacks q_proj
    [2 * heads * head_dim] (per head: q then its gate), k_proj and v_proj; zero-centred q/k
    norms for the backend; output attn * sigmoid(gate) through o_proj. x [T, H] -> [T, H]."""

    def __init__(self, a: LlamaArgs, kv_index: int):
        super().__init__()
        self.kv_index = kv_index
        self.heads, self.kv_heads, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = Linear(a.hidden_size, [2 * self.q_size, self.kv_size, self.kv_size], a.attention_bias)
        self.o_proj = Linear(self.q_size, a.hidden_size, a.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, a.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, a.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBackend,
                norm: RMSNorm | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. The fused layer path: norm, the layer's input norm, applied to
        x inside qkv_proj (its `prologue_weight`); residual [T, H], added to the
        o_proj output inside it. The q/gate split, the q/k norms and the partial rotary come
        after the projection, so the prologue leaves them as they are."""
        t = x.shape[0]
        qkv = self.qkv_proj(x) if norm is None else self.qkv_proj(x, norm_weight=norm.prologue_weight, eps=norm.eps)
        qg, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.view(t, self.heads, 2 * self.head_dim)
        q, gate = qg[..., :self.head_dim].contiguous(), qg[..., self.head_dim:]
        o = attn.forward(self.kv_index, q, k.view(t, self.kv_heads, self.head_dim),
                         v.view(t, self.kv_heads, self.head_dim), positions)
        if FUSED_GLUE:  # one launch for the gate's copy, sigmoid and product
            o = sigmoid_gate_mul(o, gate)
        else:
            o = o * torch.sigmoid(gate.reshape(t, self.q_size))
        return self.o_proj(o) if residual is None else self.o_proj(o, residual=residual)

    def spec(self, cos_sin: torch.Tensor) -> AttentionSpec:
        """This layer's attention for the backend (after loading: the norms' scales)."""
        return AttentionSpec(self.heads, self.kv_heads, self.head_dim, self.head_dim ** -0.5, cos_sin,
                             self.q_norm.scale, self.k_norm.scale, self.q_norm.eps)


class _SharedExpertDown(Module):
    """The shared expert of a stacked MoE block: its down projection only (its gate_up is
    part of the block's `in_proj`); `mlp.shared_expert.down_proj.weight` as in LlamaMLP."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool):
        super().__init__()
        self.down_proj = Linear(intermediate_size, hidden_size, bias)


# a stacked MoE block's checkpoint tensors -> (`mlp.in_proj`, shard), for packed_modules
MOE_STACKED: dict[str, tuple[str, int]] = {
    "mlp.gate": ("mlp.in_proj", 0), "mlp.shared_expert.gate_proj": ("mlp.in_proj", 1),
    "mlp.shared_expert.up_proj": ("mlp.in_proj", 2), "mlp.shared_expert_gate": ("mlp.in_proj", 3),
}


class SharedExpertMoeBlock(SparseMoeBlock):
    """`SparseMoeBlock` plus a shared expert: out = moe(x) + sigmoid(shared_expert_gate(x)) *
    shared_expert(x), the shared expert a SwiGLU MLP (`mlp.shared_expert.*`, gate
    `mlp.shared_expert_gate.weight` [1, H]). stacked (with a shared expert): the router `gate`
    [E, H], the shared expert's gate and up projections [I, H] each and shared_expert_gate
    [1, H] are one Linear `in_proj` [E + 2I + 1, H] (shards in that order, `MOE_STACKED`;
    kept in the model dtype, as the router is), its output split by views; the shared
    expert keeps its down_proj. forward(x [T, H]) -> [T, H]."""

    def __init__(self, a: LlamaArgs, hf_config, moe_intermediate_size: int, stacked: bool = False):
        super().__init__(num_experts(hf_config), int(hf_config.get("num_experts_per_tok", 10)), a.hidden_size,
                         moe_intermediate_size, bool(hf_config.get("norm_topk_prob", True)))
        shared = int(hf_config.get("shared_expert_intermediate_size") or 0)
        self.num_experts, self.shared_size = num_experts(hf_config), shared
        self.in_proj: Linear | None = None
        self.shared_expert: LlamaMLP | _SharedExpertDown | None = None
        self.shared_expert_gate: Linear | None = None
        if shared and stacked:
            del self.gate
            self.in_proj = Linear(a.hidden_size, [self.num_experts, shared, shared, 1], False, quantizable=False)
            self.shared_expert = _SharedExpertDown(a.hidden_size, shared, a.mlp_bias)
        elif shared:
            self.shared_expert = LlamaMLP(dataclasses.replace(a, intermediate_size=shared))
            self.shared_expert_gate = Linear(a.hidden_size, 1, False, quantizable=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, shared = self._project(x)
        return self._experts(x, logits, shared)

    def forward_fused(self, h: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """h + mlp(norm(h)) for the residual stream h [T, H] (the fused layer path,
        `services.worker.fusion`; as `SparseMoeBlock.forward_fused`), with no norm or add
        launch of its own: the first projection (`in_proj`, or the router `gate` when apart)
        normalises h in its prologue and stores the normalised rows (xn_out) that the
        experts, and apart the shared expert and its gate, read; the residual add runs in the
        MoE decode path's down kernel, with the shared expert's combine (`FUSED_GLUE`,
        `kernels.moe.moe_block`'s shared and residual). norm: the layer's
        `ZeroCenteredRMSNorm` (its `prologue_weight`, the scale, in the prologue)."""
        xn = torch.empty_like(h)
        logits, shared = self._project(h, norm.prologue_weight, norm.eps, xn)
        return self._experts(xn, logits, shared, h)

    def _project(self, x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                 xn_out: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The router's logits [T, E] and the shared expert's (gate [T, 1], output [T, H])
        (None without a shared expert) of x [T, H]; with norm_weight, of rms_norm(x) *
        norm_weight, the normalised x stored in xn_out by the first projection."""
        fused = {} if norm_weight is None else {"norm_weight": norm_weight, "eps": eps, "xn_out": xn_out}
        if self.in_proj is not None:  # one product, split by views
            assert self.shared_expert is not None
            e, i = self.num_experts, self.shared_size
            y = self.in_proj(x, **fused)
            shared = self.shared_expert.down_proj(y[:, e:e + 2 * i], silu_mul=True)
            return y[:, :e], (y[:, e + 2 * i:], shared)
        logits = self.gate(x, **fused)
        xn = x if xn_out is None else xn_out
        if self.shared_expert is None or self.shared_expert_gate is None:
            return logits, None
        return logits, (self.shared_expert_gate(xn), self.shared_expert(xn))

    def _experts(self, x: torch.Tensor, logits: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor] | None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts on x [T, H] plus the shared expert's sigmoid(gate) * output,
        plus residual (or None)."""
        if shared is None or FUSED_GLUE:  # the sigmoid, product and sums in one launch (the MoE decode path's down kernel)
            return self.experts.routed(x, logits, self.top_k, self.norm_topk_prob, shared, residual)
        gate, out = shared
        y = self.experts.routed(x, logits, self.top_k, self.norm_topk_prob) + torch.sigmoid(gate) * out
        return y if residual is None else residual + y
