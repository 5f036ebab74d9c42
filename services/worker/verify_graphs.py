"""CUDA graphs for verify steps (docs/ARCHITECTURE.md §5.5, §6.5): one graph per (batch size, k).

A verify step runs every sequence over [last token, d1..dk]: 1 + k query tokens at the end of
its context. When every sequence of a step has the same k, the step's shapes depend only on
(b, k): T = b * (1 + k) tokens, cu_seqlens_q = 0, 1 + k, 2 (1 + k), ... So a graph captured
for (padded b, k) over persistent buffers serves every such step, as `DecodeGraphs` does for
plain decode steps. The attention is the eager verify step's own backend
(`PagedAttention`: the rotary + KV write kernel, then the varlen kernel), captured with the
static bounds max_q_len = 1 + k and max_seq_len = max_model_len: its grid
(cdiv(1 + k, BLOCK_M), b, heads) depends on those alone, and each program reads its
sequence's query offsets and length on the device. Padding sequences get seq_len 0 (their
programs attend to nothing and write zeros) and their tokens slot -1 (no KV write).

The host stages a step's inputs into one pinned buffer; the graph's first node copies them
in (ids | positions | slots | seq_lens | block tables; `run`). A verify seq's first token is
never pending here (the runner falls back to the eager step when one is), so the graph
resolves no pending ids. Captured batch sizes: `cuda_graphs.capture_sizes` up to
min(max_num_seqs, VERIFY_MAX_BATCH), each for k = 1..num_speculative_tokens. A (size, k)
whose capture fails is logged and left out: its steps run eagerly.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from services.worker.cuda_graphs import capture_sizes
from services.worker.layers.attention import AttentionMetadata
from shared.protocol import PENDING_TOKEN, ScheduledSeq

log = logging.getLogger("kestrel.worker")

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
    Raises ValueError for max_k < 1.
    """

    def __init__(self, forward: VerifyForward, max_num_seqs: int, max_k: int, max_model_len: int,
                 block_size: int, device: torch.device):
        if max_k < 1:
            raise ValueError(f"verify graphs need num_speculative_tokens >= 1, got {max_k}")
        self.sizes = verify_sizes(max_num_seqs)
        self.max_bs = mb = self.sizes[-1]
        self.max_k = max_k
        self.max_model_len = max_model_len
        self.max_blocks = nb = -(-max_model_len // block_size)
        self.device = device
        self.max_tokens = mt = _even(mb * (1 + max_k))
        self._mb2 = mb2 = _even(mb)
        self._header = hn = 3 * mt + mb2  # ids | positions | slots [mt] each, seq_lens [mb2]
        self.flat = torch.zeros(hn + mb * nb, dtype=torch.long, device=device)
        self.ids, self.pos, self.slots = self.flat[:3 * mt].view(3, mt)
        self.seq_lens = self.flat[3 * mt:3 * mt + mb]
        self.tables = self.flat[hn:].view(mb, nb)
        # query offsets of uniform steps, one per k: 0, 1 + k, 2 (1 + k), ...
        self.cu = {k: torch.arange(0, (mb + 1) * (1 + k), 1 + k, dtype=torch.int32, device=device)
                   for k in range(1, max_k + 1)}
        self.host = torch.zeros(hn + mb * nb, dtype=torch.long, pin_memory=True)
        h = self.host.numpy()
        self._h_tok = h[:3 * mt].reshape(3, mt)
        self._h_lens = h[3 * mt:3 * mt + mb]
        self._h_tables = h[hn:].reshape(mb, nb)
        self._h_tok[2] = -1  # padding tokens: no KV write; padding seqs: seq_len 0 (no attention)
        self._staged: list[tuple[list[int] | None, int]] = [(None, 0)] * mb  # as in DecodeGraphs.run
        self._copied = torch.cuda.Event(external=True)  # recorded by each graph after its input copy
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.failed: list[tuple[int, int, str]] = []
        self.replays = 0
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

    def report(self) -> dict:
        """Startup facts: sizes, max_k, graphs captured, capture seconds, the (size x k) failed."""
        return {"sizes": self.sizes, "max_k": self.max_k, "captured": len(self.graphs),
                "capture_seconds": round(self.capture_seconds, 3),
                "failed": [f"{b}x{k}" for b, k, _ in self.failed]}

    def meta(self, bs: int, k: int) -> AttentionMetadata:
        """The attention metadata of a (bs, k) step over the persistent buffers."""
        n = bs * (1 + k)
        return AttentionMetadata(self.cu[k][:bs + 1], self.seq_lens[:bs], self.tables[:bs], self.slots[:n],
                                 None, max_q_len=1 + k, max_seq_len=self.max_model_len)

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
        self.outputs[(bs, k)] = out
        return g.pool()

    def _forward(self, bs: int, k: int, forward: VerifyForward,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a (bs, k) graph runs: the input copy (the header and bs table rows), the model."""
        n = self._header + bs * self.max_blocks
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

    def run(self, k: int, ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            tables: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay the (padded b, k) graph for b = len(tables) sequences of 1 + k tokens each.

        ids, positions, slots: b * (1 + k) ints, sequence after sequence (ids >= 0: no
        pending tokens); seq_lens: b ints (each sequence's context including its 1 + k
        tokens, <= max_model_len); tables: b block tables (a list's entries must not change
        once passed here, as for `DecodeGraphs.run`).
        Returns (hidden [b * (1 + k), hidden], aux_hidden [b * (1 + k), ...] or None): views
        of the graph's outputs, valid until the next replay.
        Raises ValueError when no graph serves (b, k) (check `padded_size` first) or the
        lists' lengths disagree.
        """
        b = len(tables)
        n = b * (1 + k)
        bs = self.padded_size(b, k)
        if bs is None:
            raise ValueError(f"verify graphs: no graph for batch {b}, k {k}")
        if not len(ids) == len(positions) == len(slots) == n or len(seq_lens) != b:
            raise ValueError(f"verify graphs: {len(ids)} ids, {len(positions)} positions, {len(slots)} slots, "
                             f"{len(seq_lens)} seq_lens for {b} seqs of {1 + k} tokens")
        self._copied.synchronize()  # never overwrite host data an earlier copy still reads
        tok, lens = self._h_tok, self._h_lens
        tok[0, :n], tok[1, :n], tok[2, :n], lens[:b] = ids, positions, slots, seq_lens
        t = bs * (1 + k)
        if t > n:  # padding: token 0 at position 0, no KV write, no attention
            tok[0, n:t] = 0
            tok[1, n:t] = 0
            tok[2, n:t] = -1
            lens[b:bs] = 0
        ht, staged = self._h_tables, self._staged
        for i, tb in enumerate(tables):
            had, m = staged[i]
            if had is tb:
                if m == len(tb):
                    continue
                ht[i, m:len(tb)] = tb[m:]
            else:
                ht[i, :len(tb)] = tb
            staged[i] = (tb, len(tb))
        self.graphs[(bs, k)].replay()
        self.replays += 1
        hidden, aux = self.outputs[(bs, k)]
        return hidden[:n], None if aux is None else aux[:n]


def replay_verify(graphs: VerifyGraphs, seqs: list[ScheduledSeq],
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
    """Replay the verify graph of a step, or None when the step does not take one.

    A step takes a graph when every seq samples and is [last token, d1..dk] with the same
    k (num_draft == k >= 1, 1 + k tokens, none PENDING_TOKEN), no seq asks for prompt
    logprobs, its tokens fit its block table and max_model_len (else the eager step
    raises), and a graph serves (len(seqs), k). seqs: the step's seqs (resolved: whole
    block tables). Returns (hidden, aux_hidden, k) of `VerifyGraphs.run`: row i * (1 + k) + j
    is token j of seq i.
    """
    k = seqs[0].num_draft
    if graphs.padded_size(len(seqs), k) is None:
        return None
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    lens: list[int] = []
    for s in seqs:
        if not s.sample or s.num_draft != k or len(s.token_ids) != 1 + k or PENDING_TOKEN in s.token_ids:
            return None
        if s.sampling is not None and s.sampling.prompt_logprobs is not None and s.start_pos < s.num_prompt_tokens:
            return None
        end = s.start_pos + 1 + k
        table = s.block_table
        if end > len(table) * block_size or end > graphs.max_model_len or len(table) > graphs.max_blocks:
            return None
        ids.extend(s.token_ids)
        for p in range(s.start_pos, end):
            pos.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        lens.append(end)
    hidden, aux = graphs.run(k, ids, pos, slots, lens, [s.block_table for s in seqs])
    return hidden, aux, k
