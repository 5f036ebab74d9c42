"""Triton kernels of `kernels.attention` (the torch references and dispatchers live there;
this file is split off to keep each file near the 300-line mark of CONVENTIONS.md).

- `store_kv_triton`: one program per token copies its K and V rows to their cache slot
  (slot < 0 = padding row of a CUDA graph, skipped).
- `paged_attention_triton`: decode-only steps (every q_len == 1) run a split-K kernel in
  the manner of FlashDecoding (Dao et al. 2023): program (seq, kv_head, split) attends the
  G = num_heads / num_kv_heads query heads of one KV head (GQA: K/V are read once per KV
  head) over one partition of the context with an online softmax (Milakov & Gimelshein
  2018); the partitions are merged by their log-sum-exp (`kernels.decode_merge`): by the
  last program of each (seq, kv_head) to finish, in the kernel, with
  DECODE_DEFAULTS["fused_merge"] (off by default), or by a second kernel. Other steps run a varlen causal kernel in the
  manner of FlashAttention-2 (Dao 2023): program (query tile, seq, head) walks the key
  tiles up to its causal limit on top of the cached prefix.
  Keys are gathered token by token through the block table, so any block size works.
  Scores use exp2 with log2(e) folded into the scale. Dots take the cache dtype
  (bf16/fp16 on tensor cores; fp32 runs as tf32 on the GPU) and accumulate in fp32.
  An fp8_e4m3 cache (KV_QUANT 1, `kernels.kv_quant_triton`): the store quantizes with the
  layer's scales, the readers widen each tile exactly to q's dtype for the dots and apply
  the K scale to the scores and the V scale to the fp32 accumulator (docs/ARCHITECTURE.md §4.6).
  An int8 cache (KV_QUANT 2): the store quantizes each row per token and KV head and writes
  its scale; the readers widen the codes exactly, load each tile's per-key scales and put
  the K scales on the score columns, the V scales on the probabilities before P@V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_multi_query import MQ_DEFAULTS, fits_multi_query, multi_query_attention_triton
from kernels.decode_merge import (_finish_fused, _partition, _store_partial, fused_merge_constants,
                                  merge_counters, merge_splits, split_buffers)
from kernels.device_info import num_sms
from kernels.kv_int8_triton import int8_quantize, kv_pv, kv_row_scales, kv_scores
from kernels.kv_quant_triton import (KV_FP8, fp8_dot_code, fp8_dot_q, fp8_overrides, fp8_read_scale, kv_cast_store,
                                     kv_dot_tile, kv_load_dot_tile, kv_operands, kv_tile, word_order)
from kernels.pdl import launch_args, pdl_release, pdl_wait, use_pdl

_LOG2E = 1.4426950408889634
# decode kernel launch: block_n None = 64 (32 for head_dim > 128), splits None = decode_splits,
# num_stages None = Triton's default. Two stages: best or within 1% of it at b=256 (4.19 TB/s
# at 1K context) and b=64 mixed contexts (2.2x the default there), H200, kernel_sweep.py.
# prefetch_max_block_n: with PDL, tiles up to this many keys load their first tile before the
# wait (b=1 1K context, 28 layers in a graph: 32-key tiles 7.0 -> 6.1 us per layer; 64-key
# tiles 7.6 -> 11.3 us, their prefetched K and V tiles spill: gemv_sweep.py, H200).
# fused_merge: the last live split program of each (seq, kv_head) merges the partials itself,
# and a context in one live partition stores its output directly (`kernels.decode_merge.
# _finish_fused`), instead of a `_merge_kernel` launch after the kernel. Off (the launch) by
# default until measured: the earlier in-kernel merge measured slower on Qwen3-0.6B, this
# one is unmeasured (scripts/gpu_moe_check.sh ab; see kernels.rope_decode). min_split_tiles: a partition holds at least
# this many key tiles (short contexts then take fewer live splits; 1: as many as the grid).
# multi_query: steps of 2 .. a few queries per seq (verify steps) run the split-K kernel of
# `kernels.attention_multi_query` instead of the prefill kernel. programs_per_sm: the split
# count's target (`decode_splits`). fp8_dot: the dots' format over an fp8_e4m3 cache
# (`kernels.kv_quant_triton.FP8_DOTS`; ignored for other caches). maxnreg: a cap on the registers
# a thread (None: the compiler's choice), for occupancy: more programs an SM, at some spills.
DECODE_DEFAULTS: dict = {"block_n": None, "num_warps": 4, "num_stages": 2, "splits": None,
                         "prefetch_max_block_n": 32, "prefetch": None, "fused_merge": False,
                         "min_split_tiles": 1, "multi_query": True, "programs_per_sm": 4, "fp8_dot": "q",
                         "maxnreg": None}
# an fp8_e4m3 cache: overrides of DECODE_DEFAULTS (under the caller's decode_config) by the
# class of the launch, seqs x kv_heads below the SMs ("few") or not ("many")
# (`kernels.kv_quant_triton.fp8_overrides`; docs/ARCHITECTURE.md §4.6). Picked by
# benchmarks/kv_quant_attention.py --variants (H200, Llama-3.1-8B heads, one run, 27 variants;
# benchmarks/results/2026-12-02_h200_kv_quant_attention_variants.json): fp16 dots, 128-key
# tiles, 4 warps and one stage (no software pipelining) were best in every case, bf16 / fp8
# 1.06 / 1.04 at 8K / 32K batch 1 and 1.24 / 1.25 at batch 64; 3 stages 0.82-0.97, 8 warps
# 0.57-0.68, the "q" format (bf16 dots) 0.98-1.00, "fp16_bits" 0.98-1.17 at one stage.
# maxnreg 128 from the 2026-12-03 H200 sweep (benchmarks/kv_quant_attention.py --variants, Llama-3.1-8B's
# heads; bf16 time / fp8 time at 32K b1 / 32K b64 / 8K b1 / 8K b64): uncapped 1.02 / 1.26 / 1.07 / 1.24,
# capped at 128 registers 1.27 / 1.47 / 1.15 / 1.45 (uncapped, 195 a thread: 2 programs an SM)
_FP8_TILE: dict = {"fp8_dot": "fp16", "block_n": 128, "num_warps": 4, "num_stages": 1, "maxnreg": 128}
DECODE_FP8_DEFAULTS: dict = {"few": dict(_FP8_TILE), "many": dict(_FP8_TILE)}


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, sk_t, sk_h, sv_t, sv_h, sc_s, sc_h,
                     n_kv, head_dim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_QUANT: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        hh = tl.arange(0, BLOCK_H)[:, None]
        dd = tl.arange(0, BLOCK_D)[None, :]
        m = (hh < n_kv) & (dd < head_dim)
        k = tl.load(k_ptr + tok * sk_t + hh * sk_h + dd, mask=m)
        v = tl.load(v_ptr + tok * sv_t + hh * sv_h + dd, mask=m)
        if KV_QUANT == 1:
            k = kv_cast_store(k, tl.load(ks_ptr), KV_QUANT)
            v = kv_cast_store(v, tl.load(vs_ptr), KV_QUANT)
        if KV_QUANT == 2:  # each head's row quantized, its scale at [slot, head] (scales contiguous)
            k = tl.where(m, k, 0.0)
            v = tl.where(m, v, 0.0)
            k, k_s = int8_quantize(k)
            v, v_s = int8_quantize(v)
            hs = tl.arange(0, BLOCK_H)
            tl.store(ks_ptr + slot * n_kv + hs, k_s, mask=hs < n_kv)
            tl.store(vs_ptr + slot * n_kv + hs, v_s, mask=hs < n_kv)
        tl.store(kc_ptr + slot * sc_s + hh * sc_h + dd, k, mask=m)
        tl.store(vc_ptr + slot * sc_s + hh * sc_h + dd, v, mask=m)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Triton `store_kv_ref` (same shapes); k/v may be strided views with unit last stride.
    An fp8_e4m3 cache is written quantized with its layer's 0-d scales k_scale, v_scale; an
    int8 cache gets each token's K and V rows quantized per KV head as
    `kernels.kv_quant.quantize_int8` does (bit for bit) and their fp32 scales written into
    k_scale, v_scale [num_blocks, block_size, kv_heads] at the same slots
    (`kernels.kv_quant_triton.kv_operands`: errors there)."""
    t, kvh, d = k.shape
    kc, vc, ks, vs, quant = kv_operands(k_cache, v_cache, k_scale, v_scale)
    if t:
        _store_kv_kernel[(t,)](k, v, kc, vc, slot_mapping, ks, vs, k.stride(0), k.stride(1),
                               v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2), kvh, d,
                               BLOCK_H=triton.next_power_of_2(kvh), BLOCK_D=triton.next_power_of_2(d), KV_QUANT=quant)


@triton.jit
def _kv_offsets(bt_ptr, seq, s_bt, nn, nm, block_size, sc_b, sc_s, sc_h, kvh):
    """Element offsets [BLOCK_N] of the cache rows of tokens nn (valid where nm) of one
    sequence and KV head, through its block-table row (cache [blocks, block_size, heads, D]
    with strides sc_b, sc_s, sc_h)."""
    blk = tl.load(bt_ptr + seq * s_bt + nn // block_size, mask=nm, other=0).to(tl.int64)
    return blk * sc_b + (nn % block_size) * sc_s + kvh * sc_h


@triton.jit
def _attend_tile(q, k, v, nm, m_i, l_i, acc, qk_scale, ks, vs, KV_QUANT: tl.constexpr):
    """One key tile of the online softmax: q [BLOCK_G, D], k/v [BLOCK_N, D], nm the valid
    keys [BLOCK_N] (none valid in an empty partition: m stays -inf, l and acc 0); returns
    the updated (m_i, l_i, acc). ks, vs: an int8 cache's K and V scales of the tile's keys
    [BLOCK_N] (`kv_scores`, `kv_pv`; unused otherwise)."""
    return _attend_masked(q, k, v, nm[None, :], m_i, l_i, acc, qk_scale, ks, vs, KV_QUANT)


@triton.jit
def _attend_masked(q, k, v, valid, m_i, l_i, acc, qk_scale, ks, vs, KV_QUANT: tl.constexpr):
    """`_attend_tile` with the valid (row, key) pairs as a mask broadcastable to the scores
    [BLOCK_G, BLOCK_N]."""
    s = kv_scores(tl.dot(q, tl.trans(k)) * qk_scale, ks, KV_QUANT)
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + kv_pv(p, v, vs, KV_QUANT)
    return m_new, l_i, acc


@triton.jit
def _attend_range(q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, seq, s_bt, block_size, sc_b, sc_s, sc_h, kvh, dk, dv,
                  dmask, head_dim, lo, end, m_i, l_i, acc, qk_scale, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  KV_QUANT: tl.constexpr, FP8_DOT: tl.constexpr):
    """The key tiles lo, lo + BLOCK_N, .. below end of one sequence and KV head, gathered
    through its block table row: returns the updated (m_i, l_i, acc) of `_attend_tile`.
    KV_QUANT 1: the caches are e4m3 bytes, widened for the dots with q (`kv_load_dot_tile`, format
    FP8_DOT: K's way FP8_DOT % 8, V's FP8_DOT // 8, their columns dk and dv in `word_order`;
    their scales are the caller's). KV_QUANT 2: int8 codes widened to q's dtype (FP8_DOT 0),
    each tile's per-token scales loaded from ks_ptr, vs_ptr (`kv_row_scales`)."""
    for n0 in range(lo, end, BLOCK_N):
        nn = n0 + tl.arange(0, BLOCK_N)
        nm = nn < end
        off = _kv_offsets(bt_ptr, seq, s_bt, nn, nm, block_size, sc_b, sc_s, sc_h, kvh)
        k = kv_load_dot_tile(kc_ptr, off, nm, dk, dmask, head_dim, q, KV_QUANT, FP8_DOT % 8, BLOCK_N, BLOCK_D)
        v = kv_load_dot_tile(vc_ptr, off, nm, dv, dmask, head_dim, q, KV_QUANT, FP8_DOT // 8, BLOCK_N, BLOCK_D)
        ks = kv_row_scales(ks_ptr, off, nm, head_dim, KV_QUANT)
        vs = kv_row_scales(vs_ptr, off, nm, head_dim, KV_QUANT)
        m_i, l_i, acc = _attend_tile(q, k, v, nm, m_i, l_i, acc, qk_scale, ks, vs, KV_QUANT)
    return m_i, l_i, acc


# s_bt (the block tables' width) and n_splits (from the batch and the context) vary from step
# to step: not specialised, so eager steps compile no new variant (`kernels.attention_warmup`)
@triton.jit(do_not_specialize=["s_bt", "n_splits"])
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, seqlen_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr,
                   ks_ptr, vs_ptr, sq_t, sq_h, sc_b, sc_s, sc_h, s_bt, so_t, so_h, qk_scale, block_size,
                   n_splits, n_heads, head_dim, G: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   ONE_SPLIT: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr,
                   FUSED_MERGE: tl.constexpr, BLOCK_S: tl.constexpr, KV_QUANT: tl.constexpr,
                   MERGE_G: tl.constexpr, CHUNK_S: tl.constexpr, MIN_TILES: tl.constexpr,
                   FP8_DOT: tl.constexpr):
    # no program returns early: with FUSED_MERGE the live ones arrive on their (seq, kv_head)
    # counter in `_finish_fused` (after the PDL wait)
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if KV_QUANT == 1:  # the layer's K scale on the scores (its V scale on acc, below); set at load
        qk_scale = qk_scale * tl.load(ks_ptr)
    if not PREFETCH:
        pdl_wait(USE_PDL)
        pdl_release(USE_PDL)
    # seq_lens and block tables are host copies made before the step's first kernel; with
    # PREFETCH (PDL, small tiles) the first key tile of the older tokens is loaded before
    # the wait: the kernel before (the rotary + cache write) writes q and this step's
    # token's K/V only, reloaded after the wait
    seq_len = tl.load(seqlen_ptr + seq)
    # each sequence spreads its own context over the n_splits partitions (whole BLOCK_N
    # tiles), so the grid fixed at capture serves every context length fully
    partition, n_live = _partition(seq_len, n_splits, BLOCK_N, MIN_TILES)
    start = split * partition
    end = tl.minimum(start + partition, seq_len)
    gg = tl.arange(0, BLOCK_G)
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < head_dim
    # the columns of q and the K tiles, of the V tiles and the output (`word_order`)
    dk = word_order(dd, FP8_DOT % 8)
    dv = word_order(dd, FP8_DOT // 8)
    heads = kvh * G + gg
    if PREFETCH:
        nn = start + tl.arange(0, BLOCK_N)
        nm = nn < end
        off = _kv_offsets(bt_ptr, seq, s_bt, nn, nm, block_size, sc_b, sc_s, sc_h, kvh)
        old = (nm & (nn < seq_len - 1))[:, None] & dmask[None, :]
        k0 = tl.load(kc_ptr + off[:, None] + dk[None, :], mask=old, other=0)
        v0 = tl.load(vc_ptr + off[:, None] + dv[None, :], mask=old, other=0)
        ks0 = kv_row_scales(ks_ptr, off, nm & (nn < seq_len - 1), head_dim, KV_QUANT)  # int8's, 1.0 else
        vs0 = kv_row_scales(vs_ptr, off, nm & (nn < seq_len - 1), head_dim, KV_QUANT)
        pdl_wait(USE_PDL)
        pdl_release(USE_PDL)
    q = tl.load(q_ptr + seq * sq_t + heads[:, None] * sq_h + dk[None, :],
                mask=(gg < G)[:, None] & dmask[None, :], other=0.0)
    # an fp8 cache: q in the dots' format, its scaling and the widening's undone on the scores
    q, q_undo = fp8_dot_q(q, KV_QUANT, FP8_DOT)
    qk_scale = qk_scale * (q_undo * fp8_read_scale(KV_QUANT, FP8_DOT % 8))
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lo = start
    if PREFETCH:
        new = (nm & (nn == seq_len - 1))[:, None] & dmask[None, :]
        k0 = tl.where(new, tl.load(kc_ptr + off[:, None] + dk[None, :], mask=new, other=0), k0)
        v0 = tl.where(new, tl.load(vc_ptr + off[:, None] + dv[None, :], mask=new, other=0), v0)
        if KV_QUANT == 2:  # the step's token's scales, written by the kernel before
            last_row = nm & (nn == seq_len - 1)
            ks0 = tl.where(last_row, kv_row_scales(ks_ptr, off, last_row, head_dim, KV_QUANT), ks0)
            vs0 = tl.where(last_row, kv_row_scales(vs_ptr, off, last_row, head_dim, KV_QUANT), vs0)
        m_i, l_i, acc = _attend_tile(q, kv_dot_tile(k0, q, KV_QUANT, FP8_DOT % 8), kv_dot_tile(v0, q, KV_QUANT, FP8_DOT // 8),
                                     nm, m_i, l_i, acc, qk_scale, ks0, vs0, KV_QUANT)
        lo = start + BLOCK_N
    m_i, l_i, acc = _attend_range(q, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, seq, s_bt, block_size, sc_b, sc_s, sc_h,
                                  kvh, dk, dv, dmask, head_dim, lo, end, m_i, l_i, acc, qk_scale, BLOCK_N, BLOCK_D, KV_QUANT,
                                  FP8_DOT)
    if KV_QUANT == 1:  # fp32 partial times the V scale (and the widening's factor), before the split merge
        acc = acc * (tl.load(vs_ptr) * fp8_read_scale(KV_QUANT, FP8_DOT // 8))
    if FUSED_MERGE:  # (never with ONE_SPLIT)
        _finish_fused(m_i, l_i, acc, out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr, seq, kvh, heads, gg, dv, dmask,
                      so_t, so_h, n_heads, n_splits, split, n_live, head_dim, G, MERGE_G, BLOCK_S, CHUNK_S, BLOCK_D)
    else:
        _store_partial(m_i, l_i, acc, out_ptr, m_ptr, l_ptr, acc_ptr, seq, heads, gg, dv, dmask, so_t, so_h,
                       n_heads, n_splits, split, head_dim, G, ONE_SPLIT)


@triton.jit(do_not_specialize=["s_bt"])
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, cu_ptr, seqlen_ptr, out_ptr, ks_ptr, vs_ptr,
                    sq_t, sq_h, sc_b, sc_s, sc_h, s_bt, so_t, so_h, qk_scale, block_size,
                    head_dim, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, KV_QUANT: tl.constexpr):
    mblk = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    if mblk * BLOCK_M >= q_len:
        return
    kvh = h // G
    if KV_QUANT == 1:  # the layer's K scale on the scores, its V scale on the output
        qk_scale = qk_scale * tl.load(ks_ptr)
    seq_len = tl.load(seqlen_ptr + seq)
    ctx = seq_len - q_len  # cached prefix before this chunk
    mm = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < head_dim
    rows = (q_start + mm).to(tl.int64)
    qmask = (mm < q_len)[:, None] & dmask[None, :]
    q = tl.load(q_ptr + rows[:, None] * sq_t + h * sq_h + dd[None, :], mask=qmask, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(seq_len, ctx + (mblk + 1) * BLOCK_M)
    for n0 in range(0, hi, BLOCK_N):
        nn = n0 + tl.arange(0, BLOCK_N)
        nm = nn < seq_len
        off = _kv_offsets(bt_ptr, seq, s_bt, nn, nm, block_size, sc_b, sc_s, sc_h, kvh)
        kv_mask = nm[:, None] & dmask[None, :]
        k = kv_tile(tl.load(kc_ptr + off[:, None] + dd[None, :], mask=kv_mask, other=0), q, KV_QUANT)
        s = kv_scores(tl.dot(q, tl.trans(k)) * qk_scale, kv_row_scales(ks_ptr, off, nm, head_dim, KV_QUANT), KV_QUANT)
        visible = (nn[None, :] <= (ctx + mm)[:, None]) & nm[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = kv_tile(tl.load(vc_ptr + off[:, None] + dd[None, :], mask=kv_mask, other=0), q, KV_QUANT)
        acc = acc * alpha[:, None] + kv_pv(p, v, kv_row_scales(vs_ptr, off, nm, head_dim, KV_QUANT), KV_QUANT)
        m_i = m_new
    if KV_QUANT == 1:
        acc = acc * tl.load(vs_ptr)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + rows[:, None] * so_t + h * so_h + dd[None, :], o.to(out_ptr.dtype.element_ty),
             mask=qmask)


def _prefetch(dc: dict, pdl: bool, block_n: int) -> bool:
    """Whether a decode kernel loads its first key tile before its PDL wait: dc["prefetch"]
    when set (True is valid without PDL too; the tests force it under the interpreter),
    else with PDL for tiles of at most dc["prefetch_max_block_n"] keys."""
    if dc.get("prefetch") is not None:
        return bool(dc["prefetch"])
    return pdl and block_n <= dc["prefetch_max_block_n"]


def decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                  block_n: int = 64, programs_per_sm: int = 4) -> int:
    """Number of split-K partitions of the decode: about programs_per_sm programs per SM, at
    most one per block_n tile of max_seq_len. Depends only on host ints, so a CUDA graph captured
    with max_seq_len = max_model_len stays valid for every shorter context; the kernel
    sizes each sequence's partitions from its own length (on the device), so a short
    context still uses every split (round 1 sized them by max_seq_len: a 1K context in a
    graph captured for 4K used a quarter of the grid)."""
    n_tiles = max(1, triton.cdiv(max_seq_len, block_n))
    return max(1, min(n_tiles, triton.cdiv(programs_per_sm * num_sms(device), num_seqs * num_kv_heads)))


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, scale: float, max_q_len: int | None = None,
                           max_seq_len: int | None = None, decode_config: dict | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton `paged_attention_ref` (same shapes and meaning), all index tensors on q's device.

    max_q_len, max_seq_len: host-side bounds of the step's query and sequence lengths (the
        model runner knows them); None reads them from the tensors (a device sync). The
        decode kernel runs when max_q_len == 1, the multi-query one (`kernels.attention_multi_query`)
        for a few queries per seq (verify steps), the prefill kernel otherwise. A larger max_seq_len than the true one is
        valid (CUDA graphs pass max_model_len): empty partitions exit at once.
    decode_config: overrides of the decode kernel's launch (keys of `DECODE_DEFAULTS`), for
        the benchmarks and tests; None = `DECODE_DEFAULTS` (and for an fp8 cache
        `DECODE_FP8_DEFAULTS` over them). Its keys of `MQ_DEFAULTS` (block_n, num_warps,
        num_stages, splits, fused_merge) also set the multi-query kernel's launch, over
        `MQ_DEFAULTS`.
    k_scale, v_scale: an fp8_e4m3 cache's 0-d fp32 layer scales, or an int8 cache's fp32 per-token
        scales [num_blocks, block_size, num_kv_heads] (`kernels.kv_quant_triton`; every kernel
        here reads int8: the codes widened to q's dtype, the scales on the score and probability
        columns).
    Raises ValueError if num_heads is not a multiple of num_kv_heads, or for an unknown
    fp8_dot, and as `kv_operands`.
    """
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    if h % kvh:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {kvh}")
    g = h // kvh
    b = seq_lens.shape[0]
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if b else 0
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if b else 0
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0 or max_seq_len == 0:
        return out
    qk_scale = scale * _LOG2E
    bd = triton.next_power_of_2(d)
    kc, vc, ks, vs, quant = kv_operands(k_cache, v_cache, k_scale, v_scale)
    fp8 = quant == KV_FP8
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               block_tables.stride(0), out.stride(0), out.stride(1))
    if max_q_len == 1:
        dc = {**DECODE_DEFAULTS, **(fp8_overrides(DECODE_FP8_DEFAULTS, b, kvh, d, q.device) if fp8 else {}),
              **(decode_config or {})}
        fp8_dot = fp8_dot_code(dc["fp8_dot"], kc, d, fp8)
        block_n = dc["block_n"] or (64 if bd <= 128 else 32)
        splits = dc["splits"] or decode_splits(b, kvh, max_seq_len, q.device, block_n, dc["programs_per_sm"])
        pdl = use_pdl(q.device)
        m, l_, acc = split_buffers(out, splits)
        cnt = merge_counters(out, kvh, splits, dc["fused_merge"])
        _decode_kernel[(b, kvh, splits)](q, kc, vc, block_tables, seq_lens, out, m, l_, acc,
                                         out if cnt is None else cnt, ks, vs,
                                         *strides, qk_scale, k_cache.shape[1], splits, h, d,
                                         G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_N=block_n,
                                         BLOCK_D=bd, ONE_SPLIT=splits == 1, USE_PDL=pdl,
                                         PREFETCH=_prefetch(dc, pdl, block_n), FUSED_MERGE=cnt is not None,
                                         KV_QUANT=quant, MIN_TILES=dc["min_split_tiles"],
                                         **fused_merge_constants(h, kvh, d, splits, cnt is not None),
                                         FP8_DOT=fp8_dot,
                                         num_warps=dc["num_warps"],
                                         **({"num_stages": dc["num_stages"]} if dc["num_stages"] else {}),
                                         **({"maxnreg": dc["maxnreg"]} if dc["maxnreg"] else {}),
                                         **launch_args(pdl))
        merge_splits(m, l_, acc, out, splits, pdl, cnt)
        return out
    if {**DECODE_DEFAULTS, **(decode_config or {})}["multi_query"] and fits_multi_query(max_q_len, h, kvh):
        return multi_query_attention_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                                            max_q_len, max_seq_len, num_sms(q.device),
                                            {k: v for k, v in (decode_config or {}).items() if k in MQ_DEFAULTS},
                                            k_scale, v_scale)
    block_m, block_n = (64, 64) if bd <= 128 else (32, 32)
    _prefill_kernel[(triton.cdiv(max_q_len, block_m), b, h)](
        q, kc, vc, block_tables, cu_seqlens_q, seq_lens, out, ks, vs, *strides, qk_scale,
        k_cache.shape[1], d, G=g, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=bd, KV_QUANT=quant, num_warps=4)
    return out
