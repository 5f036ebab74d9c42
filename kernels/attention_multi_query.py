"""Split-K paged attention for a few queries per sequence: the verify step of speculative
decoding (docs/ARCHITECTURE.md §5.5), where each sequence runs 1 + k queries (its last token
and k drafts) on top of a long cached context.

The varlen prefill kernel of `kernels.attention_triton` tiles the queries (64 a tile) and
gives each (query tile, seq, head) one program walking the whole context: at batch 1 and
1 + k = 5 queries that is 16 programs for the Qwen3-0.6B shape, an idle GPU (profiled on the
H200: 1.37 ms of a 2.5 ms verify step against 0.41 ms of decode attention). This kernel
reuses the decode kernel's layout instead (FlashDecoding, Dao et al. 2023): program
(seq, kv_head, split) attends the Q x G rows (the seq's queries times the query heads of one
KV head, GQA: K/V read once per KV head) over one partition of the context with an online
softmax (Milakov & Gimelshein 2018), each row masked causally at its own position; the
partitions are merged by their log-sum-exp (`kernels.decode_merge`): by a second launch
(`_merge_kernel`, whose rows are the step's token rows here), or with MQ_DEFAULTS
"fused_merge" in the kernel by the last live split program of each (seq, kv_head), which
merges all q_len x G rows of the program (`_finish_rows`, as the decode kernels do; a
context in one live partition stores its output directly). Each seq sizes its partitions
from its own seq_len on the device (`_partition`), so a grid fixed at capture for
max_model_len serves a shorter context with all its splits.

Row r of a program is query r // G (of the seq's q_len <= Q) and head kv_head * G + r % G.
Every token row of q must belong to a sequence (cu_seqlens_q covers [0, T)): rows outside
are left unwritten, as with the prefill kernel.

An fp8_e4m3 cache (KV_QUANT 1) is read as the decode kernel reads it (`kernels.kv_quant_triton`):
tiles widened exactly to q's dtype, the K scale on the scores, the V scale on the fp32
accumulator before the partial is stored. An int8 cache (KV_QUANT 2): the codes widened
exactly to q's dtype, each key's K scale on its score column (`kv_scores`) and its V scale on
its probability column before the P@V dot (`kv_pv`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.decode_merge import (_finish_rows, _partition, _store_rows, fused_merge_constants, merge_counters,
                                  merge_splits, split_buffers)
from kernels.kv_int8_triton import kv_pv, kv_row_scales, kv_scores
from kernels.kv_quant_triton import kv_operands, kv_tile
from kernels.pdl import launch_args, pdl_release, pdl_wait, use_pdl

# rows (queries x heads of one KV head) of one program at most: beyond, the prefill kernel
MAX_ROWS = 64
# key tile: 64 keys (32 for head_dim > 128), as the decode kernel. fused_merge: the last live
# split program of each (seq, kv_head) merges the partials of its q_len x G rows itself, and a
# context in one live partition stores its output directly (`kernels.decode_merge._finish_rows`),
# instead of the `_merge_kernel` launch after the kernel (split-K merges took 264 us of a
# Qwen3-0.6B verify step's kernels on the H200, 28 layers, docs/ARCHITECTURE.md §5.5). Off (the launch) by default:
# slower at batch 1 on an H100 (verify k = 4: 1.42 -> 1.58 ms; batch 8 2.04 -> 2.09, batch 32
# 3.43 -> 3.39; scripts/gpu_mqfuse.sh, 2026-12-07). Passed through `paged_attention_triton`'s
# decode_config under the same key as the decode kernel's.
MQ_DEFAULTS: dict = {"block_n": None, "num_warps": 4, "num_stages": 2, "splits": None, "fused_merge": False}


# s_bt and n_splits vary from step to step: not specialised (`kernels.attention_warmup`)
@triton.jit(do_not_specialize=["s_bt", "n_splits"])
def _multi_query_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, cu_ptr, seqlen_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr,
                        ks_ptr, vs_ptr, sq_t, sq_h, sc_b, sc_s, sc_h, s_bt, so_t, so_h, qk_scale, block_size,
                        n_splits, n_heads, head_dim, G: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ONE_SPLIT: tl.constexpr,
                        USE_PDL: tl.constexpr, KV_QUANT: tl.constexpr, FUSED_MERGE: tl.constexpr,
                        MERGE_G: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr):
    # no program returns early: with FUSED_MERGE the live ones arrive on their (seq, kv_head)
    # counter in `_finish_rows` (after the PDL wait)
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    if KV_QUANT == 1:  # the layer's K scale on the scores (its V scale on acc, below)
        qk_scale = qk_scale * tl.load(ks_ptr)
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    seq_len = tl.load(seqlen_ptr + seq)
    ctx = seq_len - q_len  # cached tokens before this step's queries
    # each seq spreads its own context over the n_splits partitions (whole BLOCK_N tiles), so
    # a grid fixed at capture for max_model_len serves every shorter context fully
    partition, n_live = _partition(seq_len, n_splits, BLOCK_N, 1)
    start = split * partition
    end = tl.minimum(start + partition, seq_len)
    rr = tl.arange(0, BLOCK_R)
    qi = rr // G
    heads = kvh * G + rr % G
    rmask = qi < q_len
    tok = (q_start + qi).to(tl.int64)
    limit = ctx + qi  # the last key each row sees (causal)
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < head_dim
    qm = rmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + tok[:, None] * sq_t + heads[:, None] * sq_h + dd[None, :], mask=qm, other=0.0)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        nn = n0 + tl.arange(0, BLOCK_N)
        nm = nn < end
        blk = tl.load(bt_ptr + seq * s_bt + nn // block_size, mask=nm, other=0).to(tl.int64)
        off = blk * sc_b + (nn % block_size) * sc_s + kvh * sc_h
        kv_mask = nm[:, None] & dmask[None, :]
        k = kv_tile(tl.load(kc_ptr + off[:, None] + dd[None, :], mask=kv_mask, other=0), q, KV_QUANT)
        v = kv_tile(tl.load(vc_ptr + off[:, None] + dd[None, :], mask=kv_mask, other=0), q, KV_QUANT)
        s = kv_scores(tl.dot(q, tl.trans(k)) * qk_scale, kv_row_scales(ks_ptr, off, nm, head_dim, KV_QUANT), KV_QUANT)
        s = tl.where(nm[None, :] & (nn[None, :] <= limit[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + kv_pv(p, v, kv_row_scales(vs_ptr, off, nm, head_dim, KV_QUANT), KV_QUANT)
        m_i = m_new
    if KV_QUANT == 1:
        acc = acc * tl.load(vs_ptr)
    # the rows' out offsets and partial rows (`kernels.decode_merge`, indexed by token row)
    orow = tok * so_t + heads * so_h
    prow = (tok * n_heads + heads) * n_splits
    if FUSED_MERGE:  # (never with ONE_SPLIT) the last live program merges all q_len x G rows
        _finish_rows(m_i, l_i, acc, out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr, seq, kvh, orow, prow, rmask,
                     q_start.to(tl.int64), q_len * G, dd, dmask, so_t, so_h, n_heads, n_splits, split, n_live, head_dim, G, MERGE_G,
                     BLOCK_S, CHUNK_S, BLOCK_D)
    else:
        _store_rows(m_i, l_i, acc, out_ptr, m_ptr, l_ptr, acc_ptr, orow, prow, rmask, dd, dmask, split, head_dim,
                    ONE_SPLIT)


def multi_query_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, sms: int, block_n: int) -> int:
    """Split-K partitions: about four programs per SM (sms: the device's multiprocessors), at
    most one per block_n tile of max_seq_len; host ints only, so a CUDA graph captured at
    max_model_len serves every shorter context (each seq sizes its partitions from its own
    length on the device), as `kernels.attention_triton.decode_splits`."""
    n_tiles = max(1, triton.cdiv(max_seq_len, block_n))
    return max(1, min(n_tiles, triton.cdiv(4 * sms, num_seqs * num_kv_heads)))


def fits_multi_query(max_q_len: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether a step of at most max_q_len queries a sequence runs this kernel: 1 < max_q_len
    and max_q_len x (num_heads / num_kv_heads) rows fit one program (MAX_ROWS)."""
    return 1 < max_q_len and max_q_len * (num_heads // num_kv_heads) <= MAX_ROWS


def multi_query_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                                 scale: float, max_q_len: int, max_seq_len: int, sms: int,
                                 config: dict | None = None, k_scale: torch.Tensor | None = None,
                                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal paged attention of q [T, H, D] (T = cu_seqlens_q[-1], each seq's queries the last
    q_len of its seq_lens tokens, their K/V already in the cache) over k_cache / v_cache
    [num_blocks, block_size, KVH, D] through block_tables [B, max_blocks] (int32):
    out [T, H, D] in q's dtype, as `kernels.attention.paged_attention_ref`.

    max_q_len, max_seq_len: host bounds of the step's query and sequence lengths (a larger
        max_seq_len is valid: CUDA graphs pass max_model_len). sms: the device's SM count.
    config: launch overrides (keys of `MQ_DEFAULTS`, "fused_merge" among them), for benchmarks
        and tests. The fused merge's counters are allocated outside CUDA-graph capture
        (`merge_counters`); a capture that would allocate them takes the merge launch.
    k_scale, v_scale: an fp8_e4m3 cache's 0-d fp32 layer scales, or an int8 cache's fp32 per-token
        scales [num_blocks, block_size, KVH] (`kernels.kv_quant_triton`).
    Raises ValueError where `fits_multi_query` is false or H is not a multiple of KVH, and as
    `kv_operands`.
    """
    t, h, d = q.shape
    kvh = k_cache.shape[2]
    if h % kvh or not fits_multi_query(max_q_len, h, kvh):
        raise ValueError(f"multi-query attention: {max_q_len} queries x {h}/{kvh} heads do not fit")
    g = h // kvh
    b = seq_lens.shape[0]
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0 or b == 0 or max_seq_len == 0:
        return out
    cfg = {**MQ_DEFAULTS, **(config or {})}
    bd = triton.next_power_of_2(d)
    block_n = cfg["block_n"] or (64 if bd <= 128 else 32)
    splits = cfg["splits"] or multi_query_splits(b, kvh, max_seq_len, sms, block_n)
    pdl = use_pdl(q.device)
    m, l_, acc = split_buffers(out, splits)
    cnt = merge_counters(out, kvh, splits, cfg["fused_merge"], b)
    kc, vc, ks, vs, quant = kv_operands(k_cache, v_cache, k_scale, v_scale)
    _multi_query_kernel[(b, kvh, splits)](
        q, kc, vc, block_tables, cu_seqlens_q, seq_lens, out, m, l_, acc, out if cnt is None else cnt, ks, vs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), scale * 1.4426950408889634, k_cache.shape[1],
        splits, h, d, G=g, BLOCK_R=max(16, triton.next_power_of_2(max_q_len * g)), BLOCK_N=block_n,
        BLOCK_D=bd, ONE_SPLIT=splits == 1, USE_PDL=pdl, KV_QUANT=quant, FUSED_MERGE=cnt is not None,
        **fused_merge_constants(h, kvh, d, splits, cnt is not None, max_q_len), num_warps=cfg["num_warps"],
        **({"num_stages": cfg["num_stages"]} if cfg["num_stages"] else {}), **launch_args(pdl))
    merge_splits(m, l_, acc, out, splits, pdl, cnt)
    return out
