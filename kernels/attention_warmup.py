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

Triton also keys a compile on each pointer's element type, so the warm-up's metadata
(cu_seqlens_q, seq_lens, block tables) has the dtype the eager steps pass: `META_DTYPE`,
int64, as services/worker/step_inputs.py packs every integer input into one int64 copy.
(Warmed with int32 metadata, every eager verify and mixed step compiled its kernel again
once serving, 0.5-0.8 s each on the H200: the JIT watch named `cu_ptr: *i32 -> *i64`.)
The CUDA graphs' own launches (int32 cu_seqlens_q) compile at capture, before ready.
"""

from __future__ import annotations

import torch
import triton

from kernels.attention_multi_query import MAX_ROWS, multi_query_splits
from kernels.attention_triton import paged_attention_triton
from kernels.device_info import num_sms

META_DTYPE = torch.long  # the eager steps' metadata dtype (services/worker/step_inputs.py packs int64)


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


def variants(num_heads: int, num_kv_heads: int, head_dim: int, max_model_len: int, max_q_len: int,
             sms: int) -> list[tuple[int, int]]:
    """(q_len, splits) of one launch per compiled variant (module doc): q_len 1 (the decode
    kernel), one per BLOCK_R class of the multi-query kernel, one past MAX_ROWS / G (the
    prefill kernel, splits 1), each decode / multi-query one at every split class up to
    the largest split count (a batch of one at max_model_len; sms: the device's SMs).
    max_q_len bounds q_len (the token budget)."""
    g = num_heads // num_kv_heads
    block_n = 64 if triton.next_power_of_2(head_dim) <= 128 else 32
    # decode_splits and multi_query_splits share the formula min(tiles, cdiv(4 SMs, b x KVH)):
    # most at b = 1 and max_model_len
    top = multi_query_splits(1, num_kv_heads, max_model_len, sms, block_n)
    out = [(q, s) for q in [1] + [q for q in q_len_classes(g) if q <= max_q_len] for s in split_classes(top)]
    if MAX_ROWS // g + 1 <= max_q_len:
        out.append((MAX_ROWS // g + 1, 1))
    return out


def warm_up_attention(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, dtype: torch.dtype,
                      max_model_len: int, max_q_len: int, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> int:
    """Launch every variant of `paged_attention_triton` a step can meet (`variants`) once:
    one seq of q_len zero queries over blocks 0.. of the cache, splits forced.

    k_cache, v_cache: one layer's cache [num_blocks, block_size, KVH, D] (read only);
    num_heads: query heads (a multiple of KVH); dtype: the queries' dtype; max_model_len:
    the longest context; max_q_len: the most queries a seq has in a step (the token
    budget); k_scale, v_scale: the layer's scales of a quantized cache (fp8_e4m3: 0-d; int8:
    [num_blocks, block_size, KVH]; its variants compile apart from the model dtype's), else None. Returns the number of launches.
    """
    dev = k_cache.device
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    todo = variants(num_heads, kvh, d, max_model_len, max_q_len, num_sms(dev))
    for q, s in todo:
        q_t = torch.zeros((q, num_heads, d), dtype=dtype, device=dev)
        cu = torch.tensor([0, q], dtype=META_DTYPE, device=dev)
        lens = torch.tensor([q], dtype=META_DTYPE, device=dev)
        width = triton.cdiv(q, k_cache.shape[1])
        tables = torch.arange(width, dtype=META_DTYPE, device=dev).clamp(max=k_cache.shape[0] - 1)[None]
        paged_attention_triton(q_t, k_cache, v_cache, cu, lens, tables, 1.0, max_q_len=q,
                               max_seq_len=max_model_len, decode_config={"splits": s},
                               k_scale=k_scale, v_scale=v_scale)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return len(todo)

