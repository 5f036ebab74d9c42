"""Seeded Gumbel noise of the sampler: a pure integer hash of (row key, token id), so that a
seeded request draws the same tokens in every process, on the CPU and in the Triton kernel
(`kernels.sampling_triton`, which repeats `_mix32`'s constants).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_MASK32 = 0xFFFFFFFF
HASH_C1 = 0x21F0AAAD  # multipliers of Wellons' 32-bit "lowbias" style mixer (both < 2**31)
HASH_C2 = 0x735A2D97


def mix_seed(seed: int, index: int) -> int:
    """A stable 63-bit seed for draw `index` of a request seeded `seed` (splitmix64 finalizer
    of seed * golden-ratio + index). Pure integer math: same value in every process."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def noise_keys(seeds: list[int]) -> torch.Tensor:
    """[n, 2] int64 (low 32 bits, high 31 bits) of each row's 63-bit key."""
    return torch.tensor([[s & _MASK32, (s >> 32) & 0x7FFFFFFF] for s in seeds], dtype=torch.long)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """32-bit mixer on int64 tensors holding values in [0, 2**32). Products stay < 2**63."""
    x = x ^ (x >> 16)
    x = (x * HASH_C1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * HASH_C2) & _MASK32
    return x ^ (x >> 15)


def race_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise G [n, vocab] fp32 of rows with keys [n, 2] int64 (see `noise_keys`).

    U = (top 23 bits of mix32(mix32(id ^ k0) ^ k1) + 0.5) / 2**23, in (0, 1) exactly in fp32
    (24 bits would round the largest U to 1.0 and make G infinite);
    G = -log(-log(U)). Pure function of (key, token id)."""
    ids = torch.arange(vocab, dtype=torch.long, device=keys.device)[None, :]
    h = _mix32(_mix32(ids ^ keys[:, :1]) ^ keys[:, 1:])
    u = ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)
    return -torch.log(-torch.log(u))
