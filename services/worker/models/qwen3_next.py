"""Qwen3-Next (Qwen3NextForCausalLM): a hybrid of gated-DeltaNet linear-attention layers and
gated full-attention layers (`layer_types`: e.g. three linear then one full), each followed
by a MoE MLP with a shared expert (or a dense MLP per `decoder_sparse_step` /
`mlp_only_layers`, as Qwen3-MoE).

Source of the architecture: Qwen team, "Qwen3-Next" (2025 release), and Hugging Face's
`modeling_qwen3_next.py` / `Qwen3NextConfig` (transformers 5.24); parameter names follow
its checkpoints. What differs from Qwen3-MoE:
- full attention: q_proj also yields an output gate (per head, q then gate), the output is
  attn * sigmoid(gate) before o_proj; partial rotary (the first head_dim *
  partial_rotary_factor dims of each head); zero-centred q/k RMSNorms
  (`qwen3_next_blocks.GatedAttention`);
- linear attention: `services.worker.layers.gated_deltanet.GatedDeltaNet`, its per-request
  state in the runner's state cache (docs/ARCHITECTURE.md §4.7);
- every RMSNorm is zero-centred (scale 1 + weight: `ZeroCenteredRMSNorm`);
- the MoE block adds a shared expert (a SwiGLU MLP of shared_expert_intermediate_size)
  times sigmoid(shared_expert_gate(x)) (`qwen3_next_blocks.SharedExpertMoeBlock`).
The checkpoint's multi-token-prediction head (`mtp.*`) is not loaded (ignored_prefixes).

Two layer paths, chosen by the runner per step (`services.worker.fusion.FusionPlan`, as for
Llama / Qwen3-MoE): unfused (`forward`, or `forward_residual` with `FUSED_GLUE`, below: the
norms and residual adds as their own ops) and, with `FUSE_LAYERS`, fused
(`Qwen3NextDecoderLayer.forward_fused`: the zero-centred norms inside the first projections'
prologues, their `prologue_weight` (the `scale`) as the norm weight, the residual adds inside
the output projections and the MoE down kernel; two launches fewer a layer at batch 1).

Launch count at batch 1 (docs/ARCHITECTURE.md §6.3): with `STACK_PROJECTIONS` (read when the
model is built) the projections that read the same input are one Linear, filled by the
loader from the checkpoint's separate tensors (`packed_modules`) and split by views: a
linear layer's in_proj_qkvz + in_proj_ba (Qwen3.5: in_proj_qkv, z, b, a) as `linear_attn.
in_proj`, a MoE block's router + shared expert gate_up + shared_expert_gate as `mlp.in_proj`.
With `FUSED_GLUE` (`qwen3_next_blocks.FUSED_GLUE`, beside the blocks that read it; read at
each forward, so at graph capture) the elementwise glue runs in
one kernel each (`kernels.hybrid_glue`: the attention's output gate, the shared expert's
combine, which the MoE decode path folds into its down kernel: `kernels.moe.SHARED_IN_DOWN`)
and each residual add goes into the next norm (`fused_add_rms_norm`). On the fused layer path
(`FUSE_LAYERS`) a layer has no norm or add launch at all: a Qwen3.5 gated-DeltaNet layer is
10 launches instead of 12, a gated-attention layer 11 instead of 13 (docs/ARCHITECTURE.md §6.3).
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.kv_cache import PagedKVSpec
from services.worker.layers.attention import AttentionBackend, AttentionSpec
from services.worker.layers.embedding import LMHead, VocabEmbedding
from services.worker.layers.gated_deltanet import GatedDeltaNet
from services.worker.layers.linear import Linear, weights_unquantized
from services.worker.layers.norm import ZeroCenteredRMSNorm
from services.worker.layers.rotary import RotaryEmbedding
from services.worker.models import qwen3_next_blocks
from services.worker.models.llama import LlamaArgs, LlamaMLP
from services.worker.models.qwen3_moe import is_moe_layer
from services.worker.models.qwen3_next_blocks import MOE_STACKED, GatedAttention, SharedExpertMoeBlock
from services.worker.state_cache import StateSpec
from shared.model_spec import FULL_ATTENTION, ModelSpec
from services.worker.layers.module import Module

# One projection (one launch at batch 1) where several read the same input (module doc).
# Changes the parameter layout, so it is read when the model is built; False: the
# checkpoint's projections as they are (the A/B baseline). Under FP8 / 4-bit weights the
# model keeps them apart (`stacks_projections`): a stacked weight must be one format.
STACK_PROJECTIONS = True  # H200: stacked + glue 2.97 ms a token, apart 3.12 (docs/ARCHITECTURE.md §6.3)
# The fused layer path (`Qwen3NextDecoderLayer.forward_fused`: each layer's norms inside its
# first projections' prologues, its residual adds inside the output projection and the MoE
# down kernel; no norm or add launch of its own) where the runner's FusionPlan takes it (CUDA
# decode steps whose projections are on our kernels, as Qwen3-MoE's `FUSE_MOE_LAYERS`).
# False: `fusable_projections` is [] and every step runs the unfused path below. Read when the
# runner chooses its FusionPlan (benchmarks/decode_latency.py --ab hybrid_unfused hybrid_fused).
FUSE_LAYERS = True


def stacks_projections() -> bool:
    """Whether a model built now stacks its projections: `STACK_PROJECTIONS`, and neither
    FP8 nor 4-bit weights in use (`kernels.fp8_linear.MODE`, `kernels.w4a16_linear.MODE`,
    set by the runner before it builds the model: a checkpoint may quantize some of the
    stacked parts and not others, and the router stays in the model dtype)."""
    return STACK_PROJECTIONS and weights_unquantized()


def partial_rotary_factor(hf_config) -> float:
    """The rotated share of each head: config.json `partial_rotary_factor` (published
    files) or `rope_parameters.partial_rotary_factor` (transformers 5); 1.0 when absent."""
    rope = hf_config.get("rope_parameters") or {}
    return float(hf_config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)


class Qwen3NextDecoderLayer(Module):
    """One layer: zero-centred norm, token mixer (`self_attn` or `linear_attn`), residual,
    zero-centred norm, MLP, residual. x [T, H] -> [T, H]."""

    def __init__(self, a: LlamaArgs, spec: ModelSpec, layer_idx: int, kv_index: int, state_index: int,
                 gdn_layout: str = "qwen3_next", stacked: bool = False):
        super().__init__()
        c = spec.text_config
        self.is_attention = spec.layer_types[layer_idx] == FULL_ATTENTION
        self.state_index = state_index  # this layer's place in the state cache (linear layers)
        self.input_layernorm = ZeroCenteredRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = GatedAttention(a, kv_index) if self.is_attention else None
        self.linear_attn = None if self.is_attention else GatedDeltaNet.from_hf_config(c, gdn_layout, stacked)
        self.mlp: SharedExpertMoeBlock | LlamaMLP = (SharedExpertMoeBlock(a, c, spec.moe_intermediate_size, stacked)
                                                     if is_moe_layer(c, layer_idx) else LlamaMLP(a))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.self_attn is not None:
            h = self.self_attn(positions, h, attn)
        else:
            assert self.linear_attn is not None and attn.state is not None, "a linear layer needs the step's state"
            h = self.linear_attn.forward_step(h, attn.state, self.state_index)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_residual(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                         attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the residual adds inside the norms (`qwen3_next_blocks.FUSED_GLUE`):
        x is the layer before's MLP output and residual its residual stream (None for the
        first layer: x is the embedding); returns (this MLP's output, the residual stream
        before it).
        The sum is x + residual in the model dtype either way (`fused_add_rms_norm_ref`)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        if self.self_attn is not None:
            h = self.self_attn(positions, h, attn)
        else:
            assert self.linear_attn is not None and attn.state is not None, "a linear layer needs the step's state"
            h = self.linear_attn.forward_step(h, attn.state, self.state_index)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def forward_fused(self, positions: torch.Tensor, h: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """The fused layer path (`FUSE_LAYERS`, services/worker/fusion.py): the residual
        stream h [T, H] -> the next, with no norm or residual-add launch of its own. The
        token mixer's input projection normalises h in its prologue (input_layernorm's
        `prologue_weight`, its scale) and its output projection adds h; then the MLP's
        forward_fused: a MoE block's `SharedExpertMoeBlock.forward_fused` (the norm in its
        first projection, the add in the experts' down kernel), a dense MLP's
        `LlamaMLP.forward_fused` (gate_up with the norm, down with the add).
        The sums round as `forward_residual`'s (once, in the model dtype)."""
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        if self.self_attn is not None:
            h = self.self_attn(positions, h, attn, norm=n1, residual=h)
        else:
            assert self.linear_attn is not None and attn.state is not None, "a linear layer needs the step's state"
            h = self.linear_attn.forward_step(h, attn.state, self.state_index, norm_weight=n1.prologue_weight,
                                              eps=n1.eps, residual=h)
        return self.mlp.forward_fused(h, n2)


class Qwen3NextModel(Module):
    """The decoder stack (checkpoint prefix `model.`): embedding, partial rotary table,
    layers, final zero-centred norm. forward(input_ids [T], positions [T], attn) -> [T, H]."""

    def __init__(self, a: LlamaArgs, spec: ModelSpec, max_positions: int, gdn_layout: str = "qwen3_next",
                 stacked: bool = False):
        super().__init__()
        rot = int(a.head_dim * partial_rotary_factor(spec.text_config))
        self.embed_tokens = VocabEmbedding(a.vocab_size, a.hidden_size)
        self.rotary = RotaryEmbedding(rot, a.rope_theta, max_positions, a.rope_scaling)
        layers, kv, st = [], 0, 0
        for i, kind in enumerate(spec.layer_types):
            layers.append(Qwen3NextDecoderLayer(a, spec, i, kv, st, gdn_layout, stacked))
            kv, st = (kv + 1, st) if kind == FULL_ATTENTION else (kv, st + 1)
        self.decoder_layers = layers  # a plain list to iterate (as LlamaModel)
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCenteredRMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                fused: bool = False) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if fused:  # the residual stream alone; norms and adds inside the projections
            for layer in self.decoder_layers:
                x = layer.forward_fused(positions, x, attn)
            return self.norm(x)
        if qwen3_next_blocks.FUSED_GLUE:  # the residual adds inside the norms
            residual: torch.Tensor | None = None
            for layer in self.decoder_layers:
                x, residual = layer.forward_residual(positions, x, residual, attn)
            return self.norm(x) if residual is None else self.norm(x, residual)[0]
        for layer in self.decoder_layers:
            x = layer(positions, x, attn)
        return self.norm(x)


class Qwen3NextForCausalLM(Module):
    """The whole Qwen3-Next model (a `services.worker.models.base.CausalLM`). Build it under
    the target device and default dtype; the loader fills its parameters.

    spec: the model's facts (`ModelSpec`, with `layer_types`). forward(input_ids [T] int64,
    positions [T] int64, attn, fused) -> hidden [T, hidden]; the backend's `state` holds the
    step's state slots. compute_logits(hidden [n, hidden]) -> [n, vocab] fp32.
    Raises ValueError for a config without layer_types / full_attention_interval or without
    the gated-DeltaNet fields, and from `LlamaArgs.from_spec`.
    stacked: whether this model stacks its projections (`stacks_projections` when built);
    packed_modules then maps the checkpoint's separate tensors into the stacked ones.
    """

    packed_modules: dict[str, tuple[str, int]] = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    ignored_tensors: tuple[str, ...] = ("rotary_emb.inv_freq",)
    ignored_prefixes: tuple[str, ...] = ("mtp.",)  # the MTP head, not used for decoding here
    gdn_layout = "qwen3_next"  # the linear layers' projection layout (layers/gated_deltanet.py)

    def __init__(self, spec: ModelSpec, max_positions: int | None = None):
        super().__init__()
        if not spec.layer_types:
            raise ValueError("Qwen3-Next needs layer_types or full_attention_interval in config.json")
        a = self.args = LlamaArgs.from_spec(spec, qk_norm=True)
        c = spec.text_config
        self.stacked = stacks_projections()
        packed = {**type(self).packed_modules, **GatedDeltaNet.packed_modules(self.gdn_layout, self.stacked)}
        if self.stacked and int(c.get("shared_expert_intermediate_size") or 0):
            packed.update(MOE_STACKED)
        self.packed_modules = packed  # this instance's, for the loader
        self.model = Qwen3NextModel(a, spec, max(max_positions or 0, a.max_position_embeddings), self.gdn_layout,
                                    self.stacked)
        self.lm_head = LMHead(a.vocab_size, a.hidden_size, self.model.embed_tokens if a.tie_word_embeddings else None)
        self.tied_lm_head = a.tie_word_embeddings

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                fused: bool = False) -> torch.Tensor:
        return self.model(input_ids, positions, attn, fused)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_specs(self) -> list[AttentionSpec]:
        """The full-attention layers' specs, in order (after loading)."""
        table = self.model.rotary.cos_sin
        return [layer.self_attn.spec(table) for layer in self.model.decoder_layers if layer.self_attn is not None]

    def kv_specs(self) -> list[PagedKVSpec]:
        """Paged K/V of the full-attention layers only."""
        a = self.args
        return [PagedKVSpec(a.num_key_value_heads, a.head_dim) for layer in self.model.decoder_layers
                if layer.is_attention]

    def state_specs(self) -> list[StateSpec]:
        """Each gated-DeltaNet layer's per-request state (conv window, recurrent state)."""
        out = []
        for layer in self.model.decoder_layers:
            if layer.linear_attn is not None:
                shapes = layer.linear_attn.state_shapes()
                out.append(StateSpec(tuple(s.shape for s in shapes), tuple(s.dtype for s in shapes)))
        return out

    def fusable_projections(self) -> list:
        """The fused layer path's projections (`services.worker.fusion.FusionPlan`), one of
        each kind of layer (layers of a kind have the same shapes): the first attention
        layer's qkv and o, the first linear layer's input projection(s) and out_proj, the
        first MoE block's `in_proj` (apart: the router, which normalises for the rest) and
        the first dense MLP's gate_up and down; dense weights as tensors, quantized ones as
        their weight objects (the plan asks their kernels). [] with FUSE_LAYERS off."""
        if not FUSE_LAYERS:
            return []
        layers = self.model.decoder_layers
        attn = next((layer.self_attn for layer in layers if layer.self_attn is not None), None)
        gdn = next((layer.linear_attn for layer in layers if layer.linear_attn is not None), None)
        moe = next((layer.mlp for layer in layers if isinstance(layer.mlp, SharedExpertMoeBlock)), None)
        dense = next((layer.mlp for layer in layers if isinstance(layer.mlp, LlamaMLP)), None)
        projections: list[Linear | None] = []
        if attn is not None:
            projections += [attn.qkv_proj, attn.o_proj]
        if gdn is not None:
            projections += [gdn.in_proj, gdn.in_proj_qkvz, gdn.out_proj]
        if moe is not None:
            projections.append(moe.in_proj if moe.in_proj is not None else moe.gate)
        if dense is not None:
            projections += [dense.gate_up_proj, dense.down_proj]
        return [p.weight if p.qweight is None else p.qweight for p in projections if p is not None]


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """The text model of Qwen3.5-MoE (Qwen3_5MoeForCausalLM; transformers 5.24's
    `modeling_qwen3_5_moe.py`): Qwen3-Next's hybrid with every layer's MLP a MoE block with a
    shared expert, and gated-DeltaNet layers in Qwen3.5's projection layout (in_proj_qkv,
    in_proj_z, in_proj_b, in_proj_a). Its multimodal rotary reduces to the partial rotary
    for text positions (all three position grids equal). The vision tower and MTP head of a
    checkpoint are skipped. Interface as `Qwen3NextForCausalLM`."""

    ignored_prefixes = ("mtp.", "model.visual.")
    gdn_layout = "qwen3_5"


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """The published Qwen3.5-MoE checkpoints (Qwen3_5MoeForConditionalGeneration: the text
    model under `model.language_model.`, a vision tower under `model.visual.`, config.json
    with a nested `text_config`), served as their text model: the language model's tensors
    load as `Qwen3_5MoeForCausalLM`'s, the vision tower and the MTP head are skipped (images
    come with a later issue). Interface as `Qwen3NextForCausalLM`."""

    checkpoint_renames = (("model.language_model.", "model."),)
