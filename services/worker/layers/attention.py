"""The attention layer over the paged KV cache, and the step's attention metadata.

The layer writes the step's keys and values into its cache blocks through the slot mapping,
then runs paged attention (`kernels.attention`) for prefill chunks and decodes together.
Its k_cache / v_cache are bound by the KV cache allocator (`services.worker.kv_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.attention import RefAttentionPlan, paged_attention, store_kv


@dataclass
class AttentionMetadata:
    """What every attention layer needs about one step; built once by the model runner.

    cu_seqlens_q: [num_seqs + 1] int32, query token offsets in the flattened batch.
    seq_lens: [num_seqs] int32, cached tokens per sequence including this step's.
    block_tables: [num_seqs, max_blocks] int32, -1 padded.
    slot_mapping: [num_tokens] int64, cache slot of each new token.
    ref_plan: gather indices of the torch reference (None on a device that uses kernels).
    """

    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    ref_plan: RefAttentionPlan | None = None
    max_q_len: int | None = None  # host-side bounds for the GPU kernels (no device sync)
    max_seq_len: int | None = None


class Attention(nn.Module):
    """Paged causal attention with GQA.

    forward(q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim], meta)
    -> [T, num_heads * head_dim].
    Raises ValueError if num_heads is not a multiple of num_kv_heads.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)  # [num_blocks, block_size, num_kv_heads, head_dim]
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of q over the cache, this step's K/V already stored: -> [T, heads * head_dim]."""
        o = paged_attention(q, self.k_cache, self.v_cache, meta.cu_seqlens_q, meta.seq_lens,
                            meta.block_tables, self.scale, meta.ref_plan, meta.max_q_len,
                            meta.max_seq_len)
        return o.reshape(q.shape[0], -1)
