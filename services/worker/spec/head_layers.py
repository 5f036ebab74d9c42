"""The layers of the EAGLE head and the DFlash drafter (docs/ARCHITECTURE.md §5.5): a
Llama/Qwen3-style decoder layer whose attention splits its projection into q and k/v, so
that a drafter can write K/V for rows it never queries (EAGLE's context pairs, DFlash's
context features) with the k/v projection alone.

Like the target's model files (services/worker/models/), these modules describe the network
and never pick a kernel or touch a cache: attention goes through the step's backend
(`services.worker.layers.attention.AttentionBackend`), the KV-only writes through
`services.worker.spec.draft_attention.store_kv_only`. Parameter names follow the
checkpoints (q_proj; k_proj and v_proj stacked in kv_proj, gate_proj and up_proj in
gate_up_proj: `DRAFT_PACKED_MODULES` for the loader).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.layers.attention import AttentionBackend, AttentionSpec
from services.worker.layers.linear import Linear
from services.worker.layers.norm import RMSNorm
from services.worker.layers.module import Module

# checkpoint module name -> (our stacked module, shard index), for services.worker.loader
DRAFT_PACKED_MODULES: dict[str, tuple[str, int]] = {
    "k_proj": ("kv_proj", 0), "v_proj": ("kv_proj", 1),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


@dataclass(frozen=True)
class HeadArgs:
    """A drafter's shapes and settings (Hugging Face config names).

    hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim: its
    decoder layers. num_hidden_layers: their count. vocab_size: its output vocabulary (the
    draft vocabulary of an EAGLE-3 head). rms_norm_eps, rope_theta, rope_scaling: as the
    target's. attention_bias, mlp_bias: biases of the projections. qk_norm: a per-head
    RMSNorm of q and k (Qwen3's; DFlash drafters have it). attn_in: the input width of the
    q and k/v projections (2 * hidden_size for EAGLE-3: [embedding, feature]).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    attn_in: int = 0

    @property
    def attn_input(self) -> int:
        """The q and k/v projections' input width (attn_in, else hidden_size)."""
        return self.attn_in or self.hidden_size


class DraftAttention(Module):
    """GQA self-attention of drafter layer `layer_idx` with q and k/v projected apart.

    Parameters: q_proj [heads * head_dim, attn_input], kv_proj [2 * kv_heads * head_dim,
    attn_input] (k_proj then v_proj), o_proj [hidden, heads * head_dim], with a.qk_norm
    q_norm / k_norm [head_dim] (the backend applies them).
    """

    def __init__(self, a: HeadArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.kv_size = a.num_key_value_heads * a.head_dim
        self.q_proj = Linear(a.attn_input, a.num_attention_heads * a.head_dim, a.attention_bias)
        self.kv_proj = Linear(a.attn_input, [self.kv_size, self.kv_size], a.attention_bias)
        self.o_proj = Linear(a.num_attention_heads * a.head_dim, a.hidden_size, a.attention_bias)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of rows x [T, attn_input]: ([T, kv_heads, head_dim] each, views
        of one projection output, not yet normed or rotated)."""
        t = x.shape[0]
        kv = self.kv_proj(x)
        k, v = kv.split([self.kv_size, self.kv_size], dim=-1)
        return k.view(t, self.kv_heads, self.head_dim), v.view(t, self.kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """x [T, attn_input] -> [T, hidden]: q, k, v of x through the step's backend (which
        norms, rotates and stores k/v and attends), then o_proj."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.heads, self.head_dim)
        k, v = self.kv(x)
        return self.o_proj(attn.forward(self.layer_idx, q, k, v, positions))

    def spec(self, cos_sin: torch.Tensor) -> AttentionSpec:
        """This layer's attention for the backend; cos_sin: the drafter's rotary table."""
        qn, kn = self.q_norm, self.k_norm
        return AttentionSpec(self.heads, self.kv_heads, self.head_dim, self.head_dim ** -0.5, cos_sin,
                             None if qn is None else qn.weight, None if kn is None else kn.weight,
                             1e-6 if qn is None else qn.eps)


class DraftMLP(Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up stacked in gate_up_proj."""

    def __init__(self, a: HeadArgs):
        super().__init__()
        self.gate_up_proj = Linear(a.hidden_size, [a.intermediate_size] * 2, a.mlp_bias)
        self.down_proj = Linear(a.intermediate_size, a.hidden_size, a.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.down_proj(self.gate_up_proj(x), silu_mul=True)
