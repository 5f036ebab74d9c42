"""The merge of split-K attention (the decode kernels `kernels.attention_triton._decode_kernel`
and `kernels.rope_decode`, and the multi-query kernel of verify steps,
`kernels.attention_multi_query`): program (seq, kv_head, split) attends one partition of the
context and keeps, per row (a query head of the seq's one query for decode; a (query, head)
token row for the multi-query kernel, `_rows`), the running max m of its scores (log2
units), their exp2-sum l and the weighted value sum acc [D] (online softmax, Milakov &
Gimelshein 2018); the partitions are then combined by their log-sum-exp as in FlashDecoding
(Dao et al. 2023).

Each sequence spreads its context over the n_splits programs in whole tiles (`_partition`):
with a context shorter than the grid, the partitions past the context's end are empty, and
n_live of them hold keys (by the launch rules, b=1 Qwen3-30B-A3B at 1K context in a graph
captured for 4K: 66 splits, 32 live; a context of one tile, or MIN_TILES = "min_split_tiles" tiles, one live).

Two ways to combine them (DECODE_DEFAULTS / ROPE_DECODE_DEFAULTS / MQ_DEFAULTS "fused_merge",
all off by default):
- in the attention kernel (`_finish_rows`; `_finish_fused` for the decode kernels): with one
  live partition its program stores the normalised output itself (no partial, no counter,
  no merge); else each live program stores its partial and arrives on a per-(seq, kv_head)
  int32 counter with an acq_rel atomic, as `kernels.gemv` sums its split K; the last of the
  live programs to arrive merges the live partials of all rows of its (seq, KV head)
  (`_merge_rows`, in chunks of splits, in split order: deterministic whichever program it
  is), writes out and sets the counter back to 0. Empty programs store nothing and do not
  arrive. No second launch.
- a second kernel (`_merge_kernel`, one program per (token row, head)) after the attention
  kernel, over all n_splits partials (empty ones weigh 0): fused_merge False, the A/B baseline.
With one split at launch (ONE_SPLIT) the attention kernel stores the normalised output itself.
An earlier in-kernel merge (every program arrived; the last merged all n_splits partials
of each head in one [next_pow2(splits), D] fp32 tile, heads one after the other) measured
slower than the second launch on the H200 (Qwen3-0.6B, batch 1, 1K context: decode_latency.py
TPOT 0.92 against 0.87-0.88 ms); the live-split, chunked merge here is not measured yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device_info import tile_counters
from kernels.pdl import launch_args, pdl_release, pdl_wait

# counter pool of the in-kernel merge (`kernels.device_info.tile_counters`). Sharing the
# linear kernels' pool would be safe: every kernel touches counters only after its PDL wait,
# which waits for the whole kernel before (its counter resets included), and each launch
# leaves its counters zero. A pool of its own (16 KB) keeps the index ranges of the two
# users apart, so neither has to know the other's, nor can a fault in one reach the other.
MERGE_POOL = "decode_merge"
MERGE_CHUNK_ELEMS = 4096  # fp32 acc values of one chunk of the in-kernel merge (`fused_merge_constants`)


@triton.jit
def _rows(tok0, kvh, n_rows, so_t, so_h, n_heads, n_splits, R: tl.constexpr, G: tl.constexpr):
    """The R token rows of one (seq, kv_head) program: row r is query r // G of the seq (token
    row tok0 + r // G of q and out) at head kvh * G + r % G, valid below n_rows (q_len x G; a
    decode kernel's tok0 is the seq, n_rows G). Returns (out offsets [R] of each row's [D]
    vector, its partial row of split 0 in the `split_buffers` layout, valid [R])."""
    rr = tl.arange(0, R)
    tok = tok0 + rr // G
    heads = kvh * G + rr % G
    return tok * so_t + heads * so_h, (tok * n_heads + heads) * n_splits, rr < n_rows


@triton.jit
def _store_rows(m_i, l_i, acc, out_ptr, m_ptr, l_ptr, acc_ptr, orow, prow, rmask, dd, dmask, split, head_dim,
                ONE_SPLIT: tl.constexpr):
    """Rows of a program (out offsets orow, partial rows prow of split 0, valid rmask: `_rows`):
    with ONE_SPLIT their normalised output; else this split's (m, l, acc) for the merge."""
    hm = rmask[:, None] & dmask[None, :]
    if ONE_SPLIT:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + orow[:, None] + dd[None, :], o.to(out_ptr.dtype.element_ty), mask=hm)
    else:
        row = prow + split
        tl.store(m_ptr + row, m_i, mask=rmask)
        tl.store(l_ptr + row, l_i, mask=rmask)
        tl.store(acc_ptr + row[:, None] * head_dim + dd[None, :], acc, mask=hm)


@triton.jit
def _store_partial(m_i, l_i, acc, out_ptr, m_ptr, l_ptr, acc_ptr, seq, heads, gg, dd, dmask, so_t, so_h,
                   n_heads, n_splits, split, head_dim, G: tl.constexpr, ONE_SPLIT: tl.constexpr):
    """`_store_rows` for the G heads (rows gg < G at heads) of a decode program of seq."""
    _store_rows(m_i, l_i, acc, out_ptr, m_ptr, l_ptr, acc_ptr, seq * so_t + heads * so_h,
                (seq * n_heads + heads) * n_splits, gg < G, dd, dmask, split, head_dim, ONE_SPLIT)


@triton.jit
def _merge_head(m_ptr, l_ptr, acc_ptr, out_ptr, seq, h, so_t, so_h, n_heads, n_splits, head_dim,
                BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[seq, h] from the n_splits partials (m, l, acc) of `_store_partial`: each split's
    acc weighted by 2^(m - max m), over the weighted sum of the l (log-sum-exp merge; an
    empty split has m -inf and weighs 0, a row with no key gives zeros). Whole [BLOCK_S]
    tiles in split order, so the result does not depend on which program merges. The
    partials are read past L1 (.cg): other SMs wrote them in the same kernel."""
    ss = tl.arange(0, BLOCK_S)
    dd = tl.arange(0, BLOCK_D)
    sm = ss < n_splits
    row = (seq * n_heads + h) * n_splits + ss
    m = tl.load(m_ptr + row, mask=sm, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(l_ptr + row, mask=sm, other=0.0, cache_modifier=".cg")
    mx = tl.max(m, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - mx))
    total = tl.sum(l * w, 0)
    acc = tl.load(acc_ptr + row[:, None] * head_dim + dd[None, :],
                  mask=sm[:, None] & (dd < head_dim)[None, :], other=0.0, cache_modifier=".cg")
    o = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * so_t + h * so_h + dd, o.to(out_ptr.dtype.element_ty), mask=dd < head_dim)


@triton.jit
def _partition(seq_len, n_splits, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr):
    """(keys a partition, live partitions) of one sequence over the n_splits programs of its
    (seq, kv_head): whole BLOCK_N tiles, cdiv(tiles, n_splits) a partition but at least
    MIN_TILES; the live ones (split < n_live) hold keys, the rest are empty. A row of seq_len
    0 (CUDA-graph padding) has one live, empty partition."""
    tiles = tl.cdiv(seq_len, BLOCK_N)
    per = tl.maximum(tl.cdiv(tiles, n_splits), MIN_TILES)
    return per * BLOCK_N, tl.maximum(tl.cdiv(tiles, per), 1)


@triton.jit
def _merge_rows(m_ptr, l_ptr, acc_ptr, out_ptr, orow, prow, rmask, n_live, head_dim, MERGE_G: tl.constexpr,
                BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """out of MERGE_G rows (`_rows`: out offsets orow, partial rows prow of split 0, valid
    rmask) from the partials of the n_live live splits (the log-sum-exp merge of
    `_merge_head`, all rows at once): the max and the weighted l-sum from [MERGE_G, BLOCK_S]
    tiles of m and l, then acc in [MERGE_G, CHUNK_S, BLOCK_D] chunks of splits, in split
    order (deterministic whichever program merges; the register tile is a chunk, not all
    splits). Partials read past L1 (.cg): other SMs wrote them."""
    ss = tl.arange(0, BLOCK_S)
    msk = rmask[:, None] & (ss < n_live)[None, :]
    m = tl.load(m_ptr + prow[:, None] + ss[None, :], mask=msk, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(l_ptr + prow[:, None] + ss[None, :], mask=msk, other=0.0, cache_modifier=".cg")
    mx = tl.max(m, 1)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    total = tl.sum(l * tl.where(m == float("-inf"), 0.0, tl.exp2(m - mx[:, None])), 1)
    dd = tl.arange(0, BLOCK_D)
    dv = dd < head_dim
    o = tl.zeros([MERGE_G, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, n_live, CHUNK_S):
        cs = s0 + tl.arange(0, CHUNK_S)
        cm = rmask[:, None] & (cs < n_live)[None, :]
        rows = prow[:, None] + cs[None, :]
        mc = tl.load(m_ptr + rows, mask=cm, other=float("-inf"), cache_modifier=".cg")
        wc = tl.where(mc == float("-inf"), 0.0, tl.exp2(mc - mx[:, None]))
        a = tl.load(acc_ptr + rows[:, :, None] * head_dim + dd[None, None, :],
                    mask=cm[:, :, None] & dv[None, None, :], other=0.0, cache_modifier=".cg")
        o += tl.sum(a * wc[:, :, None], 1)
    o = o / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + orow[:, None] + dd[None, :], o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dv[None, :])


@triton.jit
def _finish_rows(m_i, l_i, acc, out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr, seq, kvh, orow, prow, rmask, tok0, n_rows,
                 dd, dmask, so_t, so_h, n_heads, n_splits, split, n_live, head_dim, G: tl.constexpr,
                 MERGE_G: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """The end of a program (seq, kvh, split) of grid (seqs, kv_heads, n_splits > 1) that
    merges its splits itself, with n_live from `_partition` and its rows (orow, prow, rmask)
    from `_rows(tok0, kvh, n_rows, ..)`: one live split (a short context, or a padding row)
    stores the normalised output directly, no partial and no counter; else each live
    program stores its partial and arrives on the int32 counter cnt_ptr[seq * kv_heads +
    kvh] (acq_rel, as `kernels.gemv`), and the last of the n_live to arrive merges the
    n_rows rows (`_merge_rows` over `_rows` at MERGE_G rows) and sets the counter back to 0
    for the next launch. Empty programs (split >= n_live) store nothing and do not arrive.
    Called after the program's PDL wait (the counters' previous user has then finished)."""
    if n_live == 1:
        if split == 0:
            _store_rows(m_i, l_i, acc, out_ptr, m_ptr, l_ptr, acc_ptr, orow, prow, rmask, dd, dmask, split, head_dim,
                        True)
    elif split < n_live:
        _store_rows(m_i, l_i, acc, out_ptr, m_ptr, l_ptr, acc_ptr, orow, prow, rmask, dd, dmask, split, head_dim,
                    False)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        cnt = cnt_ptr + seq * tl.num_programs(1) + kvh
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == n_live - 1:
            mo, mp, mm = _rows(tok0, kvh, n_rows, so_t, so_h, n_heads, n_splits, MERGE_G, G)
            _merge_rows(m_ptr, l_ptr, acc_ptr, out_ptr, mo, mp, mm, n_live, head_dim, MERGE_G, BLOCK_S, CHUNK_S,
                        BLOCK_D)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # zero for the next launch (graph replay)


@triton.jit
def _finish_fused(m_i, l_i, acc, out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr, seq, kvh, heads, gg, dd, dmask,
                  so_t, so_h, n_heads, n_splits, split, n_live, head_dim, G: tl.constexpr, MERGE_G: tl.constexpr,
                  BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """`_finish_rows` for a decode program of seq (its G heads at rows gg < G, heads): one
    query row a seq, so the merge's rows are the G heads of KV head kvh."""
    _finish_rows(m_i, l_i, acc, out_ptr, m_ptr, l_ptr, acc_ptr, cnt_ptr, seq, kvh, seq * so_t + heads * so_h,
                 (seq * n_heads + heads) * n_splits, gg < G, seq, G, dd, dmask, so_t, so_h, n_heads, n_splits, split,
                 n_live, head_dim, G, MERGE_G, BLOCK_S, CHUNK_S, BLOCK_D)


@triton.jit(do_not_specialize=["n_splits"])
def _merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, so_t, so_h, n_heads, n_splits, head_dim,
                  USE_PDL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    _merge_head(m_ptr, l_ptr, acc_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1), so_t, so_h,
                n_heads, n_splits, head_dim, BLOCK_S, BLOCK_D)


def split_buffers(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, l, acc) fp32 partials of a split-K decode into out [B, H, D] (the multi-query
    kernel's out [T, H, D]: rows by token): [B, H, splits] twice and [B, H, splits, D]; `out`
    itself three times for one split (the kernel then stores the output directly)."""
    if splits == 1:
        return out, out, out
    b, h, d = out.shape
    m = torch.empty((b, h, splits), dtype=torch.float32, device=out.device)
    return m, torch.empty_like(m), torch.empty((b, h, splits, d), dtype=torch.float32, device=out.device)


def fused_merge_constants(num_heads: int, kv_heads: int, head_dim: int, splits: int, fused: bool,
                          q_len: int = 1) -> dict:
    """The merge constexprs of a split-K attention launch: MERGE_G = next_pow2(q_len x G) rows
    merged at once (the G heads of a KV head for a decode kernel, q_len = 1; the q_len x G
    token rows of the multi-query kernel, q_len its host bound max_q_len), BLOCK_S =
    next_pow2(splits) (the m / l tile), CHUNK_S splits of acc a chunk (MERGE_G x CHUNK_S x
    next_pow2(head_dim) <= MERGE_CHUNK_ELEMS fp32 values, at least one split); all 1 when
    the kernel does not merge (fused False), so that path compiles one variant."""
    if not fused:
        return {"MERGE_G": 1, "BLOCK_S": 1, "CHUNK_S": 1}
    mg = triton.next_power_of_2(q_len * (num_heads // kv_heads))
    return {"MERGE_G": mg, "BLOCK_S": triton.next_power_of_2(splits),
            "CHUNK_S": max(1, MERGE_CHUNK_ELEMS // (mg * triton.next_power_of_2(head_dim)))}


def merge_counters(out: torch.Tensor, kv_heads: int, splits: int, fused: bool,
                   seqs: int | None = None) -> torch.Tensor | None:
    """The zeroed int32 arrival counters (one per (seq, kv_head), pool MERGE_POOL) of a
    kernel that merges its splits itself (`_finish_rows`) into out [B, H, D] (seqs None: B
    seqs; the multi-query kernel's out is [T, H, D] over `seqs` seqs); None for the
    two-launch path: fused False, one split (the kernel stores out directly), or counters
    that would have to be allocated inside CUDA-graph capture."""
    if not fused or splits == 1:
        return None
    return tile_counters(out.device, (out.shape[0] if seqs is None else seqs) * kv_heads, MERGE_POOL)


def merge_splits(m: torch.Tensor, l_: torch.Tensor, acc: torch.Tensor, out: torch.Tensor, splits: int,
                 pdl: bool, counters: torch.Tensor | None = None) -> None:
    """Launch `_merge_kernel` over the partials of `split_buffers` into out [B, H, D] (nothing
    for one split, nor when the decode kernel merged them itself with `counters` of
    `merge_counters`)."""
    if splits == 1 or counters is not None:
        return
    b, h, d = out.shape
    _merge_kernel[(b, h)](m, l_, acc, out, out.stride(0), out.stride(1), h, splits, d, USE_PDL=pdl,
                          BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(d),
                          **launch_args(pdl))
