"""The merge of split-K decode attention (`kernels.attention_triton._decode_kernel`,
`kernels.rope_decode`): program (seq, kv_head, split) of a decode kernel attends one
partition of the context and keeps, per query head, the running max m of its scores
(log2 units), their exp2-sum l and the weighted value sum acc [D] (online softmax,
Milakov & Gimelshein 2018); the partitions are then combined by their log-sum-exp as in
FlashDecoding (Dao et al. 2023).

Two ways to combine them (DECODE_DEFAULTS / ROPE_DECODE_DEFAULTS "fused_merge"):
- in the decode kernel (`_merge_if_last`): each program stores its partial, then arrives on
  a per-(seq, kv_head) int32 counter with an acq_rel atomic, as `kernels.gemv` sums its
  split K; the last program to arrive merges the partials of all splits, in split order
  (deterministic whichever program it is), writes out and sets the counter back to 0. This
  saves the second launch (~2.4 us per layer at batch 1 on the H200, Qwen3-0.6B, on the
  step's critical path).
- a second kernel (`_merge_kernel`, one program per (seq, head)) after the decode kernel.
Both run the same math (`_merge_head`). With one split the decode kernel stores the
normalised output itself and there is nothing to merge. The merging program holds one
[next_pow2(splits), D] fp32 tile per head, as `_merge_kernel` does (b=1, Qwen3-0.6B: 33
splits in `kernels.rope_decode`, a 64 x 128 tile; 66 in the plain decode kernel, 128 x
128). Measured on the H200 (Qwen3-0.6B, batch 1, 1K context) the in-kernel merge is the
slower one: decode_latency.py TPOT 0.92 against 0.87-0.88 ms with the second launch, so
both decode kernels default to the launch (fused_merge False).
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


@triton.jit
def _store_partial(m_i, l_i, acc, out_ptr, m_ptr, l_ptr, acc_ptr, seq, heads, gg, dd, dmask, so_t, so_h,
                   n_heads, n_splits, split, head_dim, G: tl.constexpr, ONE_SPLIT: tl.constexpr):
    """With ONE_SPLIT the normalised output of the G heads; else this split's (m, l, acc)
    for `_merge_head`."""
    hm = (gg < G)[:, None] & dmask[None, :]
    if ONE_SPLIT:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + seq * so_t + heads[:, None] * so_h + dd[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hm)
    else:
        row = (seq * n_heads + heads) * n_splits + split  # [BLOCK_G]
        tl.store(m_ptr + row, m_i, mask=gg < G)
        tl.store(l_ptr + row, l_i, mask=gg < G)
        tl.store(acc_ptr + row[:, None] * head_dim + dd[None, :], acc, mask=hm)


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
def _merge_if_last(m_ptr, l_ptr, acc_ptr, out_ptr, cnt_ptr, seq, kvh, so_t, so_h, n_heads, n_splits,
                   head_dim, G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """The split merge inside a decode kernel of grid (seqs, kv_heads, n_splits > 1), after
    `_store_partial`: the program arrives on the int32 counter cnt_ptr[seq * kv_heads + kvh]
    (acq_rel, as `kernels.gemv`); the last of the n_splits to arrive merges the G heads of
    its KV head into out (`_merge_head`) and sets the counter back to 0 for the next launch.
    Every program of the grid must call it, empty partitions included (a program that
    returned early would leave the output unwritten and the counter non-zero), and after
    its PDL wait (the counters' previous user has then finished)."""
    tl.debug_barrier()  # every thread's partial is stored before the release below
    cnt = cnt_ptr + seq * tl.num_programs(1) + kvh
    arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if arrived == n_splits - 1:
        for g in tl.static_range(G):  # G (constexpr, small) heads one after the other
            _merge_head(m_ptr, l_ptr, acc_ptr, out_ptr, seq, kvh * G + g, so_t, so_h, n_heads, n_splits,
                        head_dim, BLOCK_S, BLOCK_D)
        tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # zero for the next launch (graph replay)


@triton.jit(do_not_specialize=["n_splits"])
def _merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, so_t, so_h, n_heads, n_splits, head_dim,
                  USE_PDL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    _merge_head(m_ptr, l_ptr, acc_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1), so_t, so_h,
                n_heads, n_splits, head_dim, BLOCK_S, BLOCK_D)


def split_buffers(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, l, acc) fp32 partials of a split-K decode into out [B, H, D]: [B, H, splits] twice
    and [B, H, splits, D]; `out` itself three times for one split (the kernel then stores the
    output directly)."""
    if splits == 1:
        return out, out, out
    b, h, d = out.shape
    m = torch.empty((b, h, splits), dtype=torch.float32, device=out.device)
    return m, torch.empty_like(m), torch.empty((b, h, splits, d), dtype=torch.float32, device=out.device)


def merge_counters(out: torch.Tensor, kv_heads: int, splits: int, fused: bool) -> torch.Tensor | None:
    """The zeroed int32 arrival counters (one per (seq, kv_head), pool MERGE_POOL) of a
    decode kernel that merges its splits itself (`_merge_if_last`) into out [B, H, D]; None
    for the two-launch path: fused False, one split (the kernel stores out directly), or
    counters that would have to be allocated inside CUDA-graph capture."""
    if not fused or splits == 1:
        return None
    return tile_counters(out.device, out.shape[0] * kv_heads, MERGE_POOL)


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
