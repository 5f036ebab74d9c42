"""Prompt logprobs of prefill chunks (a request's `prompt_logprobs`), across its chunks.

A chunk's logits score the prompt tokens after its first; the first token of a chunk is
scored by the previous chunk's last row, kept here until that chunk comes.
"""

from __future__ import annotations

import torch

from services.worker.sampler import make_token_logprobs
from shared.protocol import ScheduledSeq, TokenLogprob

MAX_PROMPT_CARRY = 256  # requests whose last prompt-chunk logits wait for their next chunk


class PromptScorer:
    """The model runner's prompt-logprob scorer (one per runner)."""

    def __init__(self) -> None:
        # request id -> logits [vocab] of the last position of its previous prompt chunk,
        # which scores the first token of its next chunk
        self._carry: dict[str, torch.Tensor] = {}

    def score(self, s: ScheduledSeq, logits: torch.Tensor) -> list[TokenLogprob]:
        """Logprobs of the prompt tokens of one chunk (token i given tokens < i).

        logits: [len(s.token_ids), vocab] fp32, one row per chunk position. Row j predicts the
        token at position start_pos + j + 1, so the chunk scores positions start_pos + 1 ..
        min(start_pos + len, num_prompt_tokens) - 1 itself; the token at start_pos is scored
        with the previous chunk's last row, kept here. Token 0 has no logprob.
        Returns them in position order (k = sampling.prompt_logprobs alternatives each).
        """
        assert s.sampling is not None  # resolved (plan_state.py)
        n, p, start = len(s.token_ids), s.num_prompt_tokens, s.start_pos
        rows = [logits[j] for j in range(max(0, min(n, p - start) - 1))]
        targets = list(s.token_ids[1:1 + len(rows)])
        carry = self._carry.pop(s.request_id, None)
        if start > 0 and carry is not None:
            rows.insert(0, carry)
            targets.insert(0, s.token_ids[0])
        if start + n < p:  # the next chunk's first token is scored by this chunk's last row
            while len(self._carry) >= MAX_PROMPT_CARRY:
                self._carry.pop(next(iter(self._carry)))
            self._carry[s.request_id] = logits[n - 1].clone()
        if not rows:
            return []
        lp = torch.log_softmax(torch.stack(rows).float(), dim=-1)
        ids = torch.tensor(targets, dtype=torch.long, device=lp.device)
        return make_token_logprobs(lp, ids, [s.sampling.prompt_logprobs or 0] * len(rows))
