"""Rejection sampling of draft tokens against the target (docs/ARCHITECTURE.md §5.5).

Speculative sampling (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1; Chen et al.
2023, arXiv 2302.01318, Algorithm 2): draft d_i was sampled from the draft distribution q_i
and the target's distribution at that position is p_i. d_i is accepted with probability
min(1, p_i(d_i) / q_i(d_i)); on the first rejection a recovered token is drawn from
norm(max(0, p_i - q_i)) and the rest is dropped; when every draft is accepted a bonus token
is drawn from p_{k+1}. The emitted tokens are then distributed exactly as k + 1 draws from
the target (the papers' theorem), whatever q is.

Here each row (one position of one seq, `services/worker/spec/verify.py`'s `expand_rows`
order) is decided on its own, in parallel; the caller emits a seq's rows up to its first
rejected one. Per row:
- p is softmax(logits / T) over the row's filtered set (`restrict_to_filtered` puts -inf
  outside it, so that p is the normalised `kernels.sampling.filtered_probs`, the
  distribution the ordinary sampler draws from).
- accept iff u * q(d) < p(d), with u in [0, 1) on a 2**-24 grid: probability
  min(1, p(d)/q(d)) to within 2**-24, and no division: q(d) = 0 (probability rounding in
  the drafter) accepts any d with p(d) > 0, p(d) = 0 never accepts.
- recovered token: Gumbel-max over log(p - q) where p > q. When the residual mass
  sum(max(0, p - q)) is at most RESIDUAL_EPS, p and q are equal up to float rounding (the
  exact rejection probability is that mass: such a rejection comes from a q(d) = p(d) = 0
  draft, or is that rare) and the residual is rounding noise; the draw is then from p.
- bonus row: the ordinary seeded draw of `kernels.sampling` (argmax of logits / T + G over
  the filtered set), so it is the very token decoding without speculation draws there.
- greedy rows (T = 0): the argmax (ties to the lowest id); a draft is accepted iff it
  equals it (the point-mass verification of verify.py gives the same tokens).

Noise streams. A row's key is mix_seed(seed, output_index), the ordinary sampler's key:
the bonus draw uses it as is. The accept uniform and the recovered token's Gumbel noise use
their own keys, mix_seed(key, ACCEPT_STREAM) and mix_seed(key, RECOVER_STREAM), so the
three are independent of one another and of the other positions, and every outcome is a
pure function of (seed, output_index, logits, q, d): the same in any batch and on recompute.

The torch reference (`rejection_sample_ref`) and the Triton kernel
(`kernels/rejection_sampling_triton.py`) read the same integer keys and uniforms; their
float math (exp, log, the order of the softmax sum) may differ in the last ulps, which
changes an outcome only on a near-tie (u * q(d) within ulps of p(d), or two Gumbel scores
within ulps). Dispatcher `rejection_sample`: Triton on CUDA, the reference otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kernels.sampling import filtered_probs
from kernels.sampling_noise import _mix32, race_noise

rejection_sample_triton: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None
try:  # the Triton kernel; absent without triton (CPU-only installs)
    from kernels.rejection_sampling_triton import rejection_sample_triton
except ImportError:  # pragma: no cover
    rejection_sample_triton = None

ACCEPT_STREAM = 0x61636370  # stream tags: mix_seed(row key, tag) is the stream's key
RECOVER_STREAM = 0x72656376
_MASK64 = (1 << 64) - 1
RESIDUAL_EPS = 1e-5  # above the fp32 rounding noise of p - q (~1e-7 relative per token; the Triton
# kernel's exp is within ~1e-6)


def mix_seed_array(seeds: np.ndarray, indexes: np.ndarray) -> np.ndarray:
    """`kernels.sampling_noise.mix_seed` over arrays, bit for bit: seeds and indexes uint64
    (seeds already reduced mod 2**64; numpy's uint64 arithmetic wraps mod 2**64 and shifts
    logically, as the Python ints masked to 64 bits do). Returns the 63-bit keys, uint64."""
    z = seeds * np.uint64(0x9E3779B97F4A7C15) + indexes + np.uint64(1)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) >> np.uint64(1)


def _halves(keys: np.ndarray) -> torch.Tensor:
    """[n, 2] int64 (low 32 bits, high 31 bits) of 63-bit uint64 keys (`noise_keys`'s layout)."""
    return torch.from_numpy(np.stack([keys & np.uint64(0xFFFFFFFF), keys >> np.uint64(32)], axis=1).astype(np.int64))


def rejection_keys(seeds: list[int], indexes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The noise inputs of R rows: row r's key is mix_seed(seeds[r], indexes[r]) (the
    ordinary sampler's key at that output index), its streams' keys mix_seed(key, tag).

    seeds: R request seeds (any ints); indexes: R output indexes (>= 0).
    Returns (keys [R, 4] int64: the row key's `noise_keys` halves (the bonus draw's Gumbel
    noise) then the recovery stream's; u [R] fp32: the accept uniform, the top 24 bits of
    the hash of the accept stream's key times 2**-24, in [0, 1) and exact in fp32).
    CPU tensors; vectorised (numpy), no Python work per row beyond the list conversion."""
    n = len(seeds)
    if n == 0:
        return torch.zeros((0, 4), dtype=torch.long), torch.zeros(0)
    row = mix_seed_array(np.array([s & _MASK64 for s in seeds], dtype=np.uint64),
                         np.array(indexes, dtype=np.uint64))
    rec = mix_seed_array(row, np.full(n, RECOVER_STREAM, dtype=np.uint64))
    acc = _halves(mix_seed_array(row, np.full(n, ACCEPT_STREAM, dtype=np.uint64)))
    h = _mix32(_mix32(acc[:, 0]) ^ acc[:, 1])
    u = (h >> 8).to(torch.float32) * (1.0 / 16777216.0)
    return torch.cat([_halves(row), _halves(rec)], dim=1), u


def restrict_to_filtered(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                         top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [R, V] fp32 with -inf outside the filtered set (`filtered_probs`: temperature,
    top-k, top-p, min-p) of the given rows; a new tensor, or `logits` itself when rows is
    empty. rows: [n] int64 row indexes (sampled rows that filter); temperature [n] fp32 > 0,
    top_k [n] int64, top_p [n] fp32, min_p [n] fp32: their parameters."""
    if rows.numel() == 0:
        return logits
    sub = logits[rows]
    keep = filtered_probs(sub, temperature, top_k, top_p, min_p) > 0
    out = logits.clone()
    out[rows] = sub.masked_fill(~keep, float("-inf"))
    return out


def rejection_sample_ref(logits: torch.Tensor, temperature: torch.Tensor, draft_ids: torch.Tensor,
                         q: torch.Tensor, q_index: torch.Tensor, keys: torch.Tensor,
                         u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row accept / recover / bonus decisions (module doc), torch.

    logits: [R, V] fp32, the target's processed logits, -inf outside each row's filtered set
        (`restrict_to_filtered`). temperature: [R] fp32, 0 = greedy.
    draft_ids: [R] int64, the draft the row verifies (in [0, V)), or -1 for a bonus row.
    q: [D, V] fp32, the draft distributions (rows sum to 1). q_index: [R] int64, the row of q
        of each draft row (-1 for bonus rows; unused for greedy rows).
    keys: [R, 4] int64 and u: [R] fp32, from `rejection_keys`.
    Returns (tokens [R] int64: the row's emitted token if the seq reaches it: the draft when
    accepted, else the recovered token; the bonus draw on bonus rows; accepted [R] bool,
    False on bonus rows).
    """
    vocab = logits.shape[1]
    tokens = logits.argmax(dim=-1)
    accepted = (tokens == draft_ids) & (draft_ids >= 0)
    rand = (temperature > 0).nonzero().flatten()
    if rand.numel() == 0:
        return tokens, accepted
    x = logits[rand].float() / temperature[rand][:, None]
    bonus = draft_ids[rand] < 0
    if bool(bonus.any()):
        b = rand[bonus]
        tokens[b] = (x[bonus] + race_noise(keys[b, :2], vocab)).argmax(dim=-1)
    if bool(bonus.all()):
        return tokens, accepted
    rows, xs = rand[~bonus], x[~bonus]
    d = draft_ids[rows][:, None]
    top = xs.max(dim=-1, keepdim=True).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(xs - top)
    total = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(total > 0, total, torch.ones_like(total))
    qr = q[q_index[rows]].float()
    acc = u[rows] * qr.gather(1, d).squeeze(1) < p.gather(1, d).squeeze(1)
    accepted[rows] = acc
    tokens[rows] = d.squeeze(1)
    rej = (~acc).nonzero().flatten()
    if rej.numel():
        g = race_noise(keys[rows[rej], 2:], vocab)
        r = p[rej] - qr[rej]
        score = torch.where(r > 0, torch.log(r) + g, float("-inf"))
        empty = r.clamp_min(0).sum(dim=-1) <= RESIDUAL_EPS  # p = q up to rounding: draw from p
        tokens[rows[rej]] = torch.where(empty, (xs[rej] + g).argmax(dim=-1), score.argmax(dim=-1))
    return tokens, accepted


def rejection_sample(logits, temperature, draft_ids, q, q_index, keys, u) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher for `rejection_sample_ref` (see there for shapes): the Triton kernel on
    CUDA when it imports, the reference otherwise."""
    if logits.is_cuda and rejection_sample_triton is not None:
        return rejection_sample_triton(logits, temperature, draft_ids, q, q_index, keys, u, RESIDUAL_EPS)
    return rejection_sample_ref(logits, temperature, draft_ids, q, q_index, keys, u)
