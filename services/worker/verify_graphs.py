"""CUDA graphs for verify steps (docs/ARCHITECTURE.md §5.5, §6.5): one graph per (batch size, k).

A verify step runs every sequence over [last token, d1..dk]: 1 + k query tokens at the end of
its context. A graph captured for (b, K) runs b seqs of 1 + K tokens: T = b (1 + K) rows,
cu_seqlens_q = 0, 1 + K, 2 (1 + K), ..., over persistent buffers, as `DecodeGraphs` does for
plain decode steps. A step whose seqs verify different k, decode-only seqs (k = 0) among
them, replays the graph of K = max k with every seq padded to 1 + K rows
(`services.worker.verify_layout`: padding rows write no KV and come after the real ones, so
no real row sees them); the real rows are picked out of its outputs, and the proposer sees
the eager step's layout (`VerifyGraphs.real_inputs`). A smaller batch is padded to the next
captured size with empty seqs (seq_len 0: their programs attend to nothing; slot -1).

The attention is the eager verify step's own backend (`PagedAttention`: the rotary + KV
write kernel, then `kernels.attention.paged_attention`), captured with the static bounds
max_q_len = 1 + K and max_seq_len = max_model_len. For 1 + K query rows x the query heads
of a KV head within one program (`kernels.attention_multi_query.fits_multi_query`) that is
the split-K multi-query kernel of `kernels/attention_multi_query.py` (program (seq, kv head,
split), the split count fixed at capture from max_model_len, each seq's partitions sized
from its own seq_len on the device); beyond, the varlen prefill kernel of
`kernels/attention_triton.py` (grid cdiv(1 + K, BLOCK_M) x b x heads). Both read each
seq's query offsets and length on the device and take causal limits from seq_len - q_len,
and both read the block-table entries of keys up to seq_len - 1, which for a padded seq
lies up to K past its table's end: the staged tables are `table_width` =
cdiv(max_model_len + max_k, block_size) wide and hold valid block ids there.

The host stages a step's inputs into one pinned buffer; the graph's first node copies them
in (ids | positions | slots | seq_lens | the real layout: rows, cu_seqlens_q, seq_lens |
block tables; `run`). No first token is pending here (the step runs eagerly when one is),
so the graph resolves no pending ids. Captured batch sizes: `cuda_graphs.capture_sizes` up
to min(max_num_seqs, VERIFY_MAX_BATCH), each for k = 1..num_speculative_tokens. A (size, k)
whose capture fails is logged and left out: steps that need it run eagerly (a step of max k
K takes only the K graphs).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from services.worker import jit_watch
from services.worker.cuda_graphs import capture_sizes, stage_tables
from services.worker.layers.attention import AttentionMetadata
from services.worker.verify_layout import VerifyLayout, graph_k, verify_layout
from shared.protocol import ScheduledSeq

log = logging.getLogger("kestrel.worker")

# Steps of mixed k (seqs padded to 1 + max k rows, `verify_layout`) replay a graph only with
# MIXED_K; off: they run eagerly. Off by default: on the H200 (2026-12-01) two of the GPU
# tests of mixed steps against the eager step failed (layouts k = (1, 3, 0) padded to 4
# seqs and (0, 2)), and a capture-failure test after them; not yet diagnosed. The CPU
# stand-in tests (tests/unit/test_verify_graphs_padded.py) turn it on.
MIXED_K = False

VERIFY_MAX_BATCH = 32  # largest batch size captured for verify steps (bounds the capture time)

# forward(input_ids [T], positions [T], meta) -> (hidden [T, hidden], aux_hidden [T, ...] or None)
VerifyForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], tuple[torch.Tensor, torch.Tensor | None]]


def verify_sizes(max_num_seqs: int) -> list[int]:
    """Sorted batch sizes captured for verify steps: the decode sizes up to
    min(max_num_seqs, VERIFY_MAX_BATCH), that bound always included."""
    top = min(max_num_seqs, VERIFY_MAX_BATCH)
    return sorted({s for s in capture_sizes(max_num_seqs) if s <= top} | {top})


def _even(n: int) -> int:
    return n + n % 2  # int64 views on 16-byte boundaries (Triton specializes on pointer alignment)


class VerifyGraphs:
    """Captured verify forwards, keyed by (batch size, k), over persistent inputs.

    forward: the runner's model over its KV cache (`VerifyForward`; the backend follows from
        the metadata's max_q_len = 1 + k > 1: `PagedAttention`).
    max_num_seqs: the runner's largest batch (sizes: `verify_sizes`). max_k: the largest k
        (num_speculative_tokens >= 1). max_model_len: tokens per sequence. block_size:
        tokens per KV block. Capture runs in __init__ (`capture_seconds`); `failed` lists
        the (size, k, error) left out. `replays` counts `run` calls (for tests).
    max_blocks: the longest block table a step may stage (cdiv(max_model_len, block_size));
    table_width: the staged tables' row width, cdiv(max_model_len + max_k, block_size): the
        kernels read the entries of a padded seq's keys up to K past its real end (module doc).
    Raises ValueError for max_k < 1.
    """

    def __init__(self, forward: VerifyForward, max_num_seqs: int, max_k: int, max_model_len: int,
                 block_size: int, device: torch.device):
        self._alloc(max_num_seqs, max_k, max_model_len, block_size, device, pin_memory=True)
        self._copied = torch.cuda.Event(external=True)  # recorded by each graph after its input copy
        t0 = time.perf_counter()
        pool = None
        with torch.inference_mode():
            for k in range(max_k, 0, -1):  # the largest graph first: the others reuse its pool
                for bs in reversed(self.sizes):
                    pool = self._capture(forward, bs, k, pool)
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - t0
        log.info("verify graphs: %d captured (sizes %s, k 1..%d) in %.2f s, %d failed",
                 len(self.graphs), self.sizes, max_k, self.capture_seconds, len(self.failed))

    def _alloc(self, max_num_seqs: int, max_k: int, max_model_len: int, block_size: int, device: torch.device,
               pin_memory: bool) -> None:
        """The persistent buffers (device and host) and the empty graph tables; no capture (a
        seam of its own: the CPU stand-in of tests/unit/verify_graphs_rig.py shares them).
        Raises ValueError for max_k < 1."""
        if max_k < 1:
            raise ValueError(f"verify graphs need num_speculative_tokens >= 1, got {max_k}")
        self.sizes = verify_sizes(max_num_seqs)
        self.max_bs = mb = self.sizes[-1]
        self.max_k = max_k
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.table_width = nw = -(-(max_model_len + max_k) // block_size)
        self.device = device
        self.max_tokens = mt = _even(mb * (1 + max_k))
        mb2, mc = _even(mb), _even(mb + 1)
        # ids | positions | slots [mt] each, seq_lens [mb2]; the real layout: rows [mt],
        # cu_seqlens_q [mc], seq_lens [mb2]
        self._header = hn = 4 * mt + 2 * mb2 + mc
        self.flat = torch.zeros(hn + mb * nw, dtype=torch.long, device=device)
        self._tok = self.flat[:3 * mt].view(3, mt)
        self.ids, self.pos, self.slots = self._tok
        self.seq_lens = self.flat[3 * mt:3 * mt + mb]
        o = 3 * mt + mb2
        self.real_rows = self.flat[o:o + mt]
        self.real_cu = self.flat[o + mt:o + mt + mb + 1]
        self.real_seq_lens = self.flat[o + mt + mc:o + mt + mc + mb]
        self.tables = self.flat[hn:].view(mb, nw)
        # query offsets of the graphs' steps, one per k: 0, 1 + k, 2 (1 + k), ...
        self.cu = {k: torch.arange(0, (mb + 1) * (1 + k), 1 + k, dtype=torch.int32, device=device)
                   for k in range(1, max_k + 1)}
        self.host = torch.zeros(hn + mb * nw, dtype=torch.long, pin_memory=pin_memory)
        h = self.host.numpy()
        self._h_tok = h[:3 * mt].reshape(3, mt)
        self._h_lens = h[3 * mt:3 * mt + mb]
        self._h_rows = h[o:o + mt]
        self._h_cu = h[o + mt:o + mt + mb + 1]
        self._h_real_lens = h[o + mt + mc:o + mt + mc + mb]
        self._h_tables = h[hn:].reshape(mb, nw)
        self._h_tok[2] = -1  # padding tokens: no KV write; padding seqs: seq_len 0 (no attention)
        self._staged: list[tuple[list[int] | None, int]] = [(None, 0)] * mb  # as in DecodeGraphs.run
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.failed: list[tuple[int, int, str]] = []
        self.replays = 0
        # views of the persistent buffers, made once per (size, k): `meta`, and `real_inputs` of
        # a uniform step (no per-step slicing on the verify path, §5.5)
        self._metas: dict[tuple[int, int], AttentionMetadata] = {}
        self._uniform_inputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, AttentionMetadata]] = {}

    def report(self) -> dict:
        """Startup facts: sizes, max_k, graphs captured, capture seconds, the (size x k) failed."""
        return {"sizes": self.sizes, "max_k": self.max_k, "captured": len(self.graphs),
                "capture_seconds": round(self.capture_seconds, 3),
                "failed": [f"{b}x{k}" for b, k, _ in self.failed]}

    def meta(self, bs: int, k: int) -> AttentionMetadata:
        """The attention metadata of a (bs, k) graph step over the persistent buffers (one
        object per (bs, k), made on first use: its tensors are views whose contents each
        step stages)."""
        meta = self._metas.get((bs, k))
        if meta is None:
            n = bs * (1 + k)
            meta = self._metas[(bs, k)] = AttentionMetadata(
                self.cu[k][:bs + 1], self.seq_lens[:bs], self.tables[:bs], self.slots[:n], None,
                max_q_len=1 + k, max_seq_len=self.max_model_len)
        return meta

    def _capture(self, forward: VerifyForward, bs: int, k: int, pool):
        """Warm up and capture the (bs, k) graph; on failure log it and leave it out.
        Returns the pool for the next capture."""
        meta = self.meta(bs, k)
        stream = torch.cuda.current_stream(self.device)
        try:
            self._forward(bs, k, forward, meta)  # warm-up: compiles, allocates
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self._forward(bs, k, forward, meta)
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - a bucket without a graph runs eagerly
            torch.cuda.set_stream(stream)  # a failed capture_end leaves the capture stream current
            log.warning("verify graph (batch %d, k %d) not captured, its steps run eagerly: %r", bs, k, e)
            self.failed.append((bs, k, repr(e)))
            return pool
        self.graphs[(bs, k)] = g
        jit_watch.WATCH.note_capture(f"verify graph batch {bs} k {k}")  # counted once serving
        self.outputs[(bs, k)] = out
        return g.pool()

    def _forward(self, bs: int, k: int, forward: VerifyForward,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a (bs, k) graph runs: the input copy (the header and bs table rows), the model."""
        n = self._header + bs * self.table_width
        self.flat[:n].copy_(self.host[:n], non_blocking=True)
        self._copied.record()
        t = bs * (1 + k)
        return forward(self.ids[:t], self.pos[:t], meta)

    def padded_size(self, b: int, k: int) -> int | None:
        """The smallest captured size >= b with a graph for k, or None (the step runs eagerly)."""
        if not 1 <= k <= self.max_k:
            return None
        for bs in self.sizes[bisect.bisect_left(self.sizes, b):]:
            if (bs, k) in self.graphs:
                return bs
        return None

    def run(self, lay: VerifyLayout, tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay the (padded b, lay.k) graph for b = len(tables) sequences laid out by `lay`
        (`verify_layout`: 1 + k rows each, ids >= 0, seq_lens <= max_model_len + k).
        tables: b block tables, each at most max_blocks long (a list's entries must not
        change once passed here, as for `DecodeGraphs.run`).
        Returns (hidden [len(lay.rows), hidden], aux_hidden [len(lay.rows), ...] or None): the
        real rows, in the eager step's order; views of the graph's outputs, valid until the
        next replay, for a uniform step (no padding row), else copies.
        Raises ValueError when no graph serves (b, k) (check `padded_size` first) or the
        layout's lengths disagree with b.
        """
        k, b = lay.k, len(tables)
        n, r = b * (1 + k), len(lay.rows)
        bs = self.padded_size(b, k)
        if bs is None:
            raise ValueError(f"verify graphs: no graph for batch {b}, k {k}")
        if not len(lay.ids) == len(lay.positions) == len(lay.slots) == n or len(lay.seq_lens) != b \
                or len(lay.offsets) != b + 1 or len(lay.real_seq_lens) != b or lay.offsets[-1] != r:
            raise ValueError(f"verify graphs: a layout of {len(lay.ids)} rows, {len(lay.seq_lens)} seq_lens, "
                             f"{len(lay.offsets)} offsets for {b} seqs of {1 + k} tokens")
        self._copied.synchronize()  # never overwrite host data an earlier copy still reads
        tok, lens = self._h_tok, self._h_lens
        tok[0, :n], tok[1, :n], tok[2, :n], lens[:b] = lay.ids, lay.positions, lay.slots, lay.seq_lens
        self._h_rows[:r], self._h_cu[:b + 1], self._h_real_lens[:b] = lay.rows, lay.offsets, lay.real_seq_lens
        self._h_rows[r:_even(r)] = lay.rows[-1:] * (r % 2)  # an even count: `real_inputs` keeps its rows aligned
        t = bs * (1 + k)
        if t > n:  # padding seqs: token 0 at position 0, no KV write, no attention
            tok[0, n:t] = 0
            tok[1, n:t] = 0
            tok[2, n:t] = -1
            lens[b:bs] = 0
        # entries past a table's end are stale block ids (or 0) of earlier steps: the kernels
        # read those of a padded seq's last K keys, never a -1 (module doc)
        stage_tables(self._h_tables, self._staged, tables)
        self.graphs[(bs, k)].replay()
        self.replays += 1
        hidden, aux = self.outputs[(bs, k)]
        if lay.uniform:
            return hidden[:n], None if aux is None else aux[:n]
        rows = self.real_rows[:r]
        return hidden.index_select(0, rows), None if aux is None else aux.index_select(0, rows)

    def real_inputs(self, lay: VerifyLayout) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The last replayed step's inputs in the eager step's layout (its real rows only), for
        the proposer's `StepView`: (input_ids, positions [len(lay.rows)] int64, metadata with
        the real cu_seqlens_q, seq_lens and slots, max_q_len 1 + lay.k). Views of the graph's
        buffers (a uniform step's ids and positions too), overwritten by the next replay."""
        b, k = len(lay.offsets) - 1, lay.k
        if lay.uniform:
            got = self._uniform_inputs.get((b, k))
            if got is None:
                n = b * (1 + k)
                got = self._uniform_inputs[(b, k)] = (self.ids[:n], self.pos[:n], self.meta(b, k))
            return got
        r = len(lay.rows)
        ids, pos, slots = self._tok.index_select(1, self.real_rows[:_even(r)])[:, :r]  # rows on 16-byte bounds
        meta = AttentionMetadata(self.real_cu[:b + 1], self.real_seq_lens[:b], self.tables[:b], slots, None,
                                 max_q_len=1 + k, max_seq_len=self.max_model_len)
        return ids, pos, meta


def replay_verify(graphs: VerifyGraphs, seqs: list[ScheduledSeq],
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor | None, VerifyLayout] | None:
    """Replay the verify graph of a step, or None when the step does not take one.

    A step takes a graph when `verify_layout` lays it out (every seq samples and is [last
    token, d1..dk] with k = num_draft >= 0, at least one k >= 1, no pending token, no
    prompt logprobs, its tokens within its block table and max_model_len) and a graph
    serves (len(seqs), K = max k). seqs: the step's seqs (resolved: whole block tables).
    Returns (hidden, aux_hidden, layout): the real rows of `VerifyGraphs.run`, row
    layout.offsets[i] + j is token j of seq i (the eager step's rows).
    """
    k = graph_k(seqs)
    if graphs.padded_size(len(seqs), k) is None:
        return None
    lay = verify_layout(seqs, block_size, graphs.max_model_len, graphs.max_blocks)
    if lay is None or not (lay.uniform or MIXED_K):
        return None
    hidden, aux = graphs.run(lay, [s.block_table for s in seqs])
    return hidden, aux, lay
