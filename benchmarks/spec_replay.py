"""The replay drafter of benchmarks/spec_verify_cost.py: a `Proposer` that drafts the
target's own greedy continuation from an earlier plain run, with a controlled share of its
drafts corrupted, so that the acceptance length is set by the benchmark and drafting costs
next to nothing (what is measured is the verify step and its round trip, docs/ARCHITECTURE.md
§5.5).

Corruption: draft i (1-based) of a proposal whose first draft has output index j is kept
with probability `accept`, independently, decided by `random.Random(f"{seed}:{j}:{i}")`
(deterministic, and independent between proposals); a corrupted draft is the reference
token + 1 (mod vocab), never the target's greedy token. A verify step of k drafts accepts
the kept prefix, so the mean acceptance length is 1 + sum_{i=1..k} accept^i (Leviathan et
al. 2023, arXiv 2211.17192, §3.1, for i.i.d. acceptance).

The reference: the plain greedy run's tokens are where it starts, but verification rounds in
bf16 differently from the plain decode path (other kernels, other split-K partitions), so on
random weights a speculative run's greedy output leaves the plain run's somewhere, and past
that point the drafter has nothing to propose (each proposal checks that the request's last
emitted token is the reference's, `off_track`) and the run's steps are no-draft steps: the
measured L then says less than the set share. `settle_reference` makes the reference the
speculative run's own output at the point's acceptance and seed: a run with reference R
emitting O != R is run again with reference O. The run is deterministic for a given
reference (the corruption depends on seed and output index, not on the tokens), and a run
with reference O computes exactly what the run with R did up to the first index where O
and R differ, then accepts O's token there (the same logits as before); so the first
difference moves forward every round, and a reference that a run reproduces is on track
throughout: every proposal is the set share of the target's own continuation.

Injection: the runner builds proposers from its registry (`services.worker.spec.PROPOSERS`,
`cls(cfg, spec, runner)`); `registered()` puts this class in the "draft_model" slot while a
runner is built (the engine side then treats it as any drafter without context tokens).
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Callable, Iterator

from services.worker.spec.base import Proposal, Proposer, ProposeRequest, ProposerInfo, StepView

SLOT = "draft_model"  # the registry entry the replay drafter takes while a runner is built


@functools.lru_cache(maxsize=1 << 16)
def draft_kept(seed: int, first_index: int, i: int, accept: float) -> bool:
    """Whether draft i (1-based) of the proposal starting at output index first_index is the
    reference token (module doc): a uniform draw of its own below `accept`. Memoized: a
    seeded `random.Random` costs ~5 us on the 2-core VM, ~20 us a proposal of 4, which would
    land in the verify step's host time after its last read; the untimed runs that settle
    the reference make the very draws of the timed runs."""
    if accept >= 1.0:
        return True
    if accept <= 0.0:
        return False
    return random.Random(f"{seed}:{first_index}:{i}").random() < accept


def replay_drafts(ref: list[int], output_index: int, n: int, accept: float, vocab: int,
                  seed: int = 0) -> list[int]:
    """Up to n drafts for output indexes output_index.. from the reference continuation ref
    (token ids of the plain greedy run), each kept or corrupted as `draft_kept` says; fewer
    (even none) near the end of ref."""
    out = []
    for i, t in enumerate(ref[output_index:output_index + n], start=1):
        out.append(t if draft_kept(seed, output_index, i, accept) else (t + 1) % vocab)
    return out


def expected_length(accept: float, k: int) -> float:
    """Mean acceptance length of k i.i.d. drafts each kept with probability accept:
    1 + sum_{i=1..k} accept^i."""
    return 1.0 + sum(accept ** i for i in range(1, k + 1))


def accept_for_length(length: float, k: int) -> float:
    """The per-draft acceptance whose `expected_length` with k drafts is `length` (bisection,
    1e-9). Raises ValueError for a length outside [1, k + 1]."""
    if not 1.0 <= length <= k + 1:
        raise ValueError(f"acceptance length {length} is outside [1, {k + 1}] for k = {k}")
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_length(mid, k) < length else (lo, mid)
    return hi if length >= k + 1 else lo


def settle_reference(start: list[int], run: Callable[[list[int]], list[int]],
                     max_rounds: int) -> tuple[list[int], int, bool]:
    """The replay reference a speculative run reproduces (module doc): starting from start
    (the plain run's tokens), ref = run(ref) until run(ref) == ref or max_rounds runs.
    run(ref): the speculative run's output tokens with ref as its reference (same length).
    Returns (reference, runs made, settled: whether the last run reproduced it)."""
    ref = start
    for i in range(1, max_rounds + 1):
        out = run(ref)
        if out == ref:
            return ref, i, True
        ref = out
    return ref, max_rounds, False


class ReplayProposer(Proposer):
    """Drafts the reference continuation of each request (module doc). Set by the benchmark
    between runs: refs (request id -> reference output token ids), accept, seed.
    off_track: proposals refused because the request's last emitted token was not the
    reference's (the run left the reference: outputs are not those of the plain run)."""

    last: ReplayProposer | None = None

    def __init__(self, cfg, spec, runner):
        self.vocab = runner.spec.vocab_size
        self.refs: dict[str, list[int]] = {}
        self.accept = 1.0
        self.seed = 0
        self.off_track = 0
        ReplayProposer.last = self

    def propose(self, requests: list[ProposeRequest], view: StepView) -> Proposal:
        out: list[list[int]] = []
        for r in requests:
            ref = self.refs.get(r.request_id)
            j = r.output_index
            if ref is None or j < 1 or j > len(ref) or ref[j - 1] != r.emitted[-1]:
                self.off_track += ref is not None
                out.append([])
                continue
            out.append(replay_drafts(ref, j, r.num_propose, self.accept, self.vocab, self.seed))
        return Proposal(out)

    def info(self) -> ProposerInfo:
        return ProposerInfo(method="replay", detail={"replay": True})


@contextlib.contextmanager
def registered() -> Iterator[None]:
    """`ReplayProposer` in the registry's "draft_model" slot for the duration (a runner
    built inside gets it for `speculative_config.method` "draft_model")."""
    from services.worker import spec as spec_pkg

    old = spec_pkg.PROPOSERS.get(SLOT)
    spec_pkg.PROPOSERS[SLOT] = (__name__, "ReplayProposer")
    try:
        yield
    finally:
        if old is None:
            spec_pkg.PROPOSERS.pop(SLOT, None)
        else:
            spec_pkg.PROPOSERS[SLOT] = old


@contextlib.contextmanager
def without_proposer(runner) -> Iterator[None]:
    """The runner as a plain one for the duration (its `proposer` None: no observe, no
    proposer view), for the baselines of the same run."""
    saved = runner.proposer
    runner.proposer = None
    try:
        yield
    finally:
        runner.proposer = saved
