"""Triton sampler of `kernels.sampling` for batches without top-k/top-p/min-p.

One program per row walks the vocabulary in tiles: score = logits / T + G (G the Gumbel
noise of `kernels.sampling.race_noise`, the same integer hash of (row key, token id)) or
the raw logit for greedy rows (T == 0), and keeps the best score per lane; the row's token
is the lowest id among the lanes holding the maximum (ties to the lowest id, like
`torch.argmax`). One read of the logits, no softmax, no sort, no per-row generator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sampling import HASH_C1, HASH_C2, noise_keys

assert (HASH_C1, HASH_C2) == (0x21F0AAAD, 0x735A2D97), "keep _mix32's literals in step"


@triton.jit
def _mix32(x):
    # x: int64 in [0, 2**32); the same operations as kernels.sampling._mix32
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride_row, temp_ptr, key_ptr, out_ptr, vocab,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(temp_ptr + row)
    k0 = tl.load(key_ptr + 2 * row)
    k1 = tl.load(key_ptr + 2 * row + 1)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + lanes
        m = offs < vocab
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
    tok = tl.where(tok == vocab, 0, tok)  # every score -inf/NaN: token 0
    tl.store(out_ptr + row, tok.to(tl.int64))


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, seeds: list[int],
                  keys: torch.Tensor | None = None) -> torch.Tensor:
    """Gumbel-max draw of one token per row, no filters.

    logits: [n, vocab] fp32/bf16/fp16, unit last stride. temperature: [n] fp32 on the same
    device (0 = greedy). seeds: n ints (`mix_seed` values); keys: their `noise_keys`, already
    on the device (optional, saves the copy). Returns [n] int64.
    """
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    if n == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if keys is None:
        keys = noise_keys(seeds).to(logits.device, non_blocking=True)
    _gumbel_argmax_kernel[(n,)](logits, logits.stride(0), temperature.float().contiguous(),
                                keys.contiguous(), out, vocab, BLOCK=2048, num_warps=8)
    return out
