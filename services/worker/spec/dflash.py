"""The DFlash-style block drafter (docs/ARCHITECTURE.md §5.5): a few decoder layers that
propose a block of k tokens in one forward, conditioned on hidden states of chosen target
layers.

Source: Chen et al., "DFlash: Block Diffusion for Flash Speculative Decoding" (arXiv
2602.06036) and its reference code (z-lab/dflash): the context feature of position p is
c_p = hidden_norm(fc(cat of the target layers' outputs at p)); each drafter layer projects
c_p with its own k/v projection (k norm, RoPE at p) into its KV cache, and never runs its
queries there. To draft after the last emitted token b at position P, the block
[b, mask, .., mask] (k masks, the target's embedding of `mask_token_id`) at positions
P .. P + k runs through the layers; every block row attends to the context 0 .. P - 1 and
to the whole block (bidirectional within it), and row i's norm through the target's lm_head
proposes the token at P + i (i = 1..k). No feature is kept between steps.

Here: `observe` writes c_p's K/V at every token of every step (prefill included) into the
drafter's KV group (one cache per drafter layer, the target's block ids); positions of
rejected drafts are written again when the target runs them. `propose` writes the block's
K/V at the slots of P .. P + k (future positions of the request, overwritten by a later
`observe` before any step reads them as context) and runs each block row as a query
sequence of its own that sees P + k + 1 positions: bidirectional attention with the causal
kernels (`draft_attention.row_inputs`). The block needs one slot past the k drafts; where the
request's blocks end there, the block is one shorter.

Checkpoint layout (a z-lab DFlash folder: config.json and safetensors):
- config.json: hidden_size (the target's), intermediate_size, num_attention_heads,
  num_key_value_heads, head_dim, num_hidden_layers (drafter layers), rms_norm_eps,
  rope_theta / rope_scaling, block_size (drafts per block + 1; caps k), dflash_config:
  {target_layer_ids (layer outputs), mask_token_id};
- fc.weight [H, len(target_layer_ids) * H], hidden_norm.weight [H], norm.weight [H];
- layers.{i}.input_layernorm.weight, layers.{i}.post_attention_layernorm.weight,
  layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight
  (optional: both or neither), layers.{i}.mlp.{gate,up,down}_proj.weight;
- no embedding and no lm_head: the target's are used.
With load_format dummy and no folder: seeded random weights of the target's shape, with
`draft_num_layers` layers (0: one per target layer read), q/k norms, mask_token_id =
vocab_size - 1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from services.worker.kv_cache import KVHandle, PagedKVSpec
from services.worker.layers.attention import AttentionBackend, AttentionLayer, bind_layers
from services.worker.layers.linear import Linear
from services.worker.layers.norm import RMSNorm
from services.worker.layers.rotary import RotaryEmbedding
from services.worker.spec.base import Proposal, ProposeRequest, Proposer, ProposerInfo, StepView
from services.worker.spec.draft_attention import device_ints, row_backend, row_inputs, store_kv_only
from services.worker.spec.draft_sampling import choose_drafts, draft_seed
from services.worker.spec.head_layers import DRAFT_PACKED_MODULES, DraftAttention, DraftMLP, HeadArgs
from services.worker.spec.head_loading import (TargetParts, building, check_layers, fill_weights, head_args,
                                               read_config, spread_layers, tensor_names)
from shared.spec_config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from services.worker.layers.module import Module

DFLASH_DEFAULT_LAYERS = 4  # target layers read when neither the config nor the folder names them


class DFlashLayer(Module):
    """One drafter layer: pre-norm attention and SwiGLU MLP with residuals (Qwen3's)."""

    def __init__(self, a: HeadArgs, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = DraftAttention(a, layer_idx)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = DraftMLP(a)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Block rows x [T, H] at positions [T] -> [T, H]."""
        h = self.self_attn(positions, self.input_layernorm(x), attn)
        h, residual = self.post_attention_layernorm(h, x)
        return self.mlp(h) + residual


class DFlashDrafter(Module):
    """The drafter's weights (module doc for the layout). a: its shapes; fc_in: fc's input
    width (target layers read x hidden); max_positions: rotary rows."""

    packed_modules = DRAFT_PACKED_MODULES
    ignored_tensors: tuple[str, ...] = ("rotary_emb.inv_freq",)
    tied_lm_head = False

    def __init__(self, a: HeadArgs, fc_in: int, max_positions: int):
        super().__init__()
        self.fc = Linear(fc_in, a.hidden_size)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        # a plain list to iterate (typed), registered through the ModuleList
        self.decoder_layers = [DFlashLayer(a, i) for i in range(a.num_hidden_layers)]
        self.layers = nn.ModuleList(self.decoder_layers)
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.rotary = RotaryEmbedding(a.head_dim, a.rope_theta, max_positions, a.rope_scaling)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """Context features c [T, H] of the target layers' outputs aux [T, n * H]."""
        return self.hidden_norm(self.fc(aux))


class DFlashProposer(Proposer):
    """DFlash block drafting (module doc). cfg: the `KestrelConfig` (block_size, seed);
    spec: the `SpeculativeConfig` (model, target_layer_ids, draft_sampling,
    draft_num_layers); runner: the `ModelRunner` with its target loaded. Raises ValueError
    / FileNotFoundError for a bad folder or layer list, from the loader for bad tensors."""

    def __init__(self, cfg: Any, spec: SpeculativeConfig, runner: Any):
        t = self.target = TargetParts.of(cfg, runner)
        self.probabilistic = spec.uses_draft_probs
        self.default_seed = int(cfg.seed)
        folder = spec.model
        conf = read_config(folder) if folder else None
        c = conf or {}
        dc = c.get("dflash_config") or {}
        n_target = t.args.num_hidden_layers
        layers = spec.target_layer_ids or tuple(dc.get("target_layer_ids") or ())
        if not layers:
            n = DFLASH_DEFAULT_LAYERS if conf is None else int(c.get("num_hidden_layers", DFLASH_DEFAULT_LAYERS))
            layers = spread_layers(n_target, n)
        self.target_layer_ids = check_layers(tuple(int(i) for i in layers), n_target, len(layers), "dflash")
        if folder:
            qk_norm = "layers.0.self_attn.q_norm.weight" in tensor_names(folder)
            a = head_args(conf, t.args, qk_norm=qk_norm)
            self.mask_token_id = int(dc.get("mask_token_id", c.get("mask_token_id", t.args.vocab_size - 1)))
            self.max_block = int(c.get("block_size", MAX_SPECULATIVE_TOKENS + 1))
        else:
            depth = spec.draft_num_layers or len(self.target_layer_ids)
            a = head_args(None, t.args, qk_norm=True, num_hidden_layers=depth)
            self.mask_token_id = t.args.vocab_size - 1
            self.max_block = MAX_SPECULATIVE_TOKENS + 1
        if a.hidden_size != t.args.hidden_size:
            raise ValueError(f"DFlash drafter {folder!r}: hidden_size {a.hidden_size} is not the target's "
                             f"{t.args.hidden_size} (it uses the target's embedding and lm_head)")
        if not 0 <= self.mask_token_id < t.args.vocab_size:
            raise ValueError(f"DFlash drafter {folder!r}: mask_token_id {self.mask_token_id} outside the vocabulary")
        with building(t.device, t.dtype):
            self.drafter = DFlashDrafter(a, len(self.target_layer_ids) * a.hidden_size, t.max_positions)
        self.weight_bytes = fill_weights(self.drafter, folder, self.default_seed)
        self.drafter.eval()
        self.args = a
        self._layers: list[AttentionLayer] | None = None

    def kv_specs(self) -> list[PagedKVSpec]:
        """One cache per drafter layer, (num_key_value_heads, head_dim) each."""
        return [PagedKVSpec(self.args.num_key_value_heads, self.args.head_dim)] * self.args.num_hidden_layers

    def bind_kv(self, layers: list[KVHandle]) -> None:
        cs = self.drafter.rotary.cos_sin
        self._layers = bind_layers([layer.self_attn.spec(cs) for layer in self.drafter.decoder_layers], layers)

    def observe(self, view: StepView) -> None:
        """Write every drafter layer's context K/V at every token of the step (module doc).
        Raises RuntimeError before `bind_kv`, ValueError when the view has no aux_hidden."""
        layers = self._bound()
        if view.aux_hidden is None:
            raise ValueError("DFlash observe: no aux_hidden (set model.aux_hidden_layers = target_layer_ids)")
        n = sum(len(s.token_ids) for s in view.seqs)
        if n == 0:
            return
        ctx = self.drafter.context(view.aux_hidden[:n])
        pos, slots = view.positions[:n], view.meta.slot_mapping[:n]
        for i, layer in enumerate(self.drafter.decoder_layers):
            k, v = layer.self_attn.kv(ctx)
            store_kv_only(layers[i], k, v, pos, slots)

    def propose(self, requests: list[ProposeRequest], view: StepView) -> Proposal:
        """One block forward for all requests: up to num_propose drafts each (fewer where the
        checkpoint's block size, the request's blocks or max_model_len end first).
        Probabilistic drafting returns each draft's q."""
        layers = self._bound()
        t = self.target
        bs = t.block_size
        caps = [max(0, min(r.num_propose, self.max_block - 1, len(r.block_table) * bs - r.next_pos - 1,
                           t.max_model_len - 1 - r.next_pos)) for r in requests]
        out: list[list[int]] = [[] for _ in requests]
        cur = [j for j, c in enumerate(caps) if c > 0]
        if not cur:
            return Proposal(out, self._empty_probs(len(requests)))
        ids: list[int] = []
        pos: list[int] = []
        lens: list[int] = []
        tables: list[list[int]] = []
        picks: list[int] = []  # the mask rows, in draft order
        for j in cur:
            r, k = requests[j], caps[j]
            picks.extend(range(len(ids) + 1, len(ids) + k + 1))
            ids.extend([r.emitted[-1]] + [self.mask_token_id] * k)
            pos.extend(range(r.next_pos, r.next_pos + k + 1))
            lens.extend([r.next_pos + k + 1] * (k + 1))
            tables.extend([r.block_table] * (k + 1))
        positions, meta = row_inputs(pos, lens, tables, bs, t.device, not t.reference)
        attn = row_backend(layers, meta, t.reference, True)
        x = t.embed(device_ints(ids, t.device))
        for layer in self.drafter.decoder_layers:
            x = layer(positions, x, attn)
        x = x.index_select(0, device_ints(picks, t.device))
        logits = t.compute_logits(self.drafter.norm(x))
        reqs = [(requests[j], i) for j in cur for i in range(caps[j])]
        seeds = [draft_seed(self._seed(r), r.output_index + i) for r, i in reqs] if self.probabilistic else None
        tok, q = choose_drafts(logits, [r.sampling.temperature for r, _ in reqs], seeds, self.probabilistic)
        host = tok.tolist()
        probs = self._empty_probs(len(requests))
        o = 0
        for j in cur:
            k = caps[j]
            out[j] = host[o:o + k]
            if probs is not None and q is not None:
                probs[j] = q[o:o + k]
            o += k
        return Proposal(out, probs)

    def info(self) -> ProposerInfo:
        a, t = self.args, self.target
        el = torch.empty((), dtype=t.dtype).element_size()
        per_block = 2 * t.block_size * a.num_key_value_heads * a.head_dim * el * a.num_hidden_layers
        return ProposerInfo("dflash", self.weight_bytes, per_block,
                            {"target_layer_ids": list(self.target_layer_ids), "layers": a.num_hidden_layers,
                             "mask_token_id": self.mask_token_id, "block_size": self.max_block,
                             "draft_sampling": "probabilistic" if self.probabilistic else "greedy"})

    def _bound(self) -> list[AttentionLayer]:
        if self._layers is None:
            raise RuntimeError("DFlash proposer: bind_kv first (its KV cache group)")
        return self._layers

    def _seed(self, r: ProposeRequest) -> int:
        return self.default_seed if r.sampling.seed is None else r.sampling.seed

    def _empty_probs(self, n: int) -> list[torch.Tensor] | None:
        if not self.probabilistic:
            return None
        v = self.target.args.vocab_size
        return [torch.zeros(0, v, dtype=torch.float32, device=self.target.device) for _ in range(n)]
