"""Triton sampler of `kernels.sampling` for batches without top-k/top-p/min-p.

One program per row (or per chunk of a row, for small batches) walks the vocabulary in tiles: score = logits / T + G (G the Gumbel
noise of `kernels.sampling_noise.race_noise`, the same integer hash of (row key, token id)) or
the raw logit for greedy rows (T == 0), and keeps the best score per lane; the row's token
is the lowest id among the lanes holding the maximum (ties to the lowest id, like
`torch.argmax`). One read of the logits, no softmax, no sort, no per-row generator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device_info import num_sms
from kernels.sampling_noise import HASH_C1, HASH_C2, noise_keys

assert (HASH_C1, HASH_C2) == (0x21F0AAAD, 0x735A2D97), "keep _mix32's literals in step"


@triton.jit
def _mix32(x):
    # x: int64 in [0, 2**32); the same operations as kernels.sampling_noise._mix32
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


@triton.jit(do_not_specialize=["vocab", "chunk", "n_chunks"])
def _gumbel_argmax_kernel(logits_ptr, stride_row, temp_ptr, key_ptr, out_ptr, ws_score_ptr,
                          ws_idx_ptr, vocab, chunk, n_chunks, BLOCK: tl.constexpr,
                          SPLIT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    k0 = tl.load(key_ptr + 2 * row)
    k1 = tl.load(key_ptr + 2 * row + 1)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, vocab)
    for start in range(lo, hi, BLOCK):
        offs = start + lanes
        m = offs < hi
        x = tl.load(logits_ptr + row * stride_row + offs, mask=m, other=float("-inf")).to(tl.float32)
        h = _mix32(_mix32(offs.to(tl.int64) ^ k0) ^ k1)
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        g = -tl.log(-tl.log(u))
        s = tl.where(t > 0.0, x / tl.where(t > 0.0, t, 1.0) + g, x)
        s = tl.where(m, s, float("-inf"))
        upd = s > best  # strict: an earlier id keeps its lane on a tie
        best = tl.where(upd, s, best)
        best_i = tl.where(upd, offs, best_i)
    top = tl.max(best, 0)
    cand = tl.where(best == top, best_i, vocab)
    tok = tl.min(cand, 0)
    if SPLIT:  # this chunk's best (score, lowest id); _pick_kernel picks among the chunks
        tl.store(ws_score_ptr + row * n_chunks + c, top)
        tl.store(ws_idx_ptr + row * n_chunks + c, tok)
    else:
        tok = tl.where(tok == vocab, 0, tok)  # every score -inf/NaN: token 0
        tl.store(out_ptr + row, tok.to(tl.int64))


@triton.jit(do_not_specialize=["vocab", "n_chunks"])
def _pick_kernel(ws_score_ptr, ws_idx_ptr, out_ptr, vocab, n_chunks, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cc = tl.arange(0, BLOCK_C)
    m = cc < n_chunks
    sc = tl.load(ws_score_ptr + row * n_chunks + cc, mask=m, other=float("-inf"))
    ids = tl.load(ws_idx_ptr + row * n_chunks + cc, mask=m, other=vocab)
    top = tl.max(sc, 0)
    tok = tl.min(tl.where(sc == top, ids, vocab), 0)  # chunks hold ascending ids: lowest wins
    tok = tl.where(tok == vocab, 0, tok)
    tl.store(out_ptr + row, tok.to(tl.int64))


# chunks per row at most; one constant block for the pick and no integer specialisation of
# the chunk arguments, so that every batch size runs one of two compiled variants (split or
# not) and no batch size compiles a new one in the middle of serving
MAX_CHUNKS = 64


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, seeds: list[int],
                  keys: torch.Tensor | None = None) -> torch.Tensor:
    """Gumbel-max draw of one token per row, no filters.

    logits: [n, vocab] fp32/bf16/fp16, unit last stride. temperature: [n] fp32 on the same
    device (0 = greedy). seeds: n ints (`mix_seed` values); keys: their `noise_keys`, already
    on the device (optional, saves the copy). Returns [n] int64.
    A batch too small to fill the GPU with one program per row splits each row's vocabulary
    into chunks (whole BLOCK tiles) and picks the best chunk in a second small kernel; the
    result is the same token (the lowest id among the maxima either way).
    `warm_up_sampler` compiles both variants ahead of time.
    """
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    if n == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if keys is None:
        keys = noise_keys(seeds).to(logits.device, non_blocking=True)
    block = 2048 if logits.device.type == "cuda" else 512
    tiles = triton.cdiv(vocab, block)
    n_chunks = max(1, min(tiles, MAX_CHUNKS, (2 * num_sms(logits.device)) // n))
    chunk = triton.cdiv(tiles, n_chunks) * block
    n_chunks = triton.cdiv(vocab, chunk)
    split = n_chunks > 1
    ws_s = torch.empty((n, n_chunks), dtype=torch.float32, device=logits.device) if split else out
    ws_i = torch.empty((n, n_chunks), dtype=torch.int32, device=logits.device) if split else out
    _gumbel_argmax_kernel[(n, n_chunks)](logits, logits.stride(0), temperature.float().contiguous(),
                                         keys.contiguous(), out, ws_s, ws_i, vocab, chunk, n_chunks,
                                         BLOCK=block, SPLIT=split, num_warps=8)
    if split:
        _pick_kernel[(n,)](ws_s, ws_i, out, vocab, n_chunks, BLOCK_C=MAX_CHUNKS)
    return out


def warm_up_sampler(vocab: int, max_rows: int, device: torch.device) -> None:
    """Compile the kernels of `sample_triton` for one row (chunked) and for max_rows rows
    (one program per row when that fills the GPU), so that no step compiles them later.
    vocab: the model's vocabulary size; max_rows: max_num_seqs."""
    for n in sorted({1, max_rows}):
        logits = torch.zeros((n, vocab), dtype=torch.float32, device=device)
        sample_triton(logits, torch.ones(n, device=device), [0] * n)
