"""The counter-based Gumbel noise of the sampler: finite for every token, so a masked
(-inf) token can never win through an infinite or NaN score."""

import torch

from kernels.sampling import sample_ref
from kernels.sampling_noise import mix_seed, noise_keys, race_noise


def test_race_noise_is_finite_for_every_token_over_many_keys():
    keys = noise_keys([mix_seed(seed, i) for seed in range(50) for i in range(8)])
    g = race_noise(keys, 49152)
    assert torch.isfinite(g).all()


def test_masked_tokens_are_never_sampled():
    vocab, n = 49152, 256
    logits = torch.randn(n, vocab)
    allowed = torch.zeros(n, vocab, dtype=torch.bool)
    allowed[:, [5, 77, 4099]] = True
    logits = logits.masked_fill(~allowed, float("-inf"))
    ones = torch.ones(n)
    seeds = [mix_seed(1234 + r, r % 7) for r in range(n)]
    out = sample_ref(logits, ones, torch.zeros(n, dtype=torch.long), ones, torch.zeros(n), seeds,
                     filtered=False)
    assert set(out.tolist()) <= {5, 77, 4099}
