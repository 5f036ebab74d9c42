"""Compile every launch variant of the paged attention kernels before serving.

`kernels.attention_triton.paged_attention_triton` picks its kernel and constexprs from host
ints that vary from step to step: the decode kernel for one query per seq, the split-K
multi-query kernel (`kernels.attention_multi_query`) for up to MAX_ROWS / G query rows per
seq, the prefill kernel beyond; the split count from the batch size and the context
(`decode_splits`, `multi_query_splits`), which sets ONE_SPLIT and the merge's BLOCK_S =
next_power_of_2(splits); the multi-query kernel's BLOCK_R = max(16, next_power_of_2(q_len
x G)). The split count itself is not specialised (`do_not_specialize`), so the variants a
step can meet are the product of
- kernel: decode / multi-query (one per BLOCK_R class of q_len 2 .. MAX_ROWS / G) / prefill;
- split class: 1, then each power of two up to the largest split count a batch of one at
  max_model_len gets (a class (2^(j-1), 2^j] shares BLOCK_S = 2^j).
CUDA graphs fix their splits at capture (max_model_len), but eager steps (verify steps
above the captured verify sizes, prefill chunks mixed with decodes, `--enforce-eager`)
size them from the step's own context, so a long-running server meets a new class as
contexts grow; each meeting compiled a kernel mid-serving (0.1-0.5 s on the H200,
services/worker/jit_watch.py counts them). `warm_up_attention` runs one tiny launch per
variant (one seq of q_len queries over the first block of the real cache, splits forced
through the launch config) so every compile happens at startup. It reads the cache and
writes only its own output.
"""

from __future__ import annotations

import torch
import triton

from kernels.attention_multi_query import MAX_ROWS, multi_query_splits
from kernels.attention_triton import paged_attention_triton
from kernels.device_info import num_sms


def split_classes(max_splits: int) -> list[int]:
    """One split count per compiled class of 1..max_splits: 1, and min(2^j, max_splits) for
    each class (2^(j-1), 2^j] (they share ONE_SPLIT = False and BLOCK_S = 2^j)."""
    out, s = [1], 2
    while True:
        out.append(min(s, max_splits))
        if s >= max_splits:
            break
        s *= 2
    return sorted(set(x for x in out if 1 <= x <= max(1, max_splits)))


def q_len_classes(group: int) -> list[int]:
    """One q_len per compiled class of the multi-query kernel (BLOCK_R = max(16,
    next_power_of_2(q_len x group)), q_len 2 .. MAX_ROWS // group), the largest of each."""
    best: dict[int, int] = {}
    for q in range(2, MAX_ROWS // group + 1):
        best[max(16, triton.next_power_of_2(q * group))] = q
    return sorted(best.values())


def warm_up_attention(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, dtype: torch.dtype,
                      max_model_len: int, max_q_len: int) -> int:
    """Launch every variant of `paged_attention_triton` a step can meet (module doc) once.

    k_cache, v_cache: one layer's cache [num_blocks, block_size, KVH, D] (read only);
    num_heads: query heads (a multiple of KVH); dtype: the queries' dtype; max_model_len:
    the longest context; max_q_len: the most queries a seq has in a step (the token
    budget), bounding the multi-query and prefill variants. Returns the number of launches.
    """
    dev = k_cache.device
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    g = num_heads // kvh
    block_n = 64 if triton.next_power_of_2(d) <= 128 else 32
    n_tiles = max(1, triton.cdiv(max_model_len, block_n))
    # a batch of one seq at max_model_len gets the most splits (decode_splits and
    # multi_query_splits share the formula: min(tiles, cdiv(4 SMs, b x KVH)))
    top = multi_query_splits(1, kvh, max_model_len, num_sms(dev), block_n)
    q_lens = [1] + [q for q in q_len_classes(g) if q <= max_q_len]
    if MAX_ROWS // g + 1 <= max_q_len:
        q_lens.append(MAX_ROWS // g + 1)  # the prefill kernel (its launch fixes no split)
    n = 0
    for q in q_lens:
        prefill = q * g > MAX_ROWS
        q_t = torch.zeros((q, num_heads, d), dtype=dtype, device=dev)
        cu = torch.tensor([0, q], dtype=torch.int32, device=dev)
        lens = torch.tensor([q], dtype=torch.int32, device=dev)
        width = triton.cdiv(q, k_cache.shape[1])  # blocks 0.. of the cache, read only
        tables = torch.arange(width, dtype=torch.int32, device=dev).clamp(max=k_cache.shape[0] - 1)[None]
        for s in ([1] if prefill else split_classes(min(top, n_tiles))):
            paged_attention_triton(q_t, k_cache, v_cache, cu, lens, tables, 1.0, max_q_len=q,
                                   max_seq_len=max_model_len, decode_config={"splits": s})
            n += 1
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return n
