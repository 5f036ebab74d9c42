"""The contract between the model runner and a model (docs/ARCHITECTURE.md §6).

A model is a plain `torch.nn.Module` that describes the network; the runner decides how it
runs. It holds no kernel choice and no cache tensor: attention goes through the step's
backend (`services.worker.layers.attention.AttentionBackend`), the layer path through the
runner's fusion choice (`services.worker.fusion.FusionPlan`), and the KV cache is allocated
by the runner from what the model says each layer caches.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from services.worker.kv_cache import PagedKVSpec
from services.worker.layers.attention import AttentionBackend, AttentionSpec
from services.worker.state_cache import StateSpec


@runtime_checkable
class CausalLM(Protocol):
    """A causal language model the runner can serve (`services.worker.models.llama` is one).

    packed_modules: checkpoint module name -> (our stacked module, shard index), for the loader.
    ignored_tensors: suffixes of checkpoint tensors skipped on purpose (e.g. rotary_emb.inv_freq);
    a model may also name `ignored_prefixes` (e.g. "mtp." for a head it does not load).
    tied_lm_head: whether the lm_head shares the embedding's weight (the loader expects no
    lm_head tensor then).
    """

    packed_modules: dict[str, tuple[str, int]]
    ignored_tensors: tuple[str, ...]
    tied_lm_head: bool

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                 fused: bool = False) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 (flattened over the step's sequences),
        attn: the step's backend, fused: the fused layer path (the runner's FusionPlan)
        -> hidden [T, hidden_size] in the model dtype (after the final norm).

        Speculative decoding (docs/ARCHITECTURE.md §5.5): a model whose
        `aux_hidden_layers` (a tuple of layer indexes, set by the runner once at load;
        empty by default) is not empty also stores, at every call, the outputs of those
        decoder layers (the residual stream after layer i, before the final norm)
        concatenated in that order as `self.aux_hidden` [T, len(layers) * hidden_size]
        (EAGLE-3's and DFlash's conditioning features)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] fp32."""
        ...

    def attention_specs(self) -> list[AttentionSpec]:
        """Each attention layer's description for the backend, layer order (after loading)."""
        ...

    def kv_specs(self) -> list[PagedKVSpec]:
        """What each layer caches, layer order (sizes the KV cache)."""
        ...

    def state_specs(self) -> list[StateSpec]:
        """What each recurrent layer keeps per request, in layer order (§4.7; [] for a model
        without recurrent layers: no state cache)."""
        ...

    def fusable_projections(self) -> list:
        """The weights the fused layer path runs on our projection kernels (one layer's:
        tensors, or a quantized layer's weight object, `services.worker.fusion.FusionPlan.choose`);
        [] when the model has no fused path."""
        ...
