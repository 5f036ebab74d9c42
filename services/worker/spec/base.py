"""The proposer interface: what every drafter (n-gram, draft model, EAGLE head, DFlash block
drafter) offers the model runner (docs/ARCHITECTURE.md §5.5).

Per step the runner (services/worker/model_runner.py):
1. runs the target over the plan's tokens (prefill chunks, decodes, verify seqs);
2. calls `proposer.observe(view)` with what that forward saw and produced (`StepView`), so a
   drafter with its own KV cache group runs over the same tokens and positions (the same
   block ids and slot mapping: the group has as many blocks as the target's);
3. verifies and samples (services/worker/spec/verify.py);
4. calls `proposer.propose(requests, view)` for the seqs with `num_propose > 0`, each
   described by a `ProposeRequest` (the tokens this step emitted for it, the position of
   the last one, the row of `view` whose hidden state predicted it);
5. returns the drafts in `StepResult.draft_token_ids`; the engine schedules them in the
   request's next seq (`ScheduledSeq.num_draft`), where they are verified.
Drafts the engine does not schedule (the policy verified fewer, or the request ended) are
dropped: a proposer must not assume its last proposal is verified, and draft
distributions (`Proposal.probs`) are looked up by request id and position at verify time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from services.worker.kv_cache import KVHandle, PagedKVSpec
from services.worker.layers.attention import AttentionMetadata
from shared.protocol import SamplingParams, ScheduledSeq


@dataclass
class StepView:
    """The target's forward of one step, as a drafter sees it.

    seqs: the plan's seqs (resolved: whole block tables, sampling params).
    input_ids, positions: [T] int64 on the device (pending tokens filled).
    meta: the step's attention metadata (slot mapping [T], block tables, cu_seqlens_q).
    hidden: [T, hidden_size] model dtype, the target's last hidden state (after the final
        norm: what the lm_head reads) at every token of the step.
    aux_hidden: [T, len(target_layer_ids) * hidden_size] model dtype, the outputs of the
        proposer's `target_layer_ids` concatenated in that order, or None when it asks none.
    """

    seqs: list[ScheduledSeq]
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    hidden: torch.Tensor
    aux_hidden: torch.Tensor | None = None


@dataclass
class ProposeRequest:
    """One request that wants drafts after this step.

    seq_index: its index in `StepView.seqs`. emitted: the tokens this step emitted for it
    (accepted drafts, then the recovered or bonus token; host ints, at least one); the last
    one, at position `next_pos`, is the next step's first input (its KV is not written
    yet). row: the row of the step's flattened tokens whose hidden state predicted
    emitted[-1]. num_propose: drafts wanted (the proposer may return fewer, even none).
    block_table: the request's whole table; it covers next_pos + num_propose tokens, so a
    drafter may write its own KV up to there. sampling, output_index: the request's
    parameters and the output index of the first draft (emitted[-1] has output_index - 1),
    for probabilistic drafting with the request's seed and temperature.
    """

    request_id: str
    seq_index: int
    emitted: list[int]
    next_pos: int
    row: int
    num_propose: int
    block_table: list[int]
    sampling: SamplingParams
    output_index: int


@dataclass
class Proposal:
    """A proposer's drafts, aligned with the `ProposeRequest`s it was given.

    token_ids: per request, 0..num_propose draft token ids (host ints).
    probs: None for point-mass drafts (n-gram, greedy drafting), else per request a
        [len(token_ids[i]), vocab] fp32 tensor on the device: the draft distribution q each
        draft was sampled from (probabilistic drafting; rejection sampling reads q).
    """

    token_ids: list[list[int]]
    probs: list[torch.Tensor] | None = None


@dataclass
class ProposerInfo:
    """Startup facts of a proposer for the worker's report."""

    method: str
    weight_bytes: int = 0
    kv_bytes_per_block: int = 0
    detail: dict = field(default_factory=dict)


class Proposer(ABC):
    """A drafter running in the worker next to the target (module doc for the call order).

    target_layer_ids: the target layers whose outputs `observe` receives as
    `StepView.aux_hidden` (empty: none; `StepView.hidden` is always there).
    """

    target_layer_ids: tuple[int, ...] = ()

    def kv_specs(self) -> list[PagedKVSpec]:
        """Its own KV cache group, layer order: allocated with the target's block count and
        block size and indexed by the same block ids (so one block table serves both).
        [] for a proposer without KV (n-gram)."""
        return []

    def bind_kv(self, layers: list[KVHandle]) -> None:  # noqa: B027 - optional hook
        """Receive the group's caches (one handle per `kv_specs` entry), once at load."""

    def observe(self, view: StepView) -> None:  # noqa: B027 - optional hook
        """The target's forward of this step ran (module doc, step 2). A drafter with KV
        writes its own at `view.meta.slot_mapping` here. Default: nothing."""

    @abstractmethod
    def propose(self, requests: list[ProposeRequest], view: StepView) -> Proposal:
        """Drafts for `requests` (module doc, step 4). Called at most once per step, after
        `observe`; never with an empty list."""

    def forget(self, request_ids: list[str]) -> None:  # noqa: B027 - optional hook
        """These requests ended (`StepPlan.forget`): drop what is kept for them."""

    def info(self) -> ProposerInfo:
        """Startup facts (the worker's report)."""
        return ProposerInfo(method=type(self).__name__)
