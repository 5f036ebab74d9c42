"""Paged attention over the paged KV cache, for prefill chunks and decodes in one batch.

KV cache layout (docs/ARCHITECTURE.md §4), per layer: k_cache, v_cache [num_blocks, block_size,
num_kv_heads, head_dim]. Token position p of a sequence lives in slot
block_table[p // block_size] * block_size + p % block_size.

A step's tokens are flattened: sequence i owns query tokens cu_seqlens_q[i] ..
cu_seqlens_q[i+1]-1, which sit at the last q_len positions of its seq_lens[i] cached
tokens (the KV of the new tokens is stored first with `store_kv`). Query token j of
sequence i sees cache positions 0 .. seq_lens[i] - q_len + j (causal on top of the
cached prefix).

Dispatchers `store_kv` and `paged_attention` pick the torch references on the CPU and the
Triton kernels of `kernels.attention_triton` on CUDA tensors when Triton imports. The reference gathers each sequence's KV blocks into a contiguous tensor and calls
torch SDPA: decodes (q_len == 1) as one batch with the query heads grouped by KV head
(GQA without copying K/V per query head), prefill chunks and verify suffixes one sequence
at a time, as 4-D tensors (a batch of 1: torch's CPU flash kernel takes only those; 3-D
inputs fall to its math path, ~3x slower for a 5-token suffix over 200 cached keys). The
index work that does not depend on the layer is done once per step in `RefAttentionPlan`.
A quantized KV cache (fp8_e4m3, int8: `kernels.kv_quant`, the layer's scales passed as
k_scale / v_scale): the references dequantize blocks to fp32 as they are gathered and run
the attention in fp32; on CUDA fp8_e4m3 and int8 caches go to the Triton kernels
(`kernels.kv_quant_triton`: quantized on write, widened and scaled on read, fp32
accumulation; tests/gpu/test_fp8_kv_gpu.py and test_int8_kv_gpu.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels import ref_fast
from kernels.kv_quant import gather_dequantized, store_quantized

store_kv_triton: Callable[..., None] | None  # store_kv_ref's signature
paged_attention_triton: Callable[..., torch.Tensor] | None  # paged_attention_ref's, `plan` -> max_q_len, max_seq_len
try:  # the Triton kernels (CUDA); CPU-only installs keep the references
    from kernels.attention_triton import paged_attention_triton, store_kv_triton
except ImportError:
    store_kv_triton = paged_attention_triton = None


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """Write new keys and values into the cache, in place.

    k, v: [num_tokens, num_kv_heads, head_dim], the cache's dtype (any float dtype for a
        quantized cache).
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
    slot_mapping: [num_tokens] int64, every slot in [0, num_blocks * block_size).
    k_scale, v_scale: the layer's scales of a quantized cache (float8_e4m3fn or int8 k_cache;
        `kernels.kv_quant.store_quantized` quantizes, and writes int8's per-token scales);
        None for a cache in the model dtype.
    """
    if k_scale is not None and v_scale is not None:
        store_quantized(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)


# the cache dtypes every Triton kernel that writes or reads the paged KV cache takes (the store,
# the rotary + store, decode, multi-query, prefill and the fused rotary decode; int8 since issue
# 17's int8 work, tests/gpu/test_int8_kv_gpu.py)
TRITON_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8)


def triton_reads(k_cache: torch.Tensor) -> bool:
    """Whether the Triton kernels read and write a cache of k_cache's dtype (TRITON_KV_DTYPES:
    a model dtype, float8_e4m3fn or int8)."""
    return k_cache.dtype in TRITON_KV_DTYPES


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Dispatcher for `store_kv_ref` (see there for shapes): the Triton kernel on CUDA for a
    cache in the model dtype, fp8_e4m3 (with its layer's scales) or int8 (per-token scales
    written), the reference otherwise."""
    if k.is_cuda and store_kv_triton is not None and triton_reads(k_cache):
        return store_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


@dataclass
class _Prefill:
    start: int  # first query token in the flattened batch
    end: int  # one past the last query token
    blocks: torch.Tensor  # [ceil(seq_len / block_size)] int64, the sequence's blocks
    mask: torch.Tensor | None  # [q_len, num_blocks * block_size] bool (True = attend);
    # None = causal from position 0 (SDPA's top-left `is_causal` also hides the padding)
    prefix: int = 0  # cached tokens before the chunk (seq_len - q_len)


@dataclass
class RefAttentionPlan:
    """Layer-independent index work of `paged_attention_ref` for one step.

    Built once per step by `build_ref_plan`; every layer reuses it. K/V are gathered by
    whole blocks (a contiguous block_size * num_kv_heads * head_dim copy each), and the
    positions past a sequence's end are masked.
    """

    num_tokens: int
    dec_tokens: torch.Tensor | None = None  # [num_decodes] int64 token rows; None = all rows
    dec_blocks: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    dec_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    prefills: list[_Prefill] = field(default_factory=list)
    # ref_fast.FEWER_OPS: the first block of a lone decode whose blocks are consecutive ids (its
    # gather is a slice of the cache), and dec_mask as SDPA's additive float mask per dtype
    dec_first: int | None = None
    dec_mask_float: dict = field(default_factory=dict)

    def decode_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """dec_mask for SDPA: the bool mask itself, or with `ref_fast.FEWER_OPS` its additive
        form in `dtype` (0 where seen, -inf where not: what SDPA's CPU path turns a bool mask
        into on every call, `where(mask, 0, -inf)`), made once per step and dtype."""
        m = self.dec_mask
        if m is None or not ref_fast.FEWER_OPS or m.device.type != "cpu":  # CPU SDPA's conversion
            return m
        f = self.dec_mask_float.get(dtype)
        if f is None:
            f = self.dec_mask_float[dtype] = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(
                ~m, float("-inf"))
        return f


# A prefill chunk after a cached prefix, of at least SPLIT_MIN_Q queries, runs as two CPU
# flash-attention calls without a mask, merged by their log-sum-exp: the queries over the
# prefix (all visible) and over the chunk itself (causal, so the kernel skips the blocks above
# the diagonal). One masked call computes every (query, key) block and reads the mask too:
# 122 -> 91 ms for 1024 queries over 3072 keys, 9 heads of 64, one thread (probe, 2-core VM).
# Shorter chunks (verify suffixes) keep the masked call.
SPLIT_MIN_Q = 64
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _prefix_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, g: int,
                        scale: float) -> torch.Tensor:
    """Attention of a chunk's queries q [h, L, d] over keys k, v [kvh, >= prefix + L, d]
    (the sequence's gathered blocks: the prefix's `prefix` tokens, then the chunk's L, then
    padding): softmax over the prefix (no mask) and over the chunk (causal), merged with the
    log-sum-exp of each part (the FlashAttention merge, Dao et al. 2022). Returns [h, L, d]
    in q's dtype."""
    n = q.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)
    assert _FLASH_CPU is not None
    o1, l1 = _FLASH_CPU(q[None], k[None, :, :prefix], v[None, :, :prefix], 0.0, False, scale=scale)[:2]
    o2, l2 = _FLASH_CPU(q[None], k[None, :, prefix:prefix + n], v[None, :, prefix:prefix + n], 0.0, True,
                        scale=scale)[:2]
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp(), (l2 - m).exp()
    o = (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
    return o[0].to(q.dtype)


def build_ref_plan(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   block_size: int) -> RefAttentionPlan:
    """Precompute gather indices and masks for `paged_attention_ref`.

    cu_seqlens_q: [num_seqs + 1] int32, query token offsets (cu_seqlens_q[0] = 0).
    seq_lens: [num_seqs] int32, cached tokens of each sequence including this step's.
    block_tables: [num_seqs, max_blocks] int32, -1 past each table's end; must cover
        seq_lens[i] tokens. The plan's tensors live on block_tables' device (pass
        cu_seqlens_q and seq_lens on the CPU to avoid device syncs).
    Raises ValueError if a query is longer than its sequence.
    """
    dev = block_tables.device
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(cu, cu[1:])]
    if any(q > s for q, s in zip(q_lens, lens)):
        raise ValueError(f"query longer than its sequence: q_lens={q_lens}, seq_lens={lens}")
    plan = RefAttentionPlan(num_tokens=cu[-1])
    tables = block_tables.long().clamp(min=0)  # -1 -> block 0: finite values, masked below
    dec = [i for i, q in enumerate(q_lens) if q == 1]
    if dec:
        nb = -(-max(lens[i] for i in dec) // block_size)
        idx = torch.tensor(dec, dtype=torch.long, device=dev) if len(dec) != len(q_lens) else None
        plan.dec_blocks = (tables if idx is None else tables[idx])[:, :nb].contiguous()
        if idx is not None:
            plan.dec_tokens = torch.tensor([cu[i] for i in dec], dtype=torch.long, device=dev)
        if any(lens[i] != nb * block_size for i in dec):
            dl = torch.tensor([lens[i] for i in dec], dtype=torch.long, device=dev)
            plan.dec_mask = (torch.arange(nb * block_size, device=dev) < dl[:, None])[:, None, None, :]
        if ref_fast.FEWER_OPS and len(dec) == 1 and idx is None and dev.type == "cpu":
            row = plan.dec_blocks[0].tolist()
            if row == list(range(row[0], row[0] + nb)):
                plan.dec_first = row[0]
    for i, q in enumerate(q_lens):
        if q <= 1:
            continue
        s = lens[i]
        nb = -(-s // block_size)
        mask = None
        if q != s:  # cached prefix: query j sees keys 0 .. s - q + j
            keys = torch.arange(nb * block_size, device=dev)
            mask = keys[None, :] <= (s - q + torch.arange(q, device=dev))[:, None]
        plan.prefills.append(_Prefill(cu[i], cu[i + 1], tables[i, :nb].contiguous(), mask, s - q))
    return plan


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, scale: float,
                        plan: RefAttentionPlan | None = None, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a step's query tokens over their sequences' paged KV.

    q: [num_tokens, num_heads, head_dim] (fp32/bf16/fp16).
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype, already
        holding this step's keys and values; or a quantized cache (float8_e4m3fn or int8)
        with its k_scale, v_scale (`kernels.kv_quant`): the gathered blocks are dequantized
        to fp32 and the attention runs in fp32 (q cast up, the output cast back to q's dtype).
    cu_seqlens_q, seq_lens, block_tables: see `build_ref_plan`.
    scale: softmax scale (usually head_dim ** -0.5).
    plan: the step's `build_ref_plan` result; built here when None.
    Returns [num_tokens, num_heads, head_dim], q's dtype.
    Raises ValueError if num_heads is not a multiple of num_kv_heads.
    """
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    if h % kvh:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {kvh}")
    g = h // kvh
    if plan is None:
        plan = build_ref_plan(cu_seqlens_q, seq_lens, block_tables, k_cache.shape[1])
    if k_scale is not None and v_scale is not None:
        def gather_k(blocks: torch.Tensor) -> torch.Tensor:
            return gather_dequantized(k_cache, k_scale, blocks)

        def gather_v(blocks: torch.Tensor) -> torch.Tensor:
            return gather_dequantized(v_cache, v_scale, blocks)
        q_in, q = q, q.float()
    else:
        def gather_k(blocks: torch.Tensor) -> torch.Tensor:
            return k_cache.index_select(0, blocks)

        def gather_v(blocks: torch.Tensor) -> torch.Tensor:
            return v_cache.index_select(0, blocks)
        q_in = q
    if plan.dec_blocks is not None and plan.dec_tokens is None and not plan.prefills:
        first = plan.dec_first
        if first is not None and ref_fast.FEWER_OPS and k_scale is None and k_cache.is_contiguous() \
                and v_cache.is_contiguous():
            # consecutive blocks: K and V as [1, kvh, S, d] views of the caches, one as_strided each
            # (the strides of the gathered copy's view and transpose in `_decode`)
            nb, bs = plan.dec_blocks.shape[1], k_cache.shape[1]
            size, stride = (1, kvh, nb * bs, d), (nb * bs * kvh * d, d, kvh * d, 1)
            off = first * bs * kvh * d  # as_strided's offset counts from the storage's start
            k = k_cache.as_strided(size, stride, k_cache.storage_offset() + off)
            v = v_cache.as_strided(size, stride, v_cache.storage_offset() + off)
            o = F.scaled_dot_product_attention(q.view(1, kvh, g, d), k, v, attn_mask=plan.decode_mask(q.dtype),
                                               scale=scale)
            return o.reshape(1, h, d)
        return _decode(q, gather_k, gather_v, plan, g, scale).to(q_in.dtype)  # decode-only step: no scatter
    out = torch.empty_like(q)
    if plan.dec_blocks is not None:
        qd = q.index_select(0, plan.dec_tokens) if plan.dec_tokens is not None else q
        od = _decode(qd, gather_k, gather_v, plan, g, scale)
        if plan.dec_tokens is None:
            out.copy_(od)
        else:
            out.index_copy_(0, plan.dec_tokens, od)
    for p in plan.prefills:
        k = gather_k(p.blocks).view(-1, kvh, d).transpose(0, 1)  # [kvh, S, d]
        v = gather_v(p.blocks).view(-1, kvh, d).transpose(0, 1)
        qp = q[p.start:p.end].transpose(0, 1)  # [h, q_len, d]
        if p.prefix and p.end - p.start >= SPLIT_MIN_Q and _FLASH_CPU is not None and qp.device.type == "cpu":
            out[p.start:p.end] = _prefix_then_causal(qp, k, v, p.prefix, g, scale).transpose(0, 1)
            continue
        # 4-D (a batch of 1): torch's CPU flash kernel takes 4-D inputs only, with the mask
        # and GQA; 3-D ones fall to the math path (~3x slower for a 5-token verify suffix)
        o = F.scaled_dot_product_attention(qp[None], k[None], v[None], attn_mask=p.mask,
                                           is_causal=p.mask is None, scale=scale, enable_gqa=g > 1)
        out[p.start:p.end] = o[0].transpose(0, 1)
    return out if out.dtype == q_in.dtype else out.to(q_in.dtype)


def _decode(q, gather_k: Callable[[torch.Tensor], torch.Tensor], gather_v: Callable[[torch.Tensor], torch.Tensor],
            plan: RefAttentionPlan, g: int, scale: float) -> torch.Tensor:
    """One query per sequence; query heads grouped by KV head: [b, kvh, g, d] x [b, kvh, S, d].
    gather_k, gather_v: block ids [n] -> [n, block_size, kvh, d] in q's dtype."""
    b, h, d = q.shape
    kvh = h // g
    assert plan.dec_blocks is not None  # the plan has decodes
    blocks = plan.dec_blocks.reshape(-1)
    k = gather_k(blocks).view(b, -1, kvh, d).transpose(1, 2)
    v = gather_v(blocks).view(b, -1, kvh, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.view(b, kvh, g, d), k, v, attn_mask=plan.decode_mask(q.dtype),
                                       scale=scale)
    return o.reshape(b, h, d)


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                    plan: RefAttentionPlan | None = None, max_q_len: int | None = None,
                    max_seq_len: int | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatcher for `paged_attention_ref` (see there for shapes). max_q_len, max_seq_len:
    host-side bounds for the Triton kernel (None: read from the tensors, a device sync).
    k_scale, v_scale: a quantized cache's scales (fp8_e4m3 and int8 go to the Triton kernels on
    CUDA, `triton_reads`)."""
    if q.is_cuda and paged_attention_triton is not None and plan is None and triton_reads(k_cache):
        return paged_attention_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens,
                                      block_tables, scale, max_q_len, max_seq_len, None, k_scale, v_scale)
    return paged_attention_ref(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                               scale, plan, k_scale, v_scale)
