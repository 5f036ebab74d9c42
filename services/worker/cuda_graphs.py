"""CUDA graphs for decode steps (docs/ARCHITECTURE.md §6): one graph per captured batch size.

A decode step (one new token per sequence) launches a few hundred small kernels; replaying
a captured graph launches them all at once and leaves the host free. Every graph reads
the same persistent device buffers (token ids, positions, slots, sequence lengths, block
tables), so a step writes its inputs into one pinned host buffer and replays the graph of
the smallest captured batch size that holds it. Padding rows get slot -1 (the KV write
skips them) and sequence length 0 (attention writes zeros for them); their hidden states
are dropped. A hybrid model's recurrent layers read the state slots from the same staged
header (two more rows: each row's slot and whether it continues from it); padding rows name
the state cache's scratch slot, so they never touch a request's state (§6.5). Only decode
steps take graphs on a hybrid: its verify and prefill steps run eagerly.

The host-to-device copy of the inputs is the graph's first node, and a pending token
(async scheduling) is staged as a reference to a row of the last draw, resolved on the
device inside the graph (`kernels.pending_ids`). So a step is host staging plus one graph
launch: a separate copy before the launch made the host's part of a batch-1 step ~60 us
longer (H200: copy + event + replay 62-70 us, the graph with the copy inside 6-9 us),
and the GPU waits for that part in a synchronous step.

Captured sizes: 1, 2, 4, 8, then every 8 up to 32, every 16 up to 128, every 32 beyond,
up to max_num_seqs (which is always captured). The attention kernel's split-K grid is
fixed at capture (see `decode_splits`); the kernel spreads each sequence's own context over
it, so one graph serves every context length with the whole grid.
"""

from __future__ import annotations

import bisect
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from kernels.pending_ids import resolve_pending_ids
from services.worker import jit_watch
from services.worker.layers.attention import AttentionMetadata
from services.worker.state_cache import StateCache, StepState


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Sorted batch sizes to capture for a max_num_seqs >= 1."""
    sizes = {1, 2, 4, 8, *range(16, 33, 8), *range(48, 129, 16), *range(160, max_num_seqs + 1, 32)}
    return sorted(s for s in sizes | {max_num_seqs} if s <= max_num_seqs)



def stage_tables(host: np.ndarray, staged: list[tuple[list[int] | None, int]], tables: list[list[int]]) -> None:
    """Copy each block table into row i of a graph's pinned host table buffer `host`
    [max_bs, width], only what changed since the last step: a list passed again (the same
    object, entries unchanged, possibly longer) copies just its new tail. staged[i] keeps
    (the list, its length) of row i; updated here."""
    for i, t in enumerate(tables):
        had, n = staged[i]
        if had is t:
            if n == len(t):
                continue
            host[i, n:len(t)] = t[n:]
        else:
            host[i, :len(t)] = t
        staged[i] = (t, len(t))


DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, StepState | None], torch.Tensor]


def low_byte_bools(row: torch.Tensor) -> torch.Tensor:
    """A bool view [n] of an int64 row [n] of 0/1 values: the lowest byte of each element
    (the first of its 8 on a little-endian host, which wrote them), so a graph reads a
    staged int64 row as a mask with no conversion kernel. Raises RuntimeError on a
    big-endian host."""
    if sys.byteorder != "little":
        raise RuntimeError("decode graphs stage the state flags little-endian")
    return row.view(torch.bool)[::8]


class DecodeGraphs:
    """Captured decode forwards with persistent inputs.

    forward(input_ids [b] int64, positions [b] int64, meta, state) -> hidden [b, hidden]:
        the runner's model over its KV cache with the step's attention backend and fusion
        choice (capture fixes both, and reads the cache tensors); state: the recurrent
        layers' view of the step (`state_view`), None without a state cache.
    max_num_seqs: largest batch. max_model_len: tokens per sequence. block_size: tokens
    per KV block. state_cache: a hybrid model's `StateCache` (None: no recurrent layers);
    then the staged header has two more rows, each row's state slot and whether it
    continues from it (1) or starts from zeros (0), and padding rows name the cache's
    scratch slot (docs/ARCHITECTURE.md §6.5). Capture runs in __init__ (it takes
    `capture_seconds`).
    `last` [max_num_seqs] int64 (device): the token ids of the last draw, which pending
    inputs refer to (`keep` fills it).
    """

    def __init__(self, forward: DecodeForward, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, state_cache: StateCache | None = None):
        self._alloc(max_num_seqs, max_model_len, block_size, device, state_cache, pin_memory=True)
        # recorded by each graph after its input copy: the host buffer is free again
        self._copied = torch.cuda.Event(external=True)
        t0 = time.perf_counter()
        pool = None
        with torch.inference_mode():
            for bs in reversed(self.sizes):  # largest first: later graphs reuse its pool
                meta, state = self.meta(bs), self.state_view(bs)
                # warm-up: compiles (Triton; a hybrid's decode kernels have no autotuner), allocates;
                # the host rows still hold the padding values, so its state writes hit the
                # scratch slot only
                self._forward(bs, forward, meta, state)
                torch.cuda.synchronize(device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.outputs[bs] = self._forward(bs, forward, meta, state)
                pool = g.pool()
                self.graphs[bs] = g
                jit_watch.WATCH.note_capture(f"decode graph batch {bs}")  # counted once serving
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - t0

    def _alloc(self, max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device,
               state_cache: StateCache | None, pin_memory: bool) -> None:
        """The persistent buffers (device and pinned host), without capturing (a CPU
        stand-in calls this alone, tests/unit/decode_graphs_rig.py)."""
        self.sizes = capture_sizes(max_num_seqs)
        self.max_bs = mb = self.sizes[-1]
        self.max_blocks = nb = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.device = device
        self.state_cache = state_cache
        # one flat int64 buffer: ids | positions | slots | seq_lens [| state slots | has_initial]
        # | block tables [mb, max_blocks], mirrored by one pinned host buffer: the graph of size
        # bs copies its prefix (the header and bs table rows) itself
        self.rows = rows = 4 if state_cache is None else 6
        self.flat = torch.zeros(rows * mb + mb * nb, dtype=torch.long, device=device)
        header = self.flat[:rows * mb].view(rows, mb)
        self.ids, self.pos, self.slots, self.seq_lens = header[:4]
        self.state_slots = header[4] if state_cache is not None else None
        self.has_initial = low_byte_bools(header[5]) if state_cache is not None else None
        self.tables = self.flat[rows * mb:].view(mb, nb)
        self.cu = torch.arange(mb + 1, dtype=torch.int32, device=device)
        self.last = torch.zeros(mb, dtype=torch.long, device=device)
        self.host = torch.zeros(rows * mb + mb * nb, dtype=torch.long, pin_memory=pin_memory)
        h = self.host.numpy()
        self._host_header = h[:rows * mb].reshape(rows, mb)
        self._host_tables = h[rows * mb:].reshape(mb, nb)
        self._host_header[2] = -1  # padding rows: no KV write (seq_len 0: no attention)
        if state_cache is not None:  # ... and the scratch state slot, from zeros
            self._host_header[4] = state_cache.scratch_slot
        # what each host table row holds: (the table list it was staged from, its length then)
        self._staged: list[tuple[list[int] | None, int]] = [(None, 0)] * mb
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def meta(self, bs: int) -> AttentionMetadata:
        """The attention metadata of the graph of size bs, over the persistent buffers."""
        return AttentionMetadata(self.cu[:bs + 1], self.seq_lens[:bs], self.tables[:bs], self.slots[:bs], None,
                                 max_q_len=1, max_seq_len=self.max_model_len)

    def state_view(self, bs: int) -> StepState | None:
        """The recurrent layers' view of the graph of size bs (None without a state cache):
        its slots, has_initial flags and cu_seqlens (one token a row) are views of the
        persistent buffers, so a replay reads what `run` staged."""
        if self.state_cache is None:
            return None
        assert self.state_slots is not None and self.has_initial is not None
        return StepState(self.state_cache, self.state_slots[:bs], self.has_initial[:bs], self.cu[:bs + 1], [1] * bs)

    def _forward(self, bs: int, forward: DecodeForward, meta: AttentionMetadata,
                 state: StepState | None) -> torch.Tensor:
        """What a graph of size bs runs: the input copy, pending ids, the model."""
        n = self.rows * self.max_bs + bs * self.max_blocks
        self.flat[:n].copy_(self.host[:n], non_blocking=True)
        self._copied.record()
        resolve_pending_ids(self.ids[:bs], self.last)
        return forward(self.ids[:bs], self.pos[:bs], meta, state)

    def padded_size(self, b: int) -> int | None:
        """The captured size that runs a batch of b, or None when b is too large."""
        i = bisect.bisect_left(self.sizes, b)
        return self.sizes[i] if i < len(self.sizes) else None

    def keep(self, token_ids: torch.Tensor) -> None:
        """Copy a draw's token ids [n <= max_num_seqs] int64 (device) into `last`, for the
        pending inputs of the next steps (stream-ordered; no host sync)."""
        self.last[:token_ids.numel()].copy_(token_ids, non_blocking=True)

    def run(self, ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            tables: list[list[int]], state_slots: list[int] | None = None,
            has_initial: list[bool] | None = None) -> torch.Tensor:
        """Replay the decode graph for b = len(ids) sequences (b <= max_num_seqs).

        ids: b token ids, each >= 0 or `kernels.pending_ids.encode_pending(j)` for row j of
        the ids last given to `keep`; positions, slots, seq_lens: b ints each; tables: b
        block tables (each at most max_blocks long). A table list is restaged only from
        where it grew since it was last staged in the same row, so a list's entries must
        not change once passed here (`shared.plan_state.PlanState` keeps that).
        state_slots, has_initial: b each with a state cache (each seq's state slot, whether
        it continues from it: start_pos > 0), else None; checkpoint restores are the
        caller's, before this call.
        Returns hidden [b, hidden] (a view of the graph's output buffer, valid until the
        next replay). Raises ValueError for a batch over the largest size, or state rows
        given without a state cache (or missing with one).
        """
        b = len(ids)
        bs = self.padded_size(b)
        if bs is None:
            raise ValueError(f"decode graphs: batch {b} over the largest captured size {self.max_bs}")
        if (state_slots is None or has_initial is None) != (self.state_cache is None):
            raise ValueError("decode graphs: state_slots and has_initial go with a state cache, and only then")
        self._copied.synchronize()  # never overwrite host data an earlier copy still reads
        hdr = self._host_header
        hdr[0, :b], hdr[1, :b], hdr[2, :b], hdr[3, :b] = ids, positions, slots, seq_lens
        if bs > b:  # padding rows: token 0 (a pending reference left by a larger step is not
            hdr[0, b:bs] = 0  # a token), no KV write, no attention
            hdr[2, b:bs] = -1
            hdr[3, b:bs] = 0
        if self.state_cache is not None:
            hdr[4, :b], hdr[5, :b] = state_slots, has_initial
            if bs > b:  # padding rows read and write the scratch slot, starting from zeros
                hdr[4, b:bs] = self.state_cache.scratch_slot
                hdr[5, b:bs] = 0
        # entries past a table's end are stale and never read (attention reads only blocks
        # below seq_len)
        stage_tables(self._host_tables, self._staged, tables)
        self.graphs[bs].replay()
        return self.outputs[bs][:b]
