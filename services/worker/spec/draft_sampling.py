"""How a drafter turns its logits into draft tokens (docs/ARCHITECTURE.md §5.5).

- greedy drafting: the argmax (ties to the lowest id); the drafts are point masses and are
  verified by drawing the target and comparing (`services.worker.spec.verify`).
- probabilistic drafting: the draft is sampled from q = softmax(logits / T) with the
  request's temperature T (q is what rejection sampling reads, `Proposal.probs`). The draw
  is Gumbel-max with the counter-based noise of the sampler (`kernels.sampling_noise`) keyed
  by `draft_seed(seed, output index)`: the draft of output index j of a seeded request is
  the same in any batch and on recompute, and it comes from a stream of its own, apart from
  the target's draw of the same output index (which is keyed by `mix_seed(seed, j)`) and
  from the verifier's. A greedy request (T = 0) drafts its argmax, q a one-hot row.
"""

from __future__ import annotations

import torch

from kernels.sampling_noise import mix_seed, noise_keys, race_noise

# XORed into a request's seed: the drafts' noise stream (any odd 64-bit constant apart
# from the other streams' would do)
DRAFT_STREAM = 0xD2AF_7E11_5EED_0001


def draft_seed(seed: int, output_index: int) -> int:
    """The 63-bit noise key of the draft at `output_index` of a request seeded `seed`."""
    return mix_seed(seed ^ DRAFT_STREAM, output_index)


def choose_drafts(logits: torch.Tensor, temperatures: list[float], seeds: list[int] | None,
                  probabilistic: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens of rows of logits [n, vocab] fp32 (-inf where the drafter cannot
    propose a token). temperatures: n request temperatures. seeds: n `draft_seed` keys
    (probabilistic only). Returns (tokens [n] int64 on the logits' device, q [n, vocab]
    fp32 or None when not probabilistic)."""
    greedy = logits.argmax(dim=-1)
    if not probabilistic:
        return greedy, None
    assert seeds is not None and len(seeds) == logits.shape[0]
    dev = logits.device
    temp = _on(torch.tensor([t if t > 0 else 1.0 for t in temperatures], dtype=torch.float32), dev)
    scaled = logits.float() / temp[:, None]
    q = torch.softmax(scaled, dim=-1)
    noise = race_noise(_on(noise_keys(seeds), dev), logits.shape[1])
    tokens = (scaled + noise).argmax(dim=-1)
    cold = [i for i, t in enumerate(temperatures) if t <= 0]
    if cold:
        idx = _on(torch.tensor(cold, dtype=torch.long), dev)
        tokens[idx] = greedy[idx]
        q[idx] = torch.nn.functional.one_hot(greedy[idx], logits.shape[1]).float()
    return tokens, q


def _on(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor on `dev`: pinned and non-blocking on CUDA (no wait for the stream)."""
    if dev.type != "cuda":
        return t
    return t.pin_memory().to(dev, non_blocking=True)
