"""Token sampling: greedy, temperature, top-k, top-p, min-p, seeded per draw.

Order of the filters (as in vLLM): temperature, then top-k, then top-p on what top-k
kept, then min-p (relative to the top probability, which every filter keeps).
The draw is Gumbel-max (equivalent to the exponential race): token =
argmax_i(logits_i / T + G_i) over the allowed set, G_i = -log(-log(U_i)), which picks i
with probability softmax(logits / T)_i renormalised over the allowed set.

The noise is counter-based: U_i is a hash of (row key, token id i) (`race_noise`), the row
key being the 63-bit `mix_seed(seed, output_index)`. So a draw depends only on (seed,
output index, logits): the same in any batch, on the CPU and on the GPU, and when a
request is recomputed. The hash (`_mix32`, two rounds over 32-bit words in int64
arithmetic, no overflow) is written once for torch and once for Triton with the same
integer operations, so both produce the same U bit for bit; the float log may differ in
the last ulp between the two, which changes a draw only on a near-tie.

Dispatcher `sample`: the Triton kernel (`kernels/sampling_triton.py`) on CUDA for batches
with no top-k/top-p/min-p (one pass over the logits, no softmax, no sort); the torch
reference otherwise. No sort happens unless a row uses top-p.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# the seeded noise lives in kernels.sampling_noise (the Triton sampler reads it too, so this
# module imports the sampler without a circle)
from kernels.sampling_noise import noise_keys, race_noise

sample_triton: Callable[..., torch.Tensor] | None  # sample_triton(logits, temperature, seeds)
try:  # the Triton sampler; absent without triton (CPU-only installs)
    from kernels.sampling_triton import sample_triton
except ImportError:  # pragma: no cover
    sample_triton = None


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The distribution each row samples from, zero outside its allowed set.

    logits: [n, vocab] (any float dtype; math in fp32).
    temperature: [n] fp32 > 0. top_k: [n] int64, 0 = off. top_p: [n] fp32 in (0, 1],
    1 = off. min_p: [n] fp32 in [0, 1), 0 = off.
    Returns [n, vocab] fp32, unnormalised after filtering (the draw does not need it).
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
               top_p: torch.Tensor, min_p: torch.Tensor, seeds: list[int],
               filtered: bool | None = None) -> torch.Tensor:
    """Sample one token per row.

    logits: [n, vocab] (fp32/bf16/fp16).
    temperature: [n] fp32; rows with 0 are greedy (argmax, ties to the lowest id).
    top_k, top_p, min_p: [n], see `filtered_probs`.
    seeds: n Python ints, each row's `mix_seed(seed, output_index)`.
    filtered: whether any row uses top-k/top-p/min-p (None = read from the tensors).
    Returns [n] int64 token ids.
    """
    out = logits.argmax(dim=-1)
    rand_rows = (temperature > 0).nonzero().flatten().tolist()
    if not rand_rows:
        return out
    idx = torch.tensor(rand_rows, dtype=torch.long, device=logits.device)
    temp = temperature[idx]
    scores = logits[idx].float() / temp[:, None]
    if filtered is None or filtered:
        keep = filtered_probs(logits[idx], temp, top_k[idx], top_p[idx], min_p[idx]) > 0
        scores = scores.masked_fill(~keep, float("-inf"))
    keys = noise_keys([seeds[r] for r in rand_rows]).to(logits.device)
    out[idx] = (scores + race_noise(keys, logits.shape[1])).argmax(dim=-1)
    return out


def sample(logits, temperature, top_k, top_p, min_p, seeds, filtered: bool | None = None) -> torch.Tensor:
    """Dispatcher for `sample_ref` (see there for shapes). The Triton kernel runs on CUDA
    when no row filters (`filtered` False, or read from the tensors when None)."""
    if logits.is_cuda and sample_triton is not None:
        if filtered is None:
            filtered = bool(((top_k > 0) | (top_p < 1.0) | (min_p > 0)).any())
        if not filtered:
            return sample_triton(logits, temperature, seeds)
    return sample_ref(logits, temperature, top_k, top_p, min_p, seeds, filtered)


# ---------------------------------------------------------------- logits processors
#
# Applied by the sampler before `sample`, in this order (as vLLM V1 does): logit_bias,
# min_tokens (stop ids masked), penalties (repetition, then frequency/presence), and the
# structured-output mask. Each works on a whole batch at once; rows that do not use a
# processor are either left out by the caller or get neutral parameters.

apply_penalties_triton = None  # optional GPU kernel, same signature as apply_penalties_ref


def apply_logit_bias_ref(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                         values: torch.Tensor) -> torch.Tensor:
    """Add OpenAI `logit_bias` values: logits[rows[j], cols[j]] += values[j], in place.

    logits: [n, vocab] fp32. rows, cols: [m] int64 (a flattened sparse matrix, one entry
    per (request, token) pair). values: [m] fp32 (OpenAI allows -100..100; +100 in practice
    forces the token, -100 bans it). Returns logits.
    """
    if rows.numel():
        logits.index_put_((rows, cols), values.to(logits.dtype), accumulate=True)
    return logits


def apply_penalties_ref(logits: torch.Tensor, token_ids: torch.Tensor, is_output: torch.Tensor,
                        presence: torch.Tensor, frequency: torch.Tensor,
                        repetition: torch.Tensor) -> torch.Tensor:
    """Repetition, frequency and presence penalties for a batch of rows.

    logits: [n, vocab] fp32. token_ids: [n, L] int64, each row's prompt + output tokens,
    padded with `vocab` (an id past the end, ignored). is_output: [n, L] bool, True where
    the token is an output token (the padding's value does not matter).
    presence, frequency: [n] fp32 (0 = off). repetition: [n] fp32 > 0 (1 = off).
    Returns a new [n, vocab] fp32 tensor.

    Formulas:
    - repetition (CTRL, Keskar et al. 2019, as in HF transformers and vLLM): every token
      seen in prompt or output has its logit divided by `repetition` when positive and
      multiplied by it when negative.
    - frequency / presence (OpenAI's documented formula, over output tokens only):
      logit -= count * frequency + (count > 0) * presence.
    """
    n, vocab = logits.shape
    counts = torch.zeros(n, vocab + 1, dtype=torch.float32, device=logits.device)
    counts.scatter_add_(1, token_ids, is_output.to(torch.float32))
    counts = counts[:, :vocab]
    seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, token_ids, True)
    seen = seen[:, :vocab]
    rep = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - counts * frequency[:, None] - (counts > 0).to(torch.float32) * presence[:, None]


def apply_penalties(logits, token_ids, is_output, presence, frequency, repetition) -> torch.Tensor:
    """Dispatcher for `apply_penalties_ref` (see there for shapes)."""
    if logits.is_cuda and apply_penalties_triton is not None:
        return apply_penalties_triton(logits, token_ids, is_output, presence, frequency, repetition)
    return apply_penalties_ref(logits, token_ids, is_output, presence, frequency, repetition)


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Unpack xgrammar's token bitmask into a boolean mask.

    words: [n, W] int32, bit b of word w (little-endian bit order, LSB first) set when
    token 32*w + b is allowed (xgrammar's `allocate_token_bitmask` layout, W =
    ceil(vocab_size / 32)). vocab: logits width; tokens past 32*W are disallowed.
    Returns [n, vocab] bool, True = allowed.
    """
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = ((words[:, :, None] >> shifts) & 1).bool().reshape(words.shape[0], -1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    pad = torch.zeros(words.shape[0], vocab - bits.shape[1], dtype=torch.bool, device=words.device)
    return torch.cat([bits, pad], dim=1)


def apply_allowed_mask_ref(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] fp32, allowed [n, vocab] bool: disallowed logits become -inf, in place.
    Returns logits."""
    return logits.masked_fill_(~allowed, float("-inf"))


# ---------------------------------------------------------------- logprobs


def token_logprobs_ref(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int):
    """Logprob, rank and top-k alternatives of given tokens.

    logprobs: [n, vocab] fp32, log_softmax of the logits. token_ids: [n] int64.
    k: alternatives per row (0..vocab; 0 = none).
    Returns (chosen [n] fp32, rank [n] int64 with 1 = the argmax (1 + number of tokens with a
    strictly larger logprob, as vLLM counts), top_logprobs [n, k] fp32 best first,
    top_ids [n, k] int64).
    """
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    rank = (logprobs > chosen[:, None]).sum(dim=1) + 1
    if k > 0:
        top = torch.topk(logprobs, min(k, logprobs.shape[1]), dim=-1)
        return chosen, rank, top.values, top.indices
    empty = logprobs.new_zeros(logprobs.shape[0], 0)
    return chosen, rank, empty, empty.long()
