"""The sampler: one token per sampled sequence from its logits and `SamplingParams`.

Turns per-request parameters into the tensors of `kernels.sampling.sample`. A step whose
rows are all greedy (temperature 0) takes one argmax and nothing else. A request without a
seed (the engine normally sets one) uses the worker's `default_seed`.
"""

from __future__ import annotations

import torch

from kernels.sampling import mix_seed, sample
from shared.protocol import SamplingParams


class Sampler:
    """sampler(logits [n, vocab] fp32, params: n SamplingParams, output_indices: n ints)
    -> n token ids (Python ints). Draw i depends only on (seed, output_index) and logits."""

    def __init__(self, default_seed: int = 0):
        self.default_seed = default_seed

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 output_indices: list[int]) -> list[int]:
        if all(p.temperature == 0 for p in params):
            return logits.argmax(dim=-1).tolist()
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        seeds = [mix_seed(self.default_seed if p.seed is None else p.seed, i)
                 for p, i in zip(params, output_indices)]
        dev = logits.device
        return sample(logits, temp.to(dev), top_k.to(dev), top_p.to(dev), min_p.to(dev), seeds).tolist()
