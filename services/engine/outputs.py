"""What the engine core emits: `RequestOutput`s addressed to frontend identities.

`Emitted` is what each `EngineCore` verb returns for the process to send
(docs/ARCHITECTURE.md §2): outputs grouped by frontend, sent only while that frontend is
attached, plus outputs sent to their identity even when it is not (refusals, and the last
output of a request the engine aborted on its own: a frontend that was dropped but is alive
after all gets an error, not a stream that never ends). `request_output` turns a request's
progress since its last output into one `RequestOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.request import Request
from shared import protocol as P


@dataclass(slots=True)
class Emitted:
    """The outputs of one verb of the engine core, to send in this order.

    attached: frontend identity -> its outputs (one `P.Outputs` message each), sent only if
        that frontend is still attached.
    anyway: (frontend identity, output) pairs, sent even to a frontend no longer attached.
    """

    attached: dict[bytes, list[P.RequestOutput]] = field(default_factory=dict)
    anyway: list[tuple[bytes, P.RequestOutput]] = field(default_factory=list)

    def add(self, frontend: bytes, out: P.RequestOutput) -> None:
        """Queue `out` for `frontend`, if it is still attached when sent."""
        self.attached.setdefault(frontend, []).append(out)

    def outputs(self) -> list[tuple[bytes, P.RequestOutput]]:
        """Every (frontend, output) pair, attached ones first (for tests and logs)."""
        return [(f, o) for f, outs in self.attached.items() for o in outs] + self.anyway


def request_output(req: Request) -> P.RequestOutput:
    """New tokens since the last output, their logprobs (aligned), and once, when the whole
    prompt is scored, the prompt logprobs ([None] for token 0, then tokens 1..). Advances
    the request's `sent_tokens` (and clears its prompt logprobs once sent)."""
    sent = req.sent_tokens
    new = req.output_token_ids[sent:]
    req.sent_tokens = len(req.output_token_ids)
    o = P.RequestOutput(req.request_id, new, req.num_prompt_tokens, req.finish_reason,
                        req.stop_token_id, num_cached_tokens=max(req.num_cached_tokens, 0))
    if req.sampling.logprobs is not None:
        o.logprobs = req.output_logprobs[sent:sent + len(new)]
    if req.wants_prompt_logprobs and len(req.prompt_logprobs) >= req.num_prompt_tokens - 1:
        o.prompt_logprobs = [None] + req.prompt_logprobs[:req.num_prompt_tokens - 1]
        req.prompt_logprobs_sent = True
        req.prompt_logprobs = []
    if req.finish_reason == P.FinishReason.ERROR:
        o.error_kind = P.ErrorKind.INTERNAL
        o.error = "internal error"
    return o


def emitted_for(reqs: list[Request], error: str | None = None,
                kind: P.ErrorKind = P.ErrorKind.INTERNAL) -> Emitted:
    """The outputs of `reqs` (grouped by frontend, sent to attached ones); with `error`, each
    carries it with error_kind `kind` (default "internal")."""
    em = Emitted()
    for req in reqs:
        o = request_output(req)
        if error:
            o.error = error
            o.error_kind = kind
        em.add(req.frontend, o)
    return em


def refusal(msg: P.AddRequest, kind: P.ErrorKind | None, error: str | None,
            finish_reason: P.FinishReason = P.FinishReason.ERROR) -> P.RequestOutput:
    """The one output of a request that never ran: no tokens, `error` of `kind` (both None
    for a plain abort)."""
    return P.RequestOutput(msg.request_id, [], len(msg.prompt_token_ids), finish_reason,
                           error=error, error_kind=kind)
