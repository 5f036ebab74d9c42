"""Attention over the paged KV cache: the step's metadata, each layer's description, and the
backends that run it (docs/ARCHITECTURE.md §6).

A model calls `attn.forward(layer, q, k, v, positions)` and gets the attention output; the
backend owns everything between: the per-head q/k RMSNorm (Qwen3), the rotary embedding,
the write of the step's keys and values into the layer's `KVHandle`, and the kernel. The
runner builds one backend per step from the step's `AttentionMetadata` (`select_backend`):

- `DecodeAttention` (CUDA, every sequence has one new token): one kernel does the norm,
  the rotation, the KV write and the attention (`kernels.rope_decode.rope_paged_decode`);
  inside a CUDA graph this path is fixed at capture.
- `PagedAttention` (CUDA, prefill chunks, decodes mixed with them, verify steps):
  `rotary_and_store_kv`, then `paged_attention` (varlen, over the paged cache; the multi-query
  kernel for verify steps).
- `ReferenceAttention` (the CPU, or no Triton): the same two steps on the torch references,
  with the step's gather plan (`kernels.attention.RefAttentionPlan`).

The per-layer part (`AttentionLayer`: the tensors a layer's call needs) is bound once at
load, so a layer's call is one list index and one kernel dispatcher call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import cpu_decode, ref_fast
from kernels.attention import RefAttentionPlan, paged_attention, paged_attention_ref
from kernels.rope_decode import rope_paged_decode
from kernels.rotary import rope_factors, rotary_and_store_kv, rotary_and_store_kv_ref
from services.worker.kv_cache import KVHandle, PagedKVSpec
from services.worker.state_cache import StepState


@dataclass
class AttentionMetadata:
    """What every attention layer needs about one step; built once by the model runner.

    cu_seqlens_q: [num_seqs + 1] int32 (int64 from step_inputs' packed copy for the GPU kernels), query token offsets in the flattened batch.
    seq_lens: [num_seqs] int32 (int64 likewise), cached tokens per sequence including this step's.
    block_tables: [num_seqs, max_blocks] int32 (int64 likewise), -1 padded.
    slot_mapping: [num_tokens] int64, cache slot of each new token (< 0: not written).
    ref_plan: gather indices of the torch reference (None on a device that uses kernels).
    max_q_len, max_seq_len: host-side bounds for the GPU kernels (no device sync); None on
    the reference path.
    """

    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    ref_plan: RefAttentionPlan | None = None
    max_q_len: int | None = None
    max_seq_len: int | None = None


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer as the model describes it (`CausalLM.attention_specs`).

    num_heads, num_kv_heads, head_dim: GQA shape. scale: softmax scale (head_dim ** -0.5).
    cos_sin: the model's rotary table, fp32 [max_positions, rot_dim] (`kernels.rotary.
    rope_cos_sin`), shared by the layers. q_norm, k_norm: [head_dim] weights of a per-head
    RMSNorm applied to q and k before the rotation (Qwen3), or both None; eps: its epsilon.
    Raises ValueError if num_heads is not a multiple of num_kv_heads, or only one norm is given.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    cos_sin: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("attention: q_norm and k_norm are both given or neither")

    @property
    def kv(self) -> PagedKVSpec:
        """What the layer caches per token."""
        return PagedKVSpec(self.num_kv_heads, self.head_dim)


class AttentionLayer:
    """One layer's attention bound to its KV cache: what a backend's call reads, flat.

    spec: the layer's `AttentionSpec`; kv: its `KVHandle` (shape spec.kv). k_scale, v_scale:
    the handle's scales (None unless the KV dtype is quantized). group: query heads a KV head.
    cxx: whether `kernels.cpu_decode.decode_attention` can serve the layer's decode steps (a
    contiguous fp32 CPU cache, not quantized, no q/k norm, an fp32 rotary table). heads,
    kv_heads, head_dim: the spec's; sizes: the q, k, v widths of a fused qkv row.
    """

    __slots__ = ("cos_sin", "cxx", "eps", "group", "head_dim", "heads", "k", "k_norm", "k_scale", "kv", "kv_heads",
                 "q_norm", "scale", "sizes", "v", "v_scale")

    def __init__(self, spec: AttentionSpec, kv: KVHandle):
        self.kv = kv
        self.k, self.v = kv.k, kv.v
        self.k_scale, self.v_scale = kv.k_scale, kv.v_scale
        self.cos_sin, self.scale = spec.cos_sin, spec.scale
        self.q_norm, self.k_norm, self.eps = spec.q_norm, spec.k_norm, spec.eps
        self.group = spec.num_heads // spec.num_kv_heads
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.sizes = [spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim,
                      spec.num_kv_heads * spec.head_dim]
        self.cxx = (self.k.device.type == "cpu" and self.k.dtype == torch.float32 and self.v.dtype == torch.float32
                    and self.k.is_contiguous() and self.v.is_contiguous() and self.k_scale is None
                    and self.q_norm is None and self.cos_sin.dtype == torch.float32
                    and self.cos_sin.is_contiguous() and self.cos_sin.device.type == "cpu")


def bind_layers(specs: Sequence[AttentionSpec], handles: Sequence[KVHandle]) -> list[AttentionLayer]:
    """One `AttentionLayer` per (spec, handle), layer order. Raises ValueError on a count
    mismatch. Where a layer can take the C++ CPU decode attention and `kernels.ref_fast.
    CPU_CXX_OPS` is on, its extension is built here (at load, not in the first step)."""
    if len(specs) != len(handles):
        raise ValueError(f"{len(specs)} attention layers, {len(handles)} KV handles")
    layers = [AttentionLayer(s, h) for s, h in zip(specs, handles)]
    if ref_fast.CPU_CXX_OPS and any(a.cxx for a in layers):
        cpu_decode.extension()
    return layers


class AttentionBackend:
    """Runs the attention of one step's layers (the module doc).

    layers: the model's `AttentionLayer`s; meta: the step's metadata.
    forward(layer, q [T, heads, head_dim], k, v [T, kv_heads, head_dim], positions [T] int64)
    -> [T, heads * head_dim] in q's dtype. q, k and v may be views of the fused qkv
    output (unit stride in the last dim); q and k may be left rotated or not. The step's k
    and v are in the layer's cache afterwards.
    """

    __slots__ = ("layers", "meta", "state")

    def __init__(self, layers: Sequence[AttentionLayer], meta: AttentionMetadata):
        self.layers, self.meta = layers, meta
        # a hybrid model's recurrent-state view of the step (services/worker/state_cache.py
        # `StepState`), set by the runner; None for a model without recurrent layers
        self.state: StepState | None = None

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_qkv(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`forward` on the fused projection's output qkv [T, (heads + 2 kv_heads) * head_dim]
        (q, k, v its column ranges, the layer's spec's heads): split into views and passed on; a
        backend may take qkv whole (`ReferenceAttention`'s C++ decode)."""
        a = self.layers[layer]
        t = qkv.shape[0]
        q, k, v = qkv.split(a.sizes, dim=-1)
        return self.forward(layer, q.view(t, a.heads, a.head_dim), k.view(t, a.kv_heads, a.head_dim),
                            v.view(t, a.kv_heads, a.head_dim), positions)


class DecodeAttention(AttentionBackend):
    """Decode-only steps on CUDA: `rope_paged_decode` (norm, rotary, KV write, attention)."""

    __slots__ = ()

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        a, m = self.layers[layer], self.meta
        return rope_paged_decode(q, k, v, positions, a.cos_sin, a.k, a.v, m.slot_mapping, m.cu_seqlens_q,
                                 m.seq_lens, m.block_tables, a.scale, a.q_norm, a.k_norm, a.eps, m.ref_plan,
                                 m.max_seq_len, a.k_scale, a.v_scale).reshape(q.shape[0], -1)


class PagedAttention(AttentionBackend):
    """Prefill chunks and decodes together on CUDA: `rotary_and_store_kv`, `paged_attention`."""

    __slots__ = ()

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        a, m = self.layers[layer], self.meta
        rotary_and_store_kv(q, k, v, positions, a.cos_sin, a.k, a.v, m.slot_mapping, a.q_norm, a.k_norm, a.eps,
                            a.k_scale, a.v_scale)
        return paged_attention(q, a.k, a.v, m.cu_seqlens_q, m.seq_lens, m.block_tables, a.scale, m.ref_plan,
                               m.max_q_len, m.max_seq_len, a.k_scale, a.v_scale).reshape(q.shape[0], -1)


class ReferenceAttention(AttentionBackend):
    """Every step on the CPU (or without Triton): the rotary dispatcher (its torch reference
    there) and the torch reference of paged attention with meta.ref_plan's gathers (built
    per layer when it is None). Reads every KV dtype (fp8_e4m3, int8: the layer's scales go
    to the write and the read, `kernels.kv_quant`); the CUDA backends read the model dtype,
    fp8_e4m3 and int8 (`kernels.kv_quant_triton`). On the CPU with `kernels.ref_fast.
    FEWER_OPS` the step's rotary factors are made once for all layers
    (`kernels.rotary.rope_factors`; docs/ARCHITECTURE.md §6.4 "CPU decode ops"). With
    `kernels.ref_fast.CPU_CXX_OPS` a decode-only step (one new token a sequence: the plan has
    decodes only) runs each layer whose `AttentionLayer.cxx` holds, with fp32 q, as one
    `kernels.cpu_decode.decode_attention` call (rotary, KV store, attention; q and k are left
    unrotated), where the extension is built; other layers and steps take the torch path."""

    __slots__ = ("cxx", "rope")

    def __init__(self, layers: Sequence[AttentionLayer], meta: AttentionMetadata):
        super().__init__(layers, meta)
        self.rope: tuple | None = None  # (cos_sin table, its rope_factors) of this step
        p = meta.ref_plan
        # the C++ ops' module for this step's decode attention, or None (the torch path)
        self.cxx = cpu_decode.extension() if (
            ref_fast.CPU_CXX_OPS and p is not None and p.dec_blocks is not None and p.dec_tokens is None
            and not p.prefills and meta.block_tables.device.type == "cpu" and meta.block_tables.dtype == torch.int32
            and meta.seq_lens.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64) else None

    def forward_qkv(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The base's; a C++ decode step's layer takes qkv whole (`kernels.cpu_decode.
        decode_attention_qkv`: no split, no views)."""
        a, cxx = self.layers[layer], self.cxx
        if cxx is not None and a.cxx and qkv.dtype == torch.float32 and qkv.dim() == 2 and qkv.stride(1) == 1:
            m = self.meta
            return cxx.decode_attention_qkv(qkv, a.heads, a.kv_heads, a.head_dim, positions, a.cos_sin, a.k, a.v,
                                            m.slot_mapping, m.block_tables, m.seq_lens, a.scale)
        return AttentionBackend.forward_qkv(self, layer, qkv, positions)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        a, m = self.layers[layer], self.meta
        cxx = self.cxx
        if cxx is not None and a.cxx and q.dtype == torch.float32:
            return cxx.decode_attention(q, k, v, positions, a.cos_sin, a.k, a.v, m.slot_mapping, m.block_tables,
                                        m.seq_lens, a.scale)
        if ref_fast.FEWER_OPS and not q.is_cuda and q.dtype == torch.float32:
            rope = self.rope
            if rope is None or rope[0] is not a.cos_sin:
                rope = self.rope = (a.cos_sin, rope_factors(a.cos_sin, positions))
            rotary_and_store_kv_ref(q, k, v, positions, a.cos_sin, a.k, a.v, m.slot_mapping, a.q_norm, a.k_norm,
                                    a.eps, a.k_scale, a.v_scale, rope[1])
        else:
            rotary_and_store_kv(q, k, v, positions, a.cos_sin, a.k, a.v, m.slot_mapping, a.q_norm, a.k_norm,
                                a.eps, a.k_scale, a.v_scale)
        return paged_attention_ref(q, a.k, a.v, m.cu_seqlens_q, m.seq_lens, m.block_tables, a.scale,
                                   m.ref_plan, a.k_scale, a.v_scale).reshape(q.shape[0], -1)


def select_backend(layers: Sequence[AttentionLayer], meta: AttentionMetadata, reference: bool) -> AttentionBackend:
    """The backend of one step: `ReferenceAttention` when `reference` (the runner's device
    runs the references), else `DecodeAttention` when every sequence has one new token
    (meta.max_q_len == 1), else `PagedAttention`."""
    if reference:
        return ReferenceAttention(layers, meta)
    if meta.max_q_len == 1:
        return DecodeAttention(layers, meta)
    return PagedAttention(layers, meta)
