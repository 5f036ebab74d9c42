"""The EAGLE-style head (docs/ARCHITECTURE.md §5.5): one decoder layer over the target's
features and the next token's embedding, chained for k drafts.

Sources: Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"
(arXiv 2401.15077), and "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test" (arXiv 2503.01840): the feature is `fc` over the outputs of
3 target layers (low, mid, high), and the head's own output feeds its next step.

The head at position p reads the pair (g_{p-1}, t_p): g_{p-1} = fc(target features at
p - 1) (zeros at p = 0), t_p the token at p; the layer's input is
cat(input_layernorm(embed(t_p)), hidden_norm(g_{p-1})) [2H], its residual g_{p-1} (or the
normed feature with `norm_before_residual`), and norm(output) through lm_head predicts
t_{p+1}. Its KV cache (one layer, a KV group of its own indexed by the target's block ids)
holds the pair of every context position: `observe` writes it over every step's tokens
(prefill included) with the k/v projection alone. A pair at p depends only on tokens <= p,
so a prefix-cache block of the head's group is as shareable as the target's. (EAGLE's own
indexing puts the same pair at p - 1; a constant shift is invisible to RoPE attention,
except that position 0 here holds a pair with a zero feature.)

Per request the head keeps the fc features of its last step's last num_draft + 1 positions
(`_carry`): the next step's first token needs the feature of the position before it, which
that step does not compute (after a verify, the row of the last accepted token). A step
starting where no kept feature is (a prefix-cache hit, a tier load) uses zeros there: only
the drafts get worse, never the output.

`propose` runs k chained decode steps: step 0 at next_pos reads (fc(features of the row that
predicted emitted[-1]), emitted[-1]); step i reads (the head's output of step i-1, d_i) at
next_pos + i and writes its KV there (overwritten by the next `observe`).

Checkpoint layout (an EAGLE-3 folder: config.json and safetensors):
- config.json: hidden_size, intermediate_size, num_attention_heads, num_key_value_heads,
  head_dim, rms_norm_eps, rope_theta / rope_scaling, vocab_size (the target's),
  draft_vocab_size (default vocab_size), target_hidden_size (default hidden_size; must be
  the target's), norm_before_residual (default false), eagle_config.
  eagle_aux_hidden_state_layer_ids (optional; vLLM's convention, the input of layer i, read
  as the output of layer i - 1);
- fc.weight [H, n * target_hidden] (n features; EAGLE-3: 3);
- midlayer.input_layernorm.weight, midlayer.hidden_norm.weight,
  midlayer.post_attention_layernorm.weight [H]; midlayer.self_attn.{q,k,v}_proj.weight
  [*, 2H]; midlayer.self_attn.o_proj.weight; midlayer.mlp.{gate,up,down}_proj.weight;
- norm.weight [H]; lm_head.weight [draft_vocab, H];
- d2t [draft_vocab] int64: target id = draft id + d2t[draft id] (needed when the draft
  vocabulary is smaller); t2d is ignored;
- embed_tokens.weight [vocab, H] (optional: absent, the target's embedding is shared).
With load_format dummy and no folder: seeded random weights of the target's shape
(draft vocabulary = the target's, d2t zero, the target's embedding).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from services.worker.kv_cache import KVHandle, PagedKVSpec
from services.worker.layers.attention import AttentionBackend, AttentionLayer, bind_layers
from services.worker.layers.embedding import LMHead, VocabEmbedding
from services.worker.layers.linear import Linear
from services.worker.layers.norm import RMSNorm
from services.worker.layers.rotary import RotaryEmbedding
from services.worker.spec.base import Proposal, ProposeRequest, Proposer, ProposerInfo, StepView
from services.worker.spec.draft_attention import device_ints, row_backend, row_inputs, store_kv_only
from services.worker.spec.draft_sampling import choose_drafts, draft_seed
from services.worker.spec.head_layers import DRAFT_PACKED_MODULES, DraftAttention, DraftMLP, HeadArgs
from services.worker.spec.head_loading import (TargetParts, building, check_layers, fill_weights, head_args,
                                               read_config, read_tensor, tensor_names, tensor_shape)
from shared.spec_config import SpeculativeConfig
from services.worker.layers.module import Module


def eagle_default_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, mid and high features as layer outputs: layers 1, L/2 - 1 and L - 4
    (vLLM's default (2, L // 2, L - 3) counts the input of a layer), clamped to the model."""
    return tuple(min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4))


class Eagle3Layer(Module):
    """The head's decoder layer ("midlayer"): attention over [embedding, feature] (2H in),
    then the SwiGLU MLP (module doc for the wiring)."""

    def __init__(self, a: HeadArgs, norm_before_residual: bool):
        super().__init__()
        h = a.hidden_size
        self.input_layernorm = RMSNorm(h, a.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, a.rms_norm_eps)
        self.self_attn = DraftAttention(a, 0)
        self.post_attention_layernorm = RMSNorm(h, a.rms_norm_eps)
        self.mlp = DraftMLP(a)
        self.norm_before_residual = norm_before_residual

    def attn_input(self, emb: torch.Tensor, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input [T, 2H], residual [T, H]) of embeddings and features [T, H]."""
        f = self.hidden_norm(feat)
        return torch.cat([self.input_layernorm(emb), f], dim=-1), (f if self.norm_before_residual else feat)


class Eagle3Head(Module):
    """The head's weights (module doc for the layout). a: its shapes (vocab_size: the draft
    vocabulary); fc_in: fc's input width (target layers read x the target's hidden size);
    target_vocab: the target's vocabulary; own_embed: an embed_tokens of its own;
    max_positions: rotary rows."""

    packed_modules = DRAFT_PACKED_MODULES
    ignored_tensors: tuple[str, ...] = ("d2t", "t2d", "rotary_emb.inv_freq")
    tied_lm_head = False

    def __init__(self, a: HeadArgs, fc_in: int, target_vocab: int, own_embed: bool,
                 max_positions: int, norm_before_residual: bool = False):
        super().__init__()
        h = a.hidden_size
        self.embed_tokens = VocabEmbedding(target_vocab, h) if own_embed else None
        self.fc = Linear(fc_in, h)
        self.midlayer = Eagle3Layer(a, norm_before_residual)
        self.norm = RMSNorm(h, a.rms_norm_eps)
        self.lm_head = LMHead(a.vocab_size, h)
        self.rotary = RotaryEmbedding(a.head_dim, a.rope_theta, max_positions, a.rope_scaling)
        self.target_vocab = target_vocab
        self.targets: torch.Tensor | None = None  # draft id -> target id; None: the identity

    def set_vocab_map(self, d2t: torch.Tensor | None) -> None:
        """Map draft ids to target ids: target = draft + d2t[draft] (d2t [draft_vocab]
        int64); None or all zero with equal vocabularies: the identity. Raises ValueError
        for a d2t of the wrong size or one mapping outside the target's vocabulary."""
        vd = self.lm_head.weight.shape[0]
        if d2t is None:
            if vd != self.target_vocab:
                raise ValueError(f"EAGLE head: draft vocabulary {vd} != target's {self.target_vocab} needs d2t")
            self.targets = None
            return
        if tuple(d2t.shape) != (vd,):
            raise ValueError(f"EAGLE head: d2t of shape {tuple(d2t.shape)}, expected ({vd},)")
        t = torch.arange(vd, dtype=torch.long) + d2t.long().cpu()
        if int(t.min()) < 0 or int(t.max()) >= self.target_vocab:
            raise ValueError("EAGLE head: d2t maps draft ids outside the target's vocabulary")
        identity = vd == self.target_vocab and bool((t == torch.arange(vd)).all())
        # the head's device (a CPU-quantized lm_head keeps only a meta-device placeholder weight)
        self.targets = None if identity else t.to(self.norm.weight.device)

    def step(self, positions: torch.Tensor, emb: torch.Tensor, feat: torch.Tensor,
             attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over rows of (embedding, feature) [T, H] each at positions [T]
        -> (normed [T, H] for the lm_head, the output stream [T, H]: the next step's
        feature)."""
        m = self.midlayer
        x, residual = m.attn_input(emb, feat)
        x, residual = m.post_attention_layernorm(m.self_attn(positions, x, attn), residual)
        return self.norm(m.mlp(x), residual)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [n, H] -> logits [n, target vocab] fp32, -inf at ids outside the draft
        vocabulary."""
        logits = self.lm_head(normed)
        if self.targets is None:
            return logits
        out = logits.new_full((logits.shape[0], self.target_vocab), float("-inf"))
        out[:, self.targets] = logits
        return out


class EagleProposer(Proposer):
    """EAGLE-3 drafting (module doc). cfg: the `KestrelConfig` (block_size, seed);
    spec: the `SpeculativeConfig` (model, target_layer_ids, draft_sampling); runner: the
    `ModelRunner` with its target loaded. Raises ValueError / FileNotFoundError for a bad
    folder or layer list, from the loader for bad tensors."""

    def __init__(self, cfg: Any, spec: SpeculativeConfig, runner: Any):
        t = self.target = TargetParts.of(cfg, runner)
        self.probabilistic = spec.uses_draft_probs
        self.default_seed = int(cfg.seed)
        folder = spec.model
        conf = read_config(folder) if folder else None
        names = tensor_names(folder) if folder else set()
        c = conf or {}
        a = head_args(conf, t.args, num_hidden_layers=1)
        a = dataclasses.replace(a, attn_in=2 * a.hidden_size,
                                vocab_size=int(c.get("draft_vocab_size") or a.vocab_size))
        th = int(c.get("target_hidden_size", a.hidden_size))
        own_embed = "embed_tokens.weight" in names
        if th != t.args.hidden_size:
            raise ValueError(f"EAGLE head {folder!r}: target_hidden_size {th} is not the target's "
                             f"{t.args.hidden_size}")
        if a.hidden_size != th and not own_embed:
            raise ValueError(f"EAGLE head {folder!r}: hidden_size {a.hidden_size} differs from the target's "
                             f"{th}, so it needs an embed_tokens.weight of its own")
        fc_shape = tensor_shape(folder, "fc.weight") if folder else None
        n_feat = fc_shape[1] // th if fc_shape else 3
        layers = spec.target_layer_ids
        if not layers:
            ids = (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            layers = tuple(int(i) - 1 for i in ids) if ids else eagle_default_layers(t.args.num_hidden_layers)
        self.target_layer_ids = check_layers(tuple(layers), t.args.num_hidden_layers, n_feat, "eagle")
        with building(t.device, t.dtype):
            self.head = Eagle3Head(a, n_feat * th, t.args.vocab_size, own_embed, t.max_positions,
                                   bool(c.get("norm_before_residual", False)))
        self.weight_bytes = fill_weights(self.head, folder, self.default_seed)
        self.head.eval()
        self.head.set_vocab_map(read_tensor(folder, "d2t") if folder else None)
        self.embed = t.embed if self.head.embed_tokens is None else self.head.embed_tokens
        self.args = a
        self._layers: list[AttentionLayer] | None = None
        # request id -> (position of the first kept row, fc features [rows, H] of its last step)
        self._carry: dict[str, tuple[int, torch.Tensor]] = {}

    def kv_specs(self) -> list[PagedKVSpec]:
        """One layer of (num_key_value_heads, head_dim)."""
        return [PagedKVSpec(self.args.num_key_value_heads, self.args.head_dim)]

    def bind_kv(self, layers: list[KVHandle]) -> None:
        self._layers = bind_layers([self.head.midlayer.self_attn.spec(self.head.rotary.cos_sin)], layers)

    def observe(self, view: StepView) -> None:
        """Write the head's pair (g_{p-1}, t_p) K/V at every token of the step (module doc)
        and keep each seq's last num_draft + 1 features. Raises RuntimeError before
        `bind_kv`, ValueError when the view has no aux_hidden."""
        layers = self._bound()
        if view.aux_hidden is None:
            raise ValueError("EAGLE observe: no aux_hidden (set model.aux_hidden_layers = target_layer_ids)")
        lens = [len(s.token_ids) for s in view.seqs]
        n = sum(lens)
        if n == 0:
            return
        g = self.head.fc(view.aux_hidden[:n])
        extra = [g.new_zeros(1, g.shape[1])]  # row n: the zero feature
        prev: list[int] = []  # the feature row of each token: its predecessor's
        keep: list[tuple[str, int, int, int]] = []  # (request, first position, first row, rows)
        off = 0
        for s, m in zip(view.seqs, lens):
            c = self._carried(s.request_id, s.start_pos)
            if c is None:
                prev.append(n)
            else:
                prev.append(n + len(extra))
                extra.append(c)
            prev.extend(range(off, off + m - 1))
            kk = min(m, s.num_draft + 1)
            keep.append((s.request_id, s.start_pos + m - kk, off + m - kk, kk))
            off += m
        dev = g.device
        feat = torch.cat([g, *extra]).index_select(0, device_ints(prev, dev))
        x, _ = self.head.midlayer.attn_input(self.embed(view.input_ids[:n]), feat)
        k, v = self.head.midlayer.self_attn.kv(x)
        store_kv_only(layers[0], k, v, view.positions[:n], view.meta.slot_mapping[:n])
        rows = [r for _, _, a, kk in keep for r in range(a, a + kk)]
        kept = g.index_select(0, device_ints(rows, dev))
        o = 0
        for rid, first, _, kk in keep:
            self._carry[rid] = (first, kept[o:o + kk])
            o += kk

    def propose(self, requests: list[ProposeRequest], view: StepView) -> Proposal:
        """Up to num_propose chained drafts per request (module doc); fewer where its block
        table or max_model_len ends first. Probabilistic drafting returns each draft's q."""
        layers = self._bound()
        t = self.target
        bs = t.block_size
        caps = [max(0, min(r.num_propose, len(r.block_table) * bs - r.next_pos, t.max_model_len - 1 - r.next_pos))
                for r in requests]
        cur = [j for j, c in enumerate(caps) if c > 0]
        out: list[list[int]] = [[] for _ in requests]
        if not cur:
            return Proposal(out, self._empty_probs(len(requests)))
        if view.aux_hidden is None:
            raise ValueError("EAGLE propose: no aux_hidden (set model.aux_hidden_layers = target_layer_ids)")
        dev = view.aux_hidden.device
        feat = self.head.fc(view.aux_hidden.index_select(0, device_ints([requests[j].row for j in cur], dev)))
        tok = device_ints([requests[j].emitted[-1] for j in cur], dev)
        steps: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []
        for i in range(max(caps)):
            still = [p for p, j in enumerate(cur) if caps[j] > i]
            if len(still) != len(cur):
                idx = device_ints(still, dev)
                feat, tok, cur = feat.index_select(0, idx), tok.index_select(0, idx), [cur[p] for p in still]
            reqs = [requests[j] for j in cur]
            pos, meta = row_inputs([r.next_pos + i for r in reqs], [r.next_pos + i + 1 for r in reqs],
                                   [r.block_table for r in reqs], bs, t.device, not t.reference)
            normed, feat = self.head.step(pos, self.embed(tok), feat, row_backend(layers, meta, t.reference, False))
            seeds = [draft_seed(self._seed(r), r.output_index + i) for r in reqs] if self.probabilistic else None
            tok, q = choose_drafts(self.head.compute_logits(normed), [r.sampling.temperature for r in reqs],
                                   seeds, self.probabilistic)
            steps.append((cur, tok, q))
        host = torch.cat([s[1] for s in steps]).tolist()
        o = 0
        where: list[list[tuple[int, int]]] = [[] for _ in requests]  # per request: (step, row)
        for si, (c, _, _) in enumerate(steps):
            for p, j in enumerate(c):
                out[j].append(host[o + p])
                where[j].append((si, p))
            o += len(c)
        if not self.probabilistic:
            return Proposal(out)
        probs = self._empty_probs(len(requests))
        assert probs is not None
        for j, w in enumerate(where):
            if w:
                probs[j] = torch.stack([steps[si][2][p] for si, p in w])  # type: ignore[index]
        return Proposal(out, probs)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._carry.pop(rid, None)

    def info(self) -> ProposerInfo:
        a, t = self.args, self.target
        el = torch.empty((), dtype=t.dtype).element_size()
        return ProposerInfo("eagle", self.weight_bytes, 2 * t.block_size * a.num_key_value_heads * a.head_dim * el,
                            {"target_layer_ids": list(self.target_layer_ids), "draft_vocab_size": a.vocab_size,
                             "shared_embedding": self.head.embed_tokens is None,
                             "draft_sampling": "probabilistic" if self.probabilistic else "greedy"})

    def _bound(self) -> list[AttentionLayer]:
        if self._layers is None:
            raise RuntimeError("EAGLE proposer: bind_kv first (its KV cache group)")
        return self._layers

    def _carried(self, request_id: str, start: int) -> torch.Tensor | None:
        """The kept feature [1, H] of position start - 1, None when none is kept there."""
        c = self._carry.get(request_id) if start > 0 else None
        if c is None:
            return None
        j = start - 1 - c[0]
        return c[1][j:j + 1] if 0 <= j < c[1].shape[0] else None

    def _seed(self, r: ProposeRequest) -> int:
        return self.default_seed if r.sampling.seed is None else r.sampling.seed

    def _empty_probs(self, n: int) -> list[torch.Tensor] | None:
        if not self.probabilistic:
            return None
        v = self.target.args.vocab_size
        return [torch.zeros(0, v, dtype=torch.float32, device=self.target.device) for _ in range(n)]
