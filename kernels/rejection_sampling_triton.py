"""Triton kernel of `kernels.rejection_sampling`: every row's accept / recover / bonus
decision in one launch.

One program per row (a position of a verify seq) walks the vocabulary in tiles:
- greedy row (T = 0): one pass, the argmax (lowest id among the maxima); accepted iff it
  equals the draft;
- bonus row: one pass, the ordinary Gumbel-max draw (the expression of
  `kernels.sampling_triton`, same hashed noise, so the same token as the ordinary sampler);
- draft row: pass 1, an online max and sum of exp(logits / T) per lane (the softmax
  normaliser); then p(d) and q(d) and the accept test u * q(d) < p(d); only a rejected row
  runs pass 2, the Gumbel-max draw over log(p - q) (recovery stream) and, alongside, one
  from p, taken when the residual mass is at most RESIDUAL_EPS (p = q up to rounding).
Rows are independent, so the positions of a seq run in parallel; the caller keeps a seq's
rows up to its first rejection. Lanes are combined as in `kernels.sampling_triton`: strict
updates per lane, then the lowest id among the lanes at the maximum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sampling_triton import _mix32


@triton.jit
def _gumbel(offs, k0, k1):
    # the Gumbel noise of kernels.sampling_noise.race_noise at token ids offs
    h = _mix32(_mix32(offs.to(tl.int64) ^ k0) ^ k1)
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _lowest_at_max(best, best_i, vocab):
    # the lowest id among the lanes holding the maximum (0 when every score is -inf)
    top = tl.max(best, 0)
    tok = tl.min(tl.where(best == top, best_i, vocab), 0)
    return tl.where(tok == vocab, 0, tok).to(tl.int64)


@triton.jit(do_not_specialize=["vocab", "stride_l", "stride_q", "eps"])
def _rejection_kernel(logits_ptr, stride_l, q_ptr, stride_q, qidx_ptr, draft_ptr, temp_ptr, u_ptr, key_ptr,
                      tok_ptr, acc_ptr, vocab, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(temp_ptr + row)
    d = tl.load(draft_ptr + row)
    lrow = logits_ptr + row * stride_l
    lanes = tl.arange(0, BLOCK)
    tok = d
    acc = d * 0
    if t == 0.0:
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            offs = start + lanes
            x = tl.load(lrow + offs, mask=offs < vocab, other=float("-inf"))
            upd = x > best
            best = tl.where(upd, x, best)
            best_i = tl.where(upd, offs, best_i)
        tok = _lowest_at_max(best, best_i, vocab)
        acc = (tok == d).to(tl.int64)
    elif d < 0:  # bonus row: the ordinary seeded draw
        k0 = tl.load(key_ptr + 4 * row)
        k1 = tl.load(key_ptr + 4 * row + 1)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            offs = start + lanes
            m = offs < vocab
            x = tl.load(lrow + offs, mask=m, other=float("-inf"))
            s = tl.where(m, x / t + _gumbel(offs, k0, k1), float("-inf"))
            upd = s > best
            best = tl.where(upd, s, best)
            best_i = tl.where(upd, offs, best_i)
        tok = _lowest_at_max(best, best_i, vocab)
    else:  # draft row
        m_l = tl.full([BLOCK], float("-inf"), tl.float32)
        s_l = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            offs = start + lanes
            x = tl.load(lrow + offs, mask=offs < vocab, other=float("-inf")) / t
            m_new = tl.maximum(m_l, x)
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            s_l = s_l * tl.exp(m_l - ref) + tl.exp(x - ref)
            m_l = m_new
        top = tl.max(m_l, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        total = tl.sum(s_l * tl.exp(m_l - top), 0)
        total = tl.where(total > 0.0, total, 1.0)
        qrow = q_ptr + tl.load(qidx_ptr + row) * stride_q
        p_d = tl.exp(tl.load(lrow + d) / t - top) / total
        q_d = tl.load(qrow + d)
        acc = (tl.load(u_ptr + row) * q_d < p_d).to(tl.int64)
        if acc == 0:  # recovered token from norm(max(0, p - q)), recovery stream
            k0 = tl.load(key_ptr + 4 * row + 2)
            k1 = tl.load(key_ptr + 4 * row + 3)
            rb = tl.full([BLOCK], float("-inf"), tl.float32)
            ri = tl.zeros([BLOCK], tl.int32)
            fb = tl.full([BLOCK], float("-inf"), tl.float32)
            fi = tl.zeros([BLOCK], tl.int32)
            mass = tl.zeros([BLOCK], tl.float32)
            for start in range(0, vocab, BLOCK):
                offs = start + lanes
                m = offs < vocab
                x = tl.load(lrow + offs, mask=m, other=float("-inf")) / t
                g = _gumbel(offs, k0, k1)
                r = tl.exp(x - top) / total - tl.load(qrow + offs, mask=m, other=0.0)
                rs = tl.where(r > 0.0, tl.log(tl.where(r > 0.0, r, 1.0)) + g, float("-inf"))
                mass += tl.where(r > 0.0, r, 0.0)
                fs = tl.where(m, x + g, float("-inf"))
                upd = rs > rb
                rb = tl.where(upd, rs, rb)
                ri = tl.where(upd, offs, ri)
                upd = fs > fb
                fb = tl.where(upd, fs, fb)
                fi = tl.where(upd, offs, fi)
            if tl.sum(mass, 0) > eps:
                tok = _lowest_at_max(rb, ri, vocab)
            else:  # p = q up to rounding: a draw from p
                tok = _lowest_at_max(fb, fi, vocab)
    tl.store(tok_ptr + row, tok)
    tl.store(acc_ptr + row, acc.to(tl.int8))


def rejection_sample_triton(logits: torch.Tensor, temperature: torch.Tensor, draft_ids: torch.Tensor,
                            q: torch.Tensor, q_index: torch.Tensor, keys: torch.Tensor,
                            u: torch.Tensor, residual_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.rejection_sampling.rejection_sample_ref` in one launch (same arguments and
    results, all tensors on one device; residual_eps: `RESIDUAL_EPS`, passed by the
    dispatcher). logits [R, V] and q [D, V] fp32, copied when the last stride is not 1."""
    n, vocab = logits.shape
    tokens = torch.empty(n, dtype=torch.long, device=logits.device)
    acc = torch.empty(n, dtype=torch.int8, device=logits.device)
    if n == 0:
        return tokens, acc.bool()
    logits = logits.float()
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    q = q.float()
    if q.shape[0] == 0:
        q = logits.new_zeros((1, vocab))
    elif q.stride(1) != 1:
        q = q.contiguous()
    block = 2048 if logits.device.type == "cuda" else 256
    _rejection_kernel[(n,)](logits, logits.stride(0), q, q.stride(0), q_index.contiguous(),
                            draft_ids.contiguous(), temperature.float().contiguous(), u.float().contiguous(),
                            keys.contiguous(), tokens, acc, vocab, float(residual_eps), BLOCK=block,
                            num_warps=8)
    return tokens, acc.bool()
