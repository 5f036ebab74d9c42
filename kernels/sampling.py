"""Token sampling: greedy, temperature, top-k, top-p, min-p, seeded per draw.

Order of the filters (as in vLLM): temperature, then top-k, then top-p on what top-k
kept, then min-p (relative to the top probability, which every filter keeps).
The draw is the exponential race (equivalent to Gumbel-max): token = argmax(p_i / E_i),
E_i ~ Exp(1), which picks i with probability p_i. The noise E of a row comes only from a
torch.Generator seeded with `mix_seed(seed, output_index)`, so a recomputed request draws
the same token from the same distribution. No sort happens unless a row uses top-p.

Dispatcher `sample` picks the torch reference on the CPU; a Triton kernel lands with the
GPU issue (its noise must then come from the same seeds to keep recompute exact).
"""

from __future__ import annotations

import torch

sample_triton = None  # set by the GPU issue: same signature as sample_ref

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
    """A stable 63-bit seed for draw `index` of a request seeded `seed` (splitmix64 finalizer
    of seed * golden-ratio + index). Pure integer math: same value in every process."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The distribution each row samples from, zero outside its allowed set.

    logits: [n, vocab] (any float dtype; math in fp32).
    temperature: [n] fp32 > 0. top_k: [n] int64, 0 = off. top_p: [n] fp32 in (0, 1],
    1 = off. min_p: [n] fp32 in [0, 1), 0 = off.
    Returns [n, vocab] fp32, unnormalised after filtering (the race does not need it).
    Ties at the top-k threshold are all kept.
    """
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, probs.shape[-1]).clamp(max=probs.shape[-1])
        top = torch.topk(probs, int(k.max()), dim=-1).values
        kth = top.gather(1, (k - 1)[:, None])
        probs = probs.masked_fill(probs < kth, 0.0)
    if bool((top_p < 1.0).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        total = cum[:, -1:]
        # keep a token when the mass before it is below top_p (the top token always stays)
        drop_sorted = (cum - sorted_p) >= top_p[:, None] * total
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if bool((min_p > 0).any()):
        top = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < min_p[:, None] * top, 0.0)
    return probs


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
               top_p: torch.Tensor, min_p: torch.Tensor, seeds: list[int]) -> torch.Tensor:
    """Sample one token per row.

    logits: [n, vocab] (fp32/bf16/fp16).
    temperature: [n] fp32; rows with 0 are greedy (argmax, ties to the lowest id).
    top_k, top_p, min_p: [n], see `filtered_probs`.
    seeds: n Python ints, each row's `mix_seed(seed, output_index)`.
    Returns [n] int64 token ids.
    """
    out = logits.argmax(dim=-1)
    rand_rows = (temperature > 0).nonzero().flatten().tolist()
    if not rand_rows:
        return out
    idx = torch.tensor(rand_rows, dtype=torch.long)
    probs = filtered_probs(logits[idx], temperature[idx], top_k[idx], top_p[idx], min_p[idx])
    noise = torch.empty_like(probs)
    gen = torch.Generator(device=logits.device)
    for j, row in enumerate(rand_rows):
        gen.manual_seed(seeds[row])
        noise[j].exponential_(generator=gen)
    out[idx] = (probs / noise).argmax(dim=-1)
    return out


def sample(logits, temperature, top_k, top_p, min_p, seeds) -> torch.Tensor:
    """Dispatcher for `sample_ref` (see there for shapes)."""
    if logits.is_cuda and sample_triton is not None:
        return sample_triton(logits, temperature, top_k, top_p, min_p, seeds)
    return sample_ref(logits, temperature, top_k, top_p, min_p, seeds)
