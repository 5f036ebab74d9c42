"""Llama (LlamaForCausalLM): GQA attention with RoPE, RMSNorm, SwiGLU MLP, optional tied
embeddings. Also serves checkpoints of the same shape (SmolLM2, Llama 2/3).

Source of the architecture: Touvron et al. 2023 and Hugging Face's `modeling_llama.py`
(parameter names follow its checkpoints; q/k/v and gate/up are stacked here, see
`packed_modules`).

Qwen3 dense is this architecture with `qk_norm` on: an RMSNorm over each head of q and of k
(weights `q_norm` / `k_norm` [head_dim]) before the rotary embedding (`qwen3.py`).

Inputs are flattened over the step's sequences: input_ids and positions [num_tokens], plus
the step's attention backend (`services.worker.layers.attention`), which owns the rotary
embedding, the q/k norm, the KV cache and the kernel; the model describes each layer's
attention to it (`attention_specs`).

Two layer paths, chosen by the runner per step (`services.worker.fusion.FusionPlan`):
- unfused: each layer takes (x, residual) and returns (mlp output, residual); the residual
  adds run inside the RMSNorms (fused_add_rms_norm).
- fused: the layer carries the residual stream h alone, and the norms, the SiLU-and-mul and
  the residual adds run inside the projections (`Linear`'s keyword arguments).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from services.worker.kv_cache import PagedKVSpec
from services.worker.layers.attention import AttentionBackend, AttentionSpec
from services.worker.layers.embedding import LMHead, VocabEmbedding
from services.worker.layers.linear import Linear
from services.worker.layers.norm import RMSNorm
from services.worker.layers.rotary import RotaryEmbedding
from shared.model_spec import ModelSpec
from services.worker.layers.module import Module


@dataclass(frozen=True)
class LlamaArgs:
    """What a Llama model is built from: the shapes of its `ModelSpec` and the config.json
    fields only this family reads (rope, eps, biases; Hugging Face LlamaConfig names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)

    @classmethod
    def from_spec(cls, spec: ModelSpec, qk_norm: bool = False) -> LlamaArgs:
        """The model's shapes from `spec` (shared.model_spec: layers, heads, head dim, vocab,
        positions, tied embeddings), the rest from its config.json: rope settings from
        `rope_parameters` (transformers >= 5) or `rope_theta` / `rope_scaling` (older files),
        rms_norm_eps, attention_bias, mlp_bias. qk_norm: the architecture's q/k norm flag
        (not a config.json field). Raises ValueError for an activation other than SiLU."""
        c = spec.text_config
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported (silu only)")
        rope = dict(c.get("rope_parameters") or {})
        scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        return cls(
            vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim, rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=spec.max_position_embeddings,
            tie_word_embeddings=spec.tie_word_embeddings,
            attention_bias=bool(c.get("attention_bias", False)), mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=qk_norm,
        )


class LlamaAttention(Module):
    """GQA self-attention of layer `layer_idx`: the qkv projection, the step's attention
    backend, the o projection. With a.qk_norm, the q_norm / k_norm weights the backend
    applies (parameters `self_attn.q_norm.weight`, `self_attn.k_norm.weight`)."""

    def __init__(self, a: LlamaArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.q_size = a.num_attention_heads * a.head_dim
        self.kv_size = a.num_key_value_heads * a.head_dim
        self.heads, self.kv_heads, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.qkv_proj = Linear(a.hidden_size, [self.q_size, self.kv_size, self.kv_size], a.attention_bias)
        self.o_proj = Linear(self.q_size, a.hidden_size, a.attention_bias)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps) if a.qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBackend,
                norm: RMSNorm | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. Fused path: norm, applied to x inside the qkv
        projection; residual [T, hidden], added to the o_proj output inside it."""
        qkv = self.qkv_proj(x) if norm is None else self.qkv_proj(x, norm_weight=norm.prologue_weight, eps=norm.eps)
        o = attn.forward_qkv(self.layer_idx, qkv, positions)  # split into q, k, v views unless taken whole
        return self.o_proj(o) if residual is None else self.o_proj(o, residual=residual)

    def spec(self, cos_sin: torch.Tensor) -> AttentionSpec:
        """This layer's attention for the backend; cos_sin: the model's rotary table."""
        qn, kn = self.q_norm, self.k_norm
        return AttentionSpec(self.heads, self.kv_heads, self.head_dim, self.head_dim ** -0.5, cos_sin,
                             None if qn is None else qn.weight, None if kn is None else kn.weight,
                             1e-6 if qn is None else qn.eps)


class LlamaMLP(Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.gate_up_proj = Linear(a.hidden_size, [a.intermediate_size] * 2, a.mlp_bias)
        self.down_proj = Linear(a.intermediate_size, a.hidden_size, a.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """mlp(x) for x [T, hidden] -> [T, hidden]: down(silu(gate) * up). Where the SiLU runs
        (inside the down projection's kernel or apart) is `kernels.linear.linear`'s choice."""
        return self.down_proj(self.gate_up_proj(x), silu_mul=True)

    def forward_fused(self, h: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """h + mlp(norm(h)) for the residual stream h [T, hidden], in two projections (norm's
        `prologue_weight` in gate_up's prologue: any RMSNorm, the zero-centred one too)."""
        gu = self.gate_up_proj(h, norm_weight=norm.prologue_weight, eps=norm.eps)
        return self.down_proj(gu, silu_mul=True, residual=h)


class LlamaDecoderLayer(Module):
    """One decoder layer: attention, then the MLP (`mlp`: a LlamaMLP by default; a family
    may give another module with forward(x [T, hidden]) -> [T, hidden], e.g. a MoE block,
    which then runs on the unfused path only)."""

    def __init__(self, a: LlamaArgs, layer_idx: int, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = LlamaAttention(a, layer_idx)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(a)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """The unfused path (module docstring): (x, residual) [T, hidden] each -> the next pair."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def forward_fused(self, positions: torch.Tensor, h: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """The fused path (module docstring): residual stream h [T, hidden] -> the next h."""
        h = self.self_attn(positions, h, attn, norm=self.input_layernorm, residual=h)
        # a LlamaMLP, or a family's MLP with forward_fused (the MoE block); the others have an empty
        # fusable_projections, so their steps never come here
        return cast(LlamaMLP, self.mlp).forward_fused(h, self.post_attention_layernorm)


class LlamaModel(Module):
    """The decoder stack. mlp_for_layer(i): layer i's MLP module, None for a LlamaMLP."""

    def __init__(self, a: LlamaArgs, max_positions: int,
                 mlp_for_layer: Callable[[int], nn.Module | None] | None = None):
        super().__init__()
        self.embed_tokens = VocabEmbedding(a.vocab_size, a.hidden_size)
        self.rotary = RotaryEmbedding(a.head_dim, a.rope_theta, max_positions, a.rope_scaling)
        # a plain list to iterate (typed, and cheaper per step than the ModuleList's iterator)
        self.decoder_layers = [LlamaDecoderLayer(a, i, mlp_for_layer(i) if mlp_for_layer else None)
                               for i in range(a.num_hidden_layers)]
        self.layers = nn.ModuleList(self.decoder_layers)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                fused: bool = False) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        if fused:
            for layer in self.decoder_layers:
                x = layer.forward_fused(positions, x, attn)
            return self.norm(x)
        for layer in self.decoder_layers:
            x, residual = layer(positions, x, residual, attn)
        x, _ = self.norm(x, residual)
        return x

    def forward_with_aux(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                         fused: bool, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, plus the residual stream after each decoder layer in `layers` (before
        the final norm), concatenated in that order: (hidden [T, hidden], aux [T, len(layers)
        * hidden]). The unfused path's stream after a layer is its (x, residual) sum, the add
        the next layer's fused_add_rms_norm makes (same rounding: one add in the model dtype).
        No host sync and no data-dependent shape: it captures in a CUDA graph (aux is then a
        tensor of the graph's pool, rewritten by each replay)."""
        want = set(layers)
        taps: dict[int, torch.Tensor] = {}
        x, residual = self.embed_tokens(input_ids), None
        if fused:
            for i, layer in enumerate(self.decoder_layers):
                x = layer.forward_fused(positions, x, attn)
                if i in want:
                    taps[i] = x
            out = self.norm(x)
        else:
            for i, layer in enumerate(self.decoder_layers):
                x, residual = layer(positions, x, residual, attn)
                if i in want:
                    taps[i] = x + residual
            out, _ = self.norm(x, residual)
        return out, torch.cat([taps[i] for i in layers], dim=-1)


class LlamaForCausalLM(Module):
    """The whole model (a `services.worker.models.base.CausalLM`). Build it under the target
    device and default dtype; the loader fills its (uninitialised) parameters.

    spec: the model's facts (`shared.model_spec.ModelSpec`). max_positions: rows of the
    rotary table (at least max_model_len).
    forward(input_ids [T] int64, positions [T] int64, attn, fused) -> hidden [T, hidden_size].
    compute_logits(hidden [n, hidden_size]) -> [n, vocab_size] fp32.
    Raises ValueError from `LlamaArgs.from_spec`.
    """

    # checkpoint module name -> (our stacked module name, shard index)
    packed_modules: dict[str, tuple[str, int]] = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint tensors that are not parameters and are skipped on purpose
    ignored_tensors: tuple[str, ...] = ("rotary_emb.inv_freq",)
    qk_norm = False  # the architecture's per-head q/k RMSNorm (Qwen3ForCausalLM sets it)

    def __init__(self, spec: ModelSpec, max_positions: int | None = None):
        super().__init__()
        a = self.args = LlamaArgs.from_spec(spec, qk_norm=self.qk_norm)
        self.model = LlamaModel(a, max(max_positions or 0, a.max_position_embeddings),
                                lambda i: self.mlp_for_layer(spec, a, i))
        self.lm_head = LMHead(a.vocab_size, a.hidden_size, self.model.embed_tokens if a.tie_word_embeddings else None)
        self.tied_lm_head = a.tie_word_embeddings

    def mlp_for_layer(self, spec: ModelSpec, a: LlamaArgs, layer_idx: int) -> nn.Module | None:
        """Layer `layer_idx`'s MLP module; None = the dense LlamaMLP. A family with other
        MLPs (Qwen3-MoE's expert layers) overrides it; built under the target device and
        dtype like the rest of the model."""
        return None

    # speculative decoding's target layers (CausalLM.aux_hidden_layers): none by default
    _aux_layers: tuple[int, ...] = ()
    aux_hidden: torch.Tensor | None = None

    @property
    def aux_hidden_layers(self) -> tuple[int, ...]:
        """The decoder layers whose outputs each forward stores in `aux_hidden` [T, len *
        hidden] (`services.worker.models.base.CausalLM`); () = none, and a forward then costs
        what it did without the seam (one truth test). Setting it validates the indexes
        (ValueError for one outside 0..num_hidden_layers-1) and clears `aux_hidden`."""
        return self._aux_layers

    @aux_hidden_layers.setter
    def aux_hidden_layers(self, layers: tuple[int, ...] | list[int]) -> None:
        layers = tuple(int(i) for i in layers)
        n = self.args.num_hidden_layers
        bad = [i for i in layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"aux_hidden_layers {bad} outside the model's {n} layers")
        self._aux_layers = layers
        self.aux_hidden = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                fused: bool = False) -> torch.Tensor:
        if not self._aux_layers:
            return self.model(input_ids, positions, attn, fused)
        hidden, self.aux_hidden = self.model.forward_with_aux(input_ids, positions, attn, fused, self._aux_layers)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_specs(self) -> list[AttentionSpec]:
        """Each layer's attention, in layer order (read after loading: the specs hold the
        q/k norm weights)."""
        table = self.model.rotary.cos_sin
        return [layer.self_attn.spec(table) for layer in self.model.decoder_layers]

    def kv_specs(self) -> list[PagedKVSpec]:
        """What each layer caches: paged K/V of (num_kv_heads, head_dim)."""
        return [PagedKVSpec(self.args.num_key_value_heads, self.args.head_dim)] * self.args.num_hidden_layers

    def state_specs(self) -> list:
        """[]: no recurrent layers (services.worker.state_cache)."""
        return []

    def fusable_projections(self) -> list:
        """The projection weights of one decoder layer (all have the same shapes), for the
        runner's `FusionPlan`: the fused path needs the kernels to take each of them. A
        quantized projection gives its quantized weight (`Linear.qweight`: its kernel says
        whether it fuses), a dense one its weight tensor."""
        layers = self.model.decoder_layers
        if not layers:
            return []
        a, m = layers[0].self_attn, layers[0].mlp
        if not all(isinstance(layer.mlp, LlamaMLP) for layer in layers) or not isinstance(m, LlamaMLP):
            return []  # another family's MLP (mlp_for_layer) has no fused path
        return [p.weight if p.qweight is None else p.qweight for p in (a.qkv_proj, a.o_proj, m.gate_up_proj,
                                                                        m.down_proj)]
