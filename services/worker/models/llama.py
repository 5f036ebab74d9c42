"""Llama (LlamaForCausalLM): GQA attention with RoPE, RMSNorm, SwiGLU MLP, optional tied
embeddings. Also serves checkpoints of the same shape (SmolLM2, Llama 2/3).

Source of the architecture: Touvron et al. 2023 and Hugging Face's `modeling_llama.py`
(parameter names follow its checkpoints; q/k/v and gate/up are stacked here, see
`packed_modules`).

Inputs are flattened over the step's sequences: input_ids and positions [num_tokens], plus
the step's `AttentionMetadata`.

Two layer paths, chosen once per forward (`LlamaModel.fused_layers`):
- unfused (CPU, prefill, batches over 16): each layer takes (x, residual) and returns
  (mlp output, residual); the residual adds run inside the RMSNorms (fused_add_rms_norm).
- fused (CUDA, bf16/fp16, every projection on our kernels: one token on `kernels.gemv`, on by
  default; 2..16 tokens on the skinny kernel, off by default, it measured slower): the
  layer carries the residual stream h alone, and the norms, the SiLU-and-mul and the
  residual adds run inside the projections' kernels (`kernels.linear`): 4 projection
  launches and the attention a layer. Same rounding op by op, so the outputs equal the
  unfused path's up to summation order. Inside a CUDA graph the path is fixed at capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from services.worker.layers.activation import SiluAndMul
from services.worker.layers.attention import Attention, AttentionMetadata
from services.worker.layers.embedding import LMHead, VocabEmbedding
from services.worker.layers.linear import Linear
from services.worker.layers.norm import RMSNorm
from services.worker.layers.rotary import RotaryEmbedding
from kernels import linear as linear_kernels
from kernels.rope_decode import rope_paged_decode
from kernels.rotary import rotary_and_store_kv


@dataclass(frozen=True)
class LlamaArgs:
    """The config.json fields a Llama model uses (Hugging Face LlamaConfig names)."""

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

    @classmethod
    def from_hf(cls, c: dict) -> "LlamaArgs":
        """Read a config.json dict. Rope settings come from `rope_parameters`
        (transformers >= 5) or from `rope_theta` / `rope_scaling` (older files).
        Raises ValueError for an activation other than SiLU."""
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported (silu only)")
        rope = dict(c.get("rope_parameters") or {})
        scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            rope_scaling=scaling, max_position_embeddings=c.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=bool(c.get("attention_bias", False)), mlp_bias=bool(c.get("mlp_bias", False)),
        )


class LlamaAttention(nn.Module):
    def __init__(self, a: LlamaArgs, rotary: RotaryEmbedding):
        super().__init__()
        self.q_size = a.num_attention_heads * a.head_dim
        self.kv_size = a.num_key_value_heads * a.head_dim
        self.heads, self.kv_heads, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.qkv_proj = Linear(a.hidden_size, [self.q_size, self.kv_size, self.kv_size], a.attention_bias)
        self.o_proj = Linear(self.q_size, a.hidden_size, a.attention_bias)
        self.rotary = [rotary]  # a list, so that the shared module is not registered per layer
        self.attn = Attention(a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                norm: RMSNorm | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. Fused path: norm, applied to x inside the qkv
        projection; residual [T, hidden], added to the o_proj output inside it."""
        t = x.shape[0]
        qkv = self.qkv_proj(x) if norm is None else self.qkv_proj(x, norm_weight=norm.weight, eps=norm.eps)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.rope_attend(positions, q.view(t, self.heads, self.head_dim),
                                k.view(t, self.kv_heads, self.head_dim),
                                v.view(t, self.kv_heads, self.head_dim), meta, self.qk_norm(), residual)

    def qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(q_norm weight, k_norm weight, eps) of a per-head RMSNorm before RoPE (Qwen3), or None."""
        return None

    def rope_attend(self, positions, q, k, v, meta: AttentionMetadata, qk_norm=None,
                    residual=None) -> torch.Tensor:
        """Rotate q [T, heads, head_dim] and k [T, kv_heads, head_dim] in place, store k and v
        in the cache (one kernel on the GPU), attend and project: -> [T, hidden]. A decode-only
        step on the GPU does the rotation and the cache write inside the attention kernel
        (`kernels.rope_decode`; q and k are then left unrotated).
        qk_norm: (q_norm weight, k_norm weight, eps) of a per-head RMSNorm applied first
        (Qwen3), or None. residual: [T, hidden] added to the projection, or None."""
        a = self.attn
        qn, kn, eps = qk_norm if qk_norm is not None else (None, None, 1e-6)
        if meta.max_q_len == 1:  # decode only: one fused kernel where the device has it (kernels.rope_decode)
            o = rope_paged_decode(q, k, v, positions, self.rotary[0].cos_sin, a.k_cache, a.v_cache,
                                  meta.slot_mapping, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                  a.scale, qn, kn, eps, meta.ref_plan, meta.max_seq_len).reshape(q.shape[0], -1)
        else:
            rotary_and_store_kv(q, k, v, positions, self.rotary[0].cos_sin, a.k_cache, a.v_cache,
                                meta.slot_mapping, qn, kn, eps)
            o = a.attend(q, meta)
        return self.o_proj(o) if residual is None else self.o_proj(o, residual=residual)


class LlamaMLP(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.gate_up_proj = Linear(a.hidden_size, [a.intermediate_size] * 2, a.mlp_bias)
        self.down_proj = Linear(a.intermediate_size, a.hidden_size, a.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if gu.shape[0] == 1:  # batch-1 decode: the SiLU-and-mul inside the down projection (kernels.gemv)
            return self.down_proj(gu, silu_mul=True)
        return self.down_proj(self.act(gu))

    def forward_fused(self, h: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """h + mlp(norm(h)) for the residual stream h [T, hidden], in two projections."""
        gu = self.gate_up_proj(h, norm_weight=norm.weight, eps=norm.eps)
        return self.down_proj(gu, silu_mul=True, residual=h)


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention  # subclasses of other architectures swap it (qwen3.py)

    def __init__(self, a: LlamaArgs, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = self.attention_cls(a, rotary)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = LlamaMLP(a)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def forward_fused(self, positions, h, meta):
        """The fused path (module docstring): residual stream h [T, hidden] -> the next h."""
        h = self.self_attn(positions, h, meta, norm=self.input_layernorm, residual=h)
        return self.mlp.forward_fused(h, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer
    # The fused layer path on the skinny kernel (2..16 rows) is off: on the H200 it measured
    # slower than the unfused sequence (Qwen3-0.6B b=1 linear stack in one CUDA graph,
    # benchmarks/kernel_sweep.py --only fused: 1,302 against 851 us). True turns it on.
    fuse_small_batches = False
    # One row on the gemv kernel (kernels.gemv: the norm in its prologue, the residual add in
    # its epilogue): 4 projection launches and the attention a layer, no norm kernels.
    # False keeps batch 1 on the unfused path (benchmarks/decode_latency.py --fused-layers off).
    fuse_one_row = True

    def __init__(self, a: LlamaArgs, max_positions: int):
        super().__init__()
        self.embed_tokens = VocabEmbedding(a.vocab_size, a.hidden_size)
        self.rotary = RotaryEmbedding(a.head_dim, a.rope_theta, max_positions, a.rope_scaling)
        self.layers = nn.ModuleList(self.layer_cls(a, self.rotary) for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def fused_layers(self, h: torch.Tensor) -> bool:
        """Whether a forward whose embeddings are h [T, hidden] takes the fused layer path:
        every projection runs on the gemv kernel (one row, `fuse_one_row`, gemv.ENABLED) or
        the skinny kernel (`fuse_small_batches`), i.e. `kernels.linear.skinny_applies`: CUDA,
        1..16 rows, bf16/fp16, weights up to SKINNY_MAX_WEIGHT. Depends on T, the device
        and the dtype only, so it is fixed inside a captured CUDA graph."""
        if not (h.is_cuda and len(self.layers)):
            return False
        one_row = h.shape[0] == 1 and self.fuse_one_row and linear_kernels.gemv.ENABLED
        if not (one_row or self.fuse_small_batches):
            return False
        layer = self.layers[0]  # every layer has the same shapes
        return all(linear_kernels.skinny_applies(h, p.weight) for p in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed_tokens(input_ids), None
        if self.fused_layers(x):
            for layer in self.layers:
                x = layer.forward_fused(positions, x, meta)
            return self.norm(x)
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """The whole model. Build it under the target device and default dtype; the loader
    fills its (uninitialised) parameters.

    hf_config: config.json as a dict. max_positions: rows of the rotary table (at least
    max_model_len).
    forward(input_ids [T] int64, positions [T] int64, meta) -> hidden [T, hidden_size].
    compute_logits(hidden [n, hidden_size]) -> [n, vocab_size] fp32.
    """

    # checkpoint module name -> (our stacked module name, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint tensors that are not parameters and are skipped on purpose
    ignored_tensors = ("rotary_emb.inv_freq",)
    model_cls = LlamaModel
    args_cls = LlamaArgs

    def __init__(self, hf_config: dict, max_positions: int | None = None):
        super().__init__()
        a = self.args = self.args_cls.from_hf(hf_config)
        self.model = self.model_cls(a, max(max_positions or 0, a.max_position_embeddings))
        self.lm_head = LMHead(a.vocab_size, a.hidden_size, self.model.embed_tokens if a.tie_word_embeddings else None)
        self.tied_lm_head = a.tie_word_embeddings

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        """The attention layers in order; the KV cache binds one cache pair to each."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def kv_shape(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) of the KV cache."""
        return self.args.num_hidden_layers, self.args.num_key_value_heads, self.args.head_dim
