"""The sampler: one token per sampled sequence from its logits and `SamplingParams`.

Turns per-request parameters into the tensors of `kernels.sampling`. Before the draw it
applies, in this order (vLLM V1's order): `logit_bias`, the `min_tokens` mask (EOS ids
unless ignore_eos, and stop_token_ids, while output_index < min_tokens), penalties
(repetition over prompt + output, then frequency / presence over output; the engine sends
`penalty_token_ids` and `num_prompt_tokens` only for rows that use them), and the
structured-output mask (`allowed_token_bitmask`, xgrammar's packed int32 layout).
Each processor runs only on the rows that need it, as one batched tensor op.

A step whose rows are all greedy (temperature 0) takes one argmax after the processors.
A request without a seed (the engine normally sets one) uses the worker's `default_seed`.

Logprobs (when `sampling.logprobs` is set) are "raw logprobs", vLLM's default: the
log_softmax of the model's logits before bias, penalties, masks and temperature. They are
the model's own distribution, comparable across requests and with transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from kernels.sampling import (apply_allowed_mask_ref, apply_logit_bias_ref, apply_penalties,
                              sample, token_logprobs_ref, unpack_bitmask)
from kernels.sampling_noise import mix_seed
from shared.protocol import SamplingParams, ScheduledSeq, TokenLogprob


@dataclass
class SamplerOutput:
    """token_ids: one per row. logprobs: one per row (None for rows that did not ask), or
    empty when no row asked. token_tensor: the same ids where they were drawn (the next
    step's pending tokens come from it)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    token_tensor: torch.Tensor | None = None  # token_ids on the logits' device, int64 [rows]


def make_token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> list[TokenLogprob]:
    """TokenLogprob per row. logprobs [n, vocab] fp32 (log_softmax), token_ids [n] int64,
    ks: n ints, the alternatives wanted per row (0..20)."""
    chosen, rank, top_lp, top_ids = token_logprobs_ref(logprobs, token_ids, max(ks, default=0))
    chosen, rank = chosen.tolist(), rank.tolist()
    top_lp, top_ids, toks = top_lp.tolist(), top_ids.tolist(), token_ids.tolist()
    return [TokenLogprob(toks[i], chosen[i], rank[i], top_ids[i][:k], top_lp[i][:k])
            for i, k in enumerate(ks)]


def _has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


class Sampler:
    """Sampling of one step.

    `sampler(logits, params, output_indices)` -> token ids: the plain path (no processors).
    `sampler.sample(logits, seqs)` -> SamplerOutput: the full path, reading every
    per-request field of the ScheduledSeqs.
    logits: [n, vocab] fp32. Draw i depends only on (seed, output_index) and its logits.
    eos_token_ids: the model's EOS ids, masked while output_index < min_tokens.
    """

    def __init__(self, default_seed: int = 0, eos_token_ids: tuple[int, ...] | list[int] = ()):
        self.default_seed = default_seed
        self.eos_token_ids = list(eos_token_ids)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 output_indices: list[int]) -> list[int]:
        return self._draw(logits, params, output_indices).tolist()

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams],
              output_indices: list[int]) -> torch.Tensor:
        if all(p.temperature == 0 for p in params):
            return logits.argmax(dim=-1)
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        seeds = [mix_seed(self.default_seed if p.seed is None else p.seed, i)
                 for p, i in zip(params, output_indices)]
        dev = logits.device
        filtered = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params)
        return sample(logits, temp.to(dev, non_blocking=True), top_k.to(dev), top_p.to(dev), min_p.to(dev),
                      seeds, filtered)

    def sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq], keep=None) -> SamplerOutput:
        """Apply the logits processors, draw, and compute logprobs where asked.

        logits: [len(seqs), vocab] fp32 (not modified). keep: None, or a callable given the
        drawn ids [len(seqs)] int64 on the device before they are read back to the host
        (so that its device work is queued before the host waits). Returns SamplerOutput.
        Raises ValueError when a row's bitmask is not whole int32 words.
        """
        params = _params(seqs)
        want_lp = [p.logprobs is not None for p in params]
        raw_lp = torch.log_softmax(logits.float(), dim=-1) if any(want_lp) else None
        processed = self.process(logits, seqs)
        toks = self._draw(processed, params, [s.output_index for s in seqs])
        if keep is not None:
            keep(toks)
        lps: list[TokenLogprob | None] = []
        if raw_lp is not None:
            rows = [i for i, w in enumerate(want_lp) if w]
            idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
            made = make_token_logprobs(raw_lp[idx], toks[idx], [params[i].logprobs or 0 for i in rows])
            lps = [None] * len(seqs)
            for i, tl in zip(rows, made):
                lps[i] = tl
        return SamplerOutput(toks.tolist(), lps, toks)

    def process(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """The logits after bias, min_tokens, penalties and the structured mask.
        Returns `logits` itself when no row uses any processor, else a new tensor."""
        dev = logits.device
        n, vocab = logits.shape
        out = logits
        # logit_bias: one sparse index_put over every (row, token) pair
        params = _params(seqs)
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        for i, p in enumerate(params):
            for tok, v in p.logit_bias.items():
                if 0 <= tok < vocab:
                    rows.append(i)
                    cols.append(tok)
                    vals.append(v)
        # min_tokens: stop ids get -inf until enough tokens are out
        for i, (s, p) in enumerate(zip(seqs, params)):
            if s.output_index < p.min_tokens:
                stop = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                for tok in stop:
                    if 0 <= tok < vocab:
                        rows.append(i)
                        cols.append(tok)
                        vals.append(float("-inf"))
        if rows:
            out = out.clone()
            apply_logit_bias_ref(out, torch.tensor(rows, device=dev), torch.tensor(cols, device=dev),
                                 torch.tensor(vals, dtype=torch.float32, device=dev))
        pen = [i for i, p in enumerate(params) if _has_penalty(p)]
        if pen:
            width = max(1, max(len(seqs[i].penalty_token_ids) for i in pen))
            ids = np.full((len(pen), width), vocab, dtype=np.int64)
            is_out = np.zeros((len(pen), width), dtype=bool)
            for j, i in enumerate(pen):
                t = seqs[i].penalty_token_ids
                if len(t):
                    ids[j, :len(t)] = np.clip(np.asarray(t, dtype=np.int64), 0, vocab)
                is_out[j, seqs[i].num_prompt_tokens:len(t)] = True
            ps = [params[i] for i in pen]
            idx = torch.tensor(pen, device=dev)
            if out is logits:
                out = out.clone()
            out[idx] = apply_penalties(
                out[idx], torch.from_numpy(ids).to(dev), torch.from_numpy(is_out).to(dev),
                torch.tensor([p.presence_penalty for p in ps], dtype=torch.float32, device=dev),
                torch.tensor([p.frequency_penalty for p in ps], dtype=torch.float32, device=dev),
                torch.tensor([p.repetition_penalty for p in ps], dtype=torch.float32, device=dev))
        masks = [(i, b) for i, s in enumerate(seqs) if (b := s.allowed_token_bitmask) is not None]
        if masks:
            masked = [i for i, _ in masks]
            words = []
            for i, b in masks:
                if len(b) % 4:
                    raise ValueError(f"request {seqs[i].request_id}: bitmask of {len(b)} bytes is not int32 words")
                words.append(np.frombuffer(b, dtype="<i4"))
            width = max(len(w) for w in words)
            packed = np.zeros((len(masked), width), dtype=np.int32)
            for j, w in enumerate(words):
                packed[j, :len(w)] = w
            allowed = torch.ones(n, vocab, dtype=torch.bool, device=dev)
            allowed[torch.tensor(masked, device=dev)] = unpack_bitmask(torch.from_numpy(packed).to(dev), vocab)
            if out is logits:
                out = out.clone()
            apply_allowed_mask_ref(out, allowed)
        return out


def _params(seqs: list[ScheduledSeq]) -> list[SamplingParams]:
    """The seqs' sampling parameters: every plan is resolved before the runner samples
    (`shared.plan_state.PlanState` fills the None of later seqs), so none is None here."""
    return cast("list[SamplingParams]", [s.sampling for s in seqs])
