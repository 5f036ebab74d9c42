"""CUDA graphs for decode steps (DESIGN §6): one graph per captured batch size.

A decode step (one new token per sequence) launches a few hundred small kernels; replaying
a captured graph launches them all at once and leaves the host free. Every graph reads
the same persistent device buffers (token ids, positions, slots, sequence lengths, block
tables), so a step copies its inputs into them and replays the graph of the smallest
captured batch size that holds it. Padding rows get slot -1 (the KV write skips them)
and sequence length 0 (attention writes zeros for them); their hidden states are dropped.

Captured sizes: 1, 2, 4, 8, then every 8 up to 32, every 16 up to 128, every 32 beyond,
up to max_num_seqs (which is always captured). The attention kernel's split-K grid is
fixed at capture (see `decode_splits`); the kernel spreads each sequence's own context over
it, so one graph serves every context length with the whole grid.
"""

from __future__ import annotations

import bisect
import itertools
import time

import numpy as np

import torch

from services.worker.layers.attention import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Sorted batch sizes to capture for a max_num_seqs >= 1."""
    sizes = {1, 2, 4, 8, *range(16, 33, 8), *range(48, 129, 16), *range(160, max_num_seqs + 1, 32)}
    return sorted(s for s in sizes | {max_num_seqs} if s <= max_num_seqs)


class DecodeGraphs:
    """Captured decode forwards of `model` with persistent inputs.

    model: forward(input_ids [b] int64, positions [b] int64, meta) -> hidden [b, hidden],
        its attention layers already bound to the KV cache (capture reads their tensors).
    max_num_seqs: largest batch. max_model_len: tokens per sequence. block_size: tokens
    per KV block. Capture runs in __init__ (it takes `capture_seconds`).
    """

    def __init__(self, model, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device):
        self.sizes = capture_sizes(max_num_seqs)
        self.max_bs = mb = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        # one flat int64 buffer: ids | positions | slots | seq_lens | block tables [mb, max_blocks],
        # mirrored by one pinned host buffer: a step is one host->device copy of a prefix
        nb = self.max_blocks
        self.flat = torch.zeros(4 * mb + mb * nb, dtype=torch.long, device=device)
        self.header = self.flat[:4 * mb]
        self.ids, self.pos, self.slots, self.seq_lens = self.header.view(4, mb)
        self.tables = self.flat[4 * mb:].view(mb, nb)
        self.cu = torch.arange(mb + 1, dtype=torch.int32, device=device)
        self.host = torch.zeros(4 * mb + mb * nb, dtype=torch.long, pin_memory=True)
        self._host_np = self.host.numpy()
        self._host_tables = self._host_np[4 * mb:].reshape(mb, nb)
        self._copied = torch.cuda.Event()  # the last copy out of `host` is done
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.slots.fill_(-1)
        t0 = time.perf_counter()
        pool = None
        with torch.inference_mode():
            for bs in reversed(self.sizes):  # largest first: later graphs reuse its pool
                meta = AttentionMetadata(self.cu[:bs + 1], self.seq_lens[:bs], self.tables[:bs],
                                         self.slots[:bs], None, max_q_len=1, max_seq_len=max_model_len)
                model(self.ids[:bs], self.pos[:bs], meta)  # warm-up: compiles, allocates
                torch.cuda.synchronize(device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.outputs[bs] = model(self.ids[:bs], self.pos[:bs], meta)
                pool = g.pool()
                self.graphs[bs] = g
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - t0

    def padded_size(self, b: int) -> int | None:
        """The captured size that runs a batch of b, or None when b is too large."""
        i = bisect.bisect_left(self.sizes, b)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            tables: list[list[int]], fill=None) -> torch.Tensor:
        """Replay the decode graph for b = len(ids) sequences (b <= max_num_seqs).

        ids, positions, slots, seq_lens: b ints each; tables: b block tables (each at most
        max_blocks long). fill: None, or a callable given the graph's input ids [b] int64 on
        the device after the copy and before the replay (it may rewrite entries there).
        Returns hidden [b, hidden] (a view of the graph's output buffer, valid until the
        next replay).
        """
        b = len(ids)
        bs = self.padded_size(b)
        mb, nb = self.max_bs, self.max_blocks
        self._copied.synchronize()  # never overwrite host data an earlier copy still reads
        h = self._host_np
        h[:b] = ids
        h[b:bs] = 0  # padding rows: a real token id (a PENDING_TOKEN left by a larger step is not)
        h[mb:mb + b] = positions
        h[2 * mb:2 * mb + b] = slots
        h[2 * mb + b:2 * mb + bs] = -1  # padding rows: no KV write
        h[3 * mb:3 * mb + b] = seq_lens
        h[3 * mb + b:3 * mb + bs] = 0  # padding rows: no attention
        # one vectorised scatter of all tables (a Python-level row loop cost ~1 ms at b=256);
        # entries past a table's end are stale and never read (attention reads only blocks
        # below seq_len)
        lens = np.fromiter((len(t) for t in tables), dtype=np.int64, count=b)
        total = int(lens.sum())
        flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=total)
        starts = np.repeat(np.cumsum(lens) - lens, lens)
        rows = np.repeat(np.arange(b), lens)
        self._host_tables[rows, np.arange(total) - starts] = flat
        n = 4 * mb + bs * nb
        self.flat[:n].copy_(self.host[:n], non_blocking=True)
        self._copied.record()
        if fill is not None:
            fill(self.ids[:b])
        self.graphs[bs].replay()
        return self.outputs[bs][:b]
