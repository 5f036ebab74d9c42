"""The draft-model proposer: a smaller model with the target's tokenizer, run in the same
worker with a KV cache group of its own (docs/ARCHITECTURE.md §5.5).

Speculative sampling with a draft model: Leviathan et al. 2023 (arXiv 2211.17192), Chen et
al. 2023 (arXiv 2302.01318). The draft is any registry architecture (`services.worker.models`)
whose vocabulary is the target's; `check_speculative` refuses one whose `vocab_size`
differs before any process starts, and the constructor checks it again.

**Its KV cache.** The draft's layers cache their own K/V (`kv_specs`) in a group that the
runner allocates with the target's `num_blocks` and `block_size` and binds (`bind_kv`), so
the target's block ids and slot mapping address it: block b of the draft's group holds the
draft's KV of the same positions as block b of the target's. Hence
- `observe(view)` runs the draft over the step's tokens (prefill chunks, decodes and verify
  seqs alike) with the target's attention metadata and the draft's own attention layers,
  writing its KV at the same slots; the hidden states it computes are not used;
- a prefix-cache hit needs nothing: the hit blocks hold the draft's KV from the step that
  computed them (every target forward is observed);
- after a rejection the draft's KV at rejected positions is overwritten when those positions
  are computed again, as the target's is;
- a KV tier load brings the target's KV only, so the kvstore tiers are refused with this
  method (`shared.spec_config.check_speculative`).

**Drafting.** `propose` runs up to `num_propose` chained one-token forwards, batched over
the requests (a request leaves the batch when it has its drafts): the first input is
`emitted[-1]` at `next_pos`, each next one the previous draft, at the next position; each
forward writes the draft's KV of its input, so the chain attends over its own drafts. The
inputs after the first stay on the device; the drafts come to the host once, at the end.
- greedy (`draft_sampling` "greedy"): the draft's argmax; point-mass drafts (`probs` None);
- probabilistic: q = the draft's distribution under the request's temperature, top-k,
  top-p and min-p (`kernels.sampling.filtered_probs`, renormalised); the draft is a
  Gumbel-max draw from q keyed on (seed, output_index + i) on the draft's own noise stream
  (`draft_noise_seed`, so that it is independent of the target's draws at the same output
  index, which rejection sampling needs), and q is returned in `Proposal.probs`. A greedy
  request (temperature 0) gets the argmax with q its point mass. The request's logits
  processors (bias, penalties, grammar masks) are not applied to q: rejection sampling is
  lossless for any q, they only change the acceptance rate.

**Dummy drafts** (`--load-format dummy` without `speculative_config.model`, for timing): a
model of the target's shape with `draft_num_layers` layers (0: the target's depth) and
seeded random weights from the target's seed (`loader.load_dummy_weights`). The loader
draws the parameters in order from one generator, so the draft's embedding and layers are
the target's first ones, and at the target's depth the draft is the target itself
(acceptance 100%, the upper bound of a benchmark).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from kernels.sampling import filtered_probs
from kernels.sampling_noise import mix_seed, noise_keys, race_noise
from services.worker.fusion import FusionPlan
from services.worker.kv_cache import KVHandle, PagedKVSpec
from services.worker.layers.attention import AttentionLayer, bind_layers, select_backend
from services.worker.loader import load_dummy_weights, load_weights
from services.worker.models import model_class
from services.worker.models.base import CausalLM
from services.worker.spec.base import Proposal, Proposer, ProposeRequest, ProposerInfo, StepView
from services.worker.step_inputs import prepare_step
from shared.model_spec import ModelSpec, dtype_bytes, load_model_spec
from shared.protocol import SamplingParams, ScheduledSeq
from shared.spec_config import SpeculativeConfig

if TYPE_CHECKING:  # the runner builds the proposer; no import at run time (no cycle)
    from services.worker.model_runner import ModelRunner
    from shared.config import KestrelConfig

# The draft's noise stream: the draft's draw at output index j of a request seeded `seed` is
# keyed mix_seed(mix_seed(seed, j), DRAFT_NOISE_STREAM); the target's draw there uses the row
# key mix_seed(seed, j) itself, rejection sampling's streams other tags of it.
DRAFT_NOISE_STREAM = 0x64726166  # b"draf"


def draft_noise_seed(seed: int, output_index: int) -> int:
    """The 63-bit key of the draft's seeded draw at `output_index` for a request seeded
    `seed`: a stream of its own (`DRAFT_NOISE_STREAM`), so the draft's Gumbel noise is not
    the noise of the target's draws at the same output index (`kernels.sampling_noise.mix_seed`)."""
    return mix_seed(mix_seed(seed, output_index), DRAFT_NOISE_STREAM)


def draft_model_spec(cfg: KestrelConfig, spec: SpeculativeConfig, target: ModelSpec) -> ModelSpec:
    """The draft's `ModelSpec`: its folder's (`spec.model`, in the target's dtype and
    max_model_len; its KV in the model dtype, whatever the target's KV dtype), or without a folder (load_format dummy) the target's with
    `spec.draft_num_layers` layers (0: the target's depth). Raises ValueError without a
    folder outside dummy loading, `ModelFolderError` for a bad folder, and ValueError when
    the draft's vocab_size is not the target's."""
    if spec.model is None:
        if not spec.dummy_weights(cfg.load_format):
            raise ValueError("speculative_config.model: a draft model needs its folder (or --load-format dummy)")
        n = spec.draft_num_layers or target.num_layers
        hf = dict(target.hf_config)
        hf["num_hidden_layers"] = n
        return dataclasses.replace(target, num_layers=n, hf_config=MappingProxyType(hf), kv_dtype=target.dtype)
    # the draft's own KV group stays in the model dtype (a quantized target KV is the target's)
    draft = load_model_spec(spec.model, dtype=target.dtype, max_model_len=target.max_model_len)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocab_size {draft.vocab_size} is not the "
                         f"target's {target.vocab_size} (a draft model must share the target's tokenizer)")
    return draft


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class DraftModelProposer(Proposer):
    """`speculative_config.method` "draft_model" (module doc).

    cfg: the worker's `KestrelConfig` (load_format, seed); spec: the parsed
    `SpeculativeConfig`; runner: the target's `ModelRunner` (device, dtype, spec,
    block_size, max_model_len, use_ref_attention are read once here).
    Attributes: model (the draft `CausalLM`), draft_spec (its `ModelSpec`), weight_bytes.
    Call `bind_kv` with one handle per `kv_specs()` entry ([num_blocks, block_size, kv_heads,
    head_dim] each, the target's num_blocks and block_size) before `observe`/`propose`.
    Raises as `draft_model_spec`, `model_class` (unknown architecture) and the loader.
    """

    def __init__(self, cfg: KestrelConfig, spec: SpeculativeConfig, runner: ModelRunner):
        self.spec = spec
        self.device, self.dtype = runner.device, runner.dtype
        self.block_size, self.max_model_len = runner.block_size, runner.max_model_len
        self.reference = runner.use_ref_attention
        self.default_seed = cfg.seed
        self.probabilistic = spec.draft_sampling == "probabilistic"
        self.draft_spec = draft_model_spec(cfg, spec, runner.spec)
        with torch.device(self.device), _default_dtype(self.dtype):
            module = model_class(self.draft_spec)(self.draft_spec, self.max_model_len)
        if spec.dummy_weights(cfg.load_format):
            self.weight_bytes = load_dummy_weights(module, cfg.seed)
        else:
            assert spec.model is not None  # draft_model_spec refused a dummy draft otherwise
            self.weight_bytes = load_weights(module, spec.model)
        module.eval()
        assert isinstance(module, CausalLM)
        self.model = module
        self.fusion = FusionPlan.choose(module.fusable_projections(), self.device, self.dtype)
        self.attn_layers: list[AttentionLayer] | None = None
        self.kv_bytes = 0

    def kv_specs(self) -> list[PagedKVSpec]:
        """The draft's layers' paged K/V, layer order (its KV cache group)."""
        return self.model.kv_specs()

    def bind_kv(self, layers: list[KVHandle]) -> None:
        """Bind the draft's attention layers to its group's handles (one per layer).
        Raises ValueError on a count mismatch, or a handle whose shape is not its layer's."""
        for h, s in zip(layers, self.kv_specs()):
            if tuple(h.k.shape[1:]) != (self.block_size, s.num_kv_heads, s.head_dim):
                raise ValueError(f"draft KV handle of shape {tuple(h.k.shape)}, expected "
                                 f"[blocks, {self.block_size}, {s.num_kv_heads}, {s.head_dim}]")
        self.attn_layers = bind_layers(self.model.attention_specs(), layers)
        self.kv_bytes = sum(t.numel() * t.element_size() for h in layers for t in (h.k, h.v))

    def _layers(self) -> list[AttentionLayer]:
        if self.attn_layers is None:
            raise RuntimeError("DraftModelProposer: bind_kv was not called (the runner allocates the draft's KV)")
        return self.attn_layers

    @torch.inference_mode()
    def observe(self, view: StepView) -> None:
        """Run the draft over the step's tokens (view.input_ids, view.positions [T] int64)
        with the step's metadata and the draft's layers: its KV is written at
        view.meta.slot_mapping (module doc)."""
        if view.input_ids.numel() == 0:
            return
        attn = select_backend(self._layers(), view.meta, self.reference)
        self.model(view.input_ids, view.positions, attn, self.fusion.fused(view.input_ids.shape[0]))

    def _budget(self, r: ProposeRequest) -> int:
        """Drafts request r can get: num_propose, cut where its block table or max_model_len
        ends (the chain writes the draft's KV at next_pos .. next_pos + n - 1)."""
        room = min(len(r.block_table) * self.block_size, self.max_model_len) - r.next_pos
        return max(0, min(r.num_propose, room))

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest], view: StepView) -> Proposal:
        """Chained drafts for `requests` (module doc). Returns per request 0..num_propose
        draft ids and, with probabilistic drafting, their q rows [n_i, vocab] fp32 on the
        device (`Proposal`)."""
        want = [self._budget(r) for r in requests]
        layers = self._layers()
        kernels = not self.reference
        steps: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []  # (request indexes, ids, q)
        prev_rows: dict[int, int] = {}  # request index -> its row in prev
        prev: torch.Tensor | None = None
        for i in range(max(want, default=0)):
            rows = [j for j, n in enumerate(want) if n > i]
            seqs = [ScheduledSeq(requests[j].request_id, [requests[j].emitted[-1] if i == 0 else 0],
                                 requests[j].next_pos + i, requests[j].block_table, True, None) for j in rows]
            ids, positions, meta = prepare_step(seqs, self.block_size, self.max_model_len, self.device, kernels)
            if prev is not None:  # the previous drafts, on the device; rows only ever leave
                ids = prev if len(rows) == len(prev_rows) else prev.index_select(
                    0, self._to_device([prev_rows[j] for j in rows], torch.long))
            hidden = self.model(ids, positions, select_backend(layers, meta, self.reference),
                                self.fusion.fused(len(rows)))
            logits = self.model.compute_logits(hidden)
            tok, q = self._draw(logits, [requests[j] for j in rows], i)
            steps.append((rows, tok, q))
            prev, prev_rows = tok, {j: r for r, j in enumerate(rows)}
        out: list[list[int]] = [[] for _ in requests]
        if steps:
            flat = torch.cat([t for _, t, _ in steps]).tolist()  # the one host sync
            k = 0
            for rows, _, _ in steps:
                for j in rows:
                    out[j].append(flat[k])
                    k += 1
        if not self.probabilistic:
            return Proposal(out)
        vocab = self.draft_spec.vocab_size
        per: list[list[torch.Tensor]] = [[] for _ in requests]
        for rows, _, q in steps:
            assert q is not None
            for r, j in enumerate(rows):
                per[j].append(q[r])
        probs = [torch.stack(p) if p else torch.zeros(0, vocab, device=self.device) for p in per]
        return Proposal(out, probs)

    def _draw(self, logits: torch.Tensor, reqs: list[ProposeRequest],
              i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The i-th drafts of `reqs` from the draft's logits [b, vocab] fp32 -> (ids [b] int64
        on the device, q [b, vocab] fp32 normalised, or None with greedy drafting)."""
        greedy = logits.argmax(dim=-1)
        if not self.probabilistic:
            return greedy, None
        params: list[SamplingParams] = [r.sampling for r in reqs]
        q = torch.zeros_like(logits).scatter_(1, greedy[:, None], 1.0)  # point masses of greedy rows
        rand = [r for r, p in enumerate(params) if p.temperature > 0]
        if not rand:
            return greedy, q
        ps = [params[r] for r in rand]
        idx = self._to_device(rand, torch.long)
        temp = self._to_device([p.temperature for p in ps], torch.float32)
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in ps):
            fp = filtered_probs(logits[idx], temp, self._to_device([p.top_k for p in ps], torch.long),
                                self._to_device([p.top_p for p in ps], torch.float32),
                                self._to_device([p.min_p for p in ps], torch.float32))
        else:  # filtered_probs without filters, and without its host reads of the filter tensors
            fp = torch.softmax(logits[idx].float() / temp[:, None], dim=-1)
        fp = fp / fp.sum(dim=-1, keepdim=True)
        keys = noise_keys([draft_noise_seed(self.default_seed if p.seed is None else p.seed,
                                            reqs[r].output_index + i) for p, r in zip(ps, rand)])
        keys = keys.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else keys
        drawn = (torch.log(fp) + race_noise(keys, logits.shape[1])).argmax(dim=-1)  # Gumbel-max: i ~ q
        q[idx] = fp
        return greedy.index_copy(0, idx, drawn), q

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A host list as a 1-D tensor on the device, without waiting for the device
        (pinned memory, an asynchronous copy on CUDA)."""
        t = torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda")
        return t.to(self.device, non_blocking=True)

    def info(self) -> ProposerInfo:
        """Startup facts: weight bytes, the draft's KV bytes per block (all its layers, K and
        V) and, in detail, its folder ("dummy" without), layers, vocab, drafting and the KV
        bytes allocated (0 before `bind_kv`)."""
        per_block = sum(2 * self.block_size * s.num_kv_heads * s.head_dim for s in self.kv_specs())
        per_block *= dtype_bytes(self.draft_spec.kv_dtype)
        return ProposerInfo("draft_model", weight_bytes=self.weight_bytes, kv_bytes_per_block=per_block,
                            detail={"model": self.spec.model or "dummy", "num_layers": self.draft_spec.num_layers,
                                    "architecture": self.draft_spec.architecture,
                                    "vocab_size": self.draft_spec.vocab_size,
                                    "draft_sampling": self.spec.draft_sampling, "kv_bytes": self.kv_bytes})
