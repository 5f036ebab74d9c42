"""The recurrent-state cache group of a hybrid model (docs/ARCHITECTURE.md §4.7).

A recurrent layer (gated DeltaNet) keeps a fixed-size state per request instead of paged KV:
its short-conv window and its recurrent matrix. The model says what each such layer keeps
(`CausalLM.state_specs`: a `StateSpec` per recurrent layer, in layer order); the runner
allocates `StateCache(specs, num_slots)`: per layer and per tensor of its spec, one
[num_slots, *shape] tensor. The engine hands out the slots (services/engine/state_slots.py)
and every `ScheduledSeq` carries its request's `state_slot`; per step the runner builds a
`StepState` (the step's slots, which seqs continue from their slot's state, their token
offsets) and gives it to the attention backend (`AttentionBackend.state`), through which the
recurrent layers read and write their slots (models never touch a cache tensor): a decode
step (one token a seq) updates the slots in place through `slots` / `has_initial`
(kernels/gdn_decode.py), other steps `gather` the seqs' states and `scatter` them back.

A seq continues from its slot's state when start_pos > 0; at start_pos 0 (a new request, or
one preempted and recomputed) it starts from zeros. Nothing else resets a slot.

One more slot than the engine hands out, `StateCache.scratch_slot`, belongs to no request: the
padding rows of a CUDA-graph decode step read and write it (services/worker/cuda_graphs.py,
docs/ARCHITECTURE.md §6.5), so they never touch a request's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shared.protocol import ScheduledSeq


@dataclass(frozen=True)
class StateSpec:
    """What one recurrent layer keeps per request: tensors of `shapes` (per slot, without
    the slot dimension) in `dtypes` (same length), e.g. a gated DeltaNet's conv window
    (conv_dim, kernel - 1) in the model dtype and its state (value heads, key dim, value dim)
    in fp32."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    def __post_init__(self) -> None:
        if len(self.shapes) != len(self.dtypes) or not self.shapes:
            raise ValueError(f"StateSpec: {len(self.shapes)} shapes, {len(self.dtypes)} dtypes")

    @property
    def slot_bytes(self) -> int:
        """Bytes of one request's state in this layer."""
        total = 0
        for shape, dt in zip(self.shapes, self.dtypes):
            n = 1
            for d in shape:
                n *= d
            total += n * torch.empty((), dtype=dt).element_size()
        return total


class StateCache:
    """Per recurrent layer, its tensors [num_slots + 1, *shape] (zeros). layers[i]: the list
    of layer i's tensors in its spec's order (i counts recurrent layers only). Slots
    0 .. num_slots - 1 are the engine's (requests and checkpoints); `scratch_slot` =
    num_slots is the padding rows' of a CUDA-graph step and never a request's. bytes: total,
    the scratch slot included. Raises ValueError for num_slots < 1."""

    def __init__(self, specs: Sequence[StateSpec], num_slots: int, device: torch.device | str):
        if num_slots < 1:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.layers: list[list[torch.Tensor]] = [
            [torch.zeros((num_slots + 1, *shape), dtype=dt, device=device) for shape, dt in zip(s.shapes, s.dtypes)]
            for s in specs]
        self.bytes = self.bytes_for(specs, num_slots)

    def check_slots(self, seqs: Sequence[ScheduledSeq]) -> None:
        """Raises ValueError naming the seqs without a state slot in 0..num_slots - 1 (the
        scratch slot is no request's)."""
        bad = [s.request_id for s in seqs if not 0 <= s.state_slot < self.num_slots]
        if bad:
            raise ValueError(f"seqs without a state slot in 0..{self.num_slots - 1}: {bad}")

    def restore_checkpoints(self, seqs: Sequence[ScheduledSeq]) -> None:
        """Before a step: each seq with `state_restore` >= 0 (a prefix hit,
        services/engine/state_slots.py) resumes from that checkpoint, copied into its slot."""
        for s in seqs:
            if s.state_restore >= 0:
                self.copy_slot(s.state_restore, s.state_slot)

    def copy_slot(self, src: int, dst: int) -> None:
        """Every layer's state of slot `src` into slot `dst` (a checkpoint saved or restored).
        Raises ValueError for a slot outside the cache."""
        if not (0 <= src < self.num_slots and 0 <= dst < self.num_slots):
            raise ValueError(f"state slots {src} -> {dst} outside 0..{self.num_slots - 1}")
        for layer in self.layers:
            for t in layer:
                t[dst].copy_(t[src])

    def save_checkpoints(self, seqs: Sequence[ScheduledSeq]) -> None:
        """After a step: each seq with `state_save` >= 0 copies its slot's state there."""
        for s in seqs:
            if s.state_save >= 0:
                self.copy_slot(s.state_slot, s.state_save)

    @staticmethod
    def bytes_for(specs: Sequence[StateSpec], num_slots: int) -> int:
        """Bytes a cache of `specs` and `num_slots` takes, its scratch slot included (without
        allocating it)."""
        return sum(s.slot_bytes for s in specs) * (num_slots + 1)


@dataclass
class StepState:
    """One step's view of the state cache, for the recurrent layers.

    cache: the runner's `StateCache`. slots: [N] int64 on the device, the state slot of
    each of the step's N seqs (plan order). has_initial: [N] bool on the device, whether
    the seq continues from its slot (start_pos > 0) or starts from zeros. cu_seqlens: [N+1]
    int32 on the device, the seqs' token offsets in the flattened batch. seq_lens_host:
    the seqs' token counts (host ints, for the CPU references' per-seq loops).
    A CUDA-graph decode step's view (`services.worker.cuda_graphs.DecodeGraphs.state_view`)
    holds views of the graph's static buffers instead, filled in place before each replay
    (has_initial: a strided bool view of an int64 row): the recurrent layers' in-place decode
    kernels read the slots and flags from them (no host sync, no branch on their values); its
    padding rows name the scratch slot and start from zeros, written by several rows at once
    (whichever write lands, no request reads it). `gather` and `scatter` (index_select,
    torch.where, index_copy_) serve the steps that are not plain decodes.
    """

    cache: StateCache
    slots: torch.Tensor
    has_initial: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens_host: list[int]
    # Speculative decoding (docs/ARCHITECTURE.md §4.7): per seq, 1 + its drafts for a verify
    # seq (the layers keep its state after each of its tokens), 0 for the others; and the
    # kept states, (layer, seq) -> one list per position of the layer's state tensors [1, *shape]
    track: list[int] = field(default_factory=list)
    positions: dict[tuple[int, int], list[list[torch.Tensor]]] = field(default_factory=dict)

    @classmethod
    def for_seqs(cls, cache: StateCache, seqs: Sequence[ScheduledSeq], device: torch.device) -> StepState:
        """The state view of a step of `seqs` (verify seqs tracked: `track`). Raises
        ValueError for a seq without a slot or with one outside the cache."""
        cache.check_slots(seqs)
        lens = [len(s.token_ids) for s in seqs]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        cache.restore_checkpoints(seqs)
        track = [len(s.token_ids) if s.sample and s.num_draft else 0 for s in seqs]
        return cls(cache,
                   torch.tensor([s.state_slot for s in seqs], dtype=torch.int64).to(device),
                   torch.tensor([s.start_pos > 0 for s in seqs], dtype=torch.bool).to(device),
                   torch.tensor(cu, dtype=torch.int32).to(device), lens, track if any(track) else [])

    def gather(self, layer: int) -> list[torch.Tensor]:
        """Layer `layer`'s state of the step's seqs: one [N, *shape] copy per tensor, zeros
        where a seq starts from zeros."""
        out = []
        for t in self.cache.layers[layer]:
            g = t.index_select(0, self.slots)
            out.append(torch.where(self.has_initial.view(-1, *([1] * (g.dim() - 1))), g, torch.zeros((), dtype=g.dtype,
                                                                                                   device=g.device)))
        return out

    def scatter(self, layer: int, states: Sequence[torch.Tensor]) -> None:
        """Write the step's updated states of layer `layer` (as `gather` returned them, then
        updated) back to their slots."""
        for t, s in zip(self.cache.layers[layer], states):
            t.index_copy_(0, self.slots, s.to(t.dtype))

    def keep(self, layer: int, seq: int, states: list[list[torch.Tensor]]) -> None:
        """Record layer `layer`'s states of tracked seq `seq` after each of its tokens (one
        list of the layer's tensors [1, *shape] per token), for `commit`."""
        self.positions[(layer, seq)] = states

    def commit(self, kept_tokens: dict[int, int]) -> None:
        """After verification: seq i (a tracked seq, by plan index) keeps its first
        kept_tokens[i] tokens (its last token and the accepted drafts); write each recurrent
        layer's state after that token to the seq's slot, over the state after all of them
        that `scatter` wrote. Raises ValueError for a count outside 1..len(tokens)."""
        for (layer, seq), states in self.positions.items():
            n = kept_tokens.get(seq)
            if n is None:
                continue
            if not 1 <= n <= len(states):
                raise ValueError(f"seq {seq} keeps {n} of its {len(states)} tokens")
            slot = self.slots[seq:seq + 1]
            for t, s in zip(self.cache.layers[layer], states[n - 1]):
                t.index_copy_(0, slot, s.to(t.dtype))
