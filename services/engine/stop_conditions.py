"""When a request ends after a sampled token (docs/ARCHITECTURE.md §5): the structured
output grammar, EOS (unless ignore_eos, and not before min_tokens), stop token ids,
max_tokens and max_model_len. Stop strings are checked by the frontend on text.
"""

from __future__ import annotations

from collections.abc import Container

from services.engine.request import Request
from shared.protocol import FinishReason


def stop_reason(req: Request, tok: int, eos: Container[int], max_model_len: int) -> FinishReason | None:
    """The finish reason for `req` once `tok` (already appended to its outputs) is taken,
    or None to go on: "stop" (EOS in `eos`, a stop token id, or the grammar accepted its
    end; req.stop_token_id is set), "length" (max_tokens or max_model_len tokens reached),
    "error" (the grammar rejects tok: the worker's mask forbids it, a fault, not the
    client's). Advances req.grammar by tok."""
    sp = req.sampling
    n_out = len(req.output_token_ids)
    if req.grammar is not None:
        if not req.grammar.accept(tok):
            return FinishReason.ERROR
        if req.grammar.is_terminated():  # the grammar accepted its stop token (EOS)
            req.stop_token_id = tok
            return FinishReason.STOP
    if n_out >= sp.min_tokens:
        if not sp.ignore_eos and tok in eos:
            req.stop_token_id = tok
            return FinishReason.STOP
        if tok in sp.stop_token_ids:
            req.stop_token_id = tok
            return FinishReason.STOP
    if n_out >= sp.max_tokens or req.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
