"""Validation of a new request at the engine: what the worker could not run, refused
before it joins the scheduler (docs/ARCHITECTURE.md §5).

A request refused here is the client's fault (error_kind "invalid", the frontend answers
400). The checks run on every AddRequest, on the engine loop: plain comparisons only.
"""

from __future__ import annotations

import math

from shared import protocol as P

MAX_LOGPROBS = 20  # top logprobs per position a request may ask for


def invalid_reason(msg: P.AddRequest, max_model_len: int, vocab_size: int) -> str | None:
    """Why `msg` cannot run, or None.

    max_model_len: prompt + output tokens of one request. vocab_size: token ids are in
    [0, vocab_size). Checks the prompt (non-empty, fits with max_tokens, ids in range) and
    the sampling parameters the worker turns into int64 / fp32 tensors (a value it cannot
    hold would fail the whole step, every request in it, not just this one).
    """
    sp = msg.sampling
    n = len(msg.prompt_token_ids)
    vocab = vocab_size
    if n == 0:
        return "empty prompt"
    if n + sp.max_tokens > max_model_len:  # max_tokens 0 (scoring) may fill the context
        return f"prompt ({n} tokens) + max_tokens ({sp.max_tokens}) exceeds max_model_len {max_model_len}"
    if any(t < 0 or t >= vocab for t in msg.prompt_token_ids):
        return "prompt token id out of range"
    if sp.max_tokens < 0 or sp.min_tokens < 0:
        return "max_tokens and min_tokens must be >= 0"
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(sp, name)
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            return f"{name} must be in 0..{MAX_LOGPROBS}"
    if any(t < 0 or t >= vocab for t in list(sp.logit_bias) + list(sp.stop_token_ids)):
        return "logit_bias / stop_token_ids token id out of range"
    if sp.repetition_penalty <= 0:
        return "repetition_penalty must be > 0"
    if not 0 <= sp.top_k < 2 ** 31:
        return "top_k must be in 0..2147483647 (0: off)"
    if sp.seed is not None and not -2 ** 63 <= sp.seed < 2 ** 63:
        return "seed must fit in 64 bits"
    finite = (sp.temperature, sp.top_p, sp.min_p, sp.presence_penalty, sp.frequency_penalty,
              sp.repetition_penalty, *sp.logit_bias.values())
    if not all(math.isfinite(v) for v in finite):
        return "sampling parameters must be finite numbers"
    if sp.temperature < 0 or not 0 < sp.top_p <= 1 or not 0 <= sp.min_p <= 1:
        return "temperature must be >= 0, top_p in (0, 1] and min_p in [0, 1]"
    return None
