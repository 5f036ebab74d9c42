"""The padded layout of a verify step replayed from a CUDA graph (docs/ARCHITECTURE.md §5.5,
§6.5; `services/worker/verify_graphs.py` replays it).

A verify graph is captured for (batch size, K): b seqs of 1 + K query tokens each. A step
whose seqs verify different k (n-gram or adaptive drafting), decode-only seqs (k = 0, one
token) among them, takes the graph of K = max k: every seq is padded to 1 + K rows.

Seq i's token j is row i (1 + K) + j. Rows j <= k_i are its real tokens, with the eager
step's ids, positions and KV slots. Rows j > k_i are padding:
- token id 0 (any valid id: its hidden state is dropped);
- position min(start_pos + j, max_model_len - 1): the rotary table has max_model_len rows,
  and the attention kernels take causal limits from seq_lens, never from positions;
- slot -1: the KV write skips it (`kernels.attention_triton.store_kv_triton`,
  `kernels.rotary`). So a padded step writes exactly the eager step's slots, and no block
  (a prefix-cache block included) ever holds a padding row's K/V.
seq_lens[i] = start_pos + 1 + K, so that both attention kernels (the split-K multi-query
kernel of `kernels.attention_multi_query` and the varlen prefill kernel of
`kernels.attention_triton`) see context length seq_len - q_len = start_pos, and real row j
its own causal limit start_pos + j: real rows never see a padding row (those come after
them), and the keys they mask out add exact zeros. The kernels do read keys up to
seq_len - 1 = start_pos + K, up to K past the seq's last real position and its block
table: those keys hold stale but finite K/V (the cache is zero-initialised and only ever
written by forwards), and the graphs' staged block-table rows are wide enough for them
(`VerifyGraphs.table_width`) and hold only valid block ids past a table's end.

The eager step's layout is kept beside it: `rows` (the padded row of each real token, seq
after seq: the eager step's flat order), `offsets` (its cu_seqlens_q) and `real_seq_lens`,
for the logits (all real rows: every seq of such a step samples, and its last num_draft + 1
tokens are all its tokens, `spec.step.logit_rows`) and the proposer's `StepView`.

Padding limit: a step pads whenever a captured (padded b, K) graph exists, i.e. b <=
VERIFY_MAX_BATCH (32) and K <= num_speculative_tokens, so a step runs at most 32 (1 + K)
rows. No ratio of padded to real tokens is enforced: at those sizes the forward's time is
the weights' reads and the launches, not the rows (H200, Qwen3-0.6B shape: a graph verify
step 2.5 ms at every k from 1 to 8, an eager one 16-23 ms).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import PENDING_TOKEN, ScheduledSeq


@dataclass
class VerifyLayout:
    """A verify step padded to 1 + k tokens per seq (module doc). Host ints throughout.

    k: the graph's k, max num_draft over the step's seqs (>= 1).
    ids, positions, slots: b (1 + k) ints each, seq i's row j at i (1 + k) + j (slot -1 for
        padding rows).
    seq_lens: b ints, start_pos + 1 + k.
    rows: sum(1 + num_draft) ints, the padded row of each real token, seq after seq.
    offsets: b + 1 ints, the eager step's cu_seqlens_q (seq i's real tokens are
        rows[offsets[i]:offsets[i + 1]]).
    real_seq_lens: b ints, start_pos + 1 + num_draft (the eager step's seq_lens).
    """

    k: int
    ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    rows: list[int]
    offsets: list[int]
    real_seq_lens: list[int]

    @property
    def uniform(self) -> bool:
        """Every seq verifies k drafts: no padding row (the real layout is the padded one)."""
        return len(self.rows) == len(self.ids)


def graph_k(seqs: list[ScheduledSeq]) -> int:
    """The k of the verify graph a step would take: its seqs' largest num_draft (0: none)."""
    return max((s.num_draft for s in seqs), default=0)


def verify_layout(seqs: list[ScheduledSeq], block_size: int, max_model_len: int,
                  max_blocks: int) -> VerifyLayout | None:
    """The padded layout of a step (module doc), or None when the step is no verify step a
    graph may run: no seq has drafts; a seq does not sample or is not [last token,
    d1..dk] (1 + num_draft tokens: a prefill chunk is neither); a token is PENDING_TOKEN
    (the graph resolves no pending ids); a seq asks for prompt logprobs; or a seq's real
    tokens do not fit its block table, max_model_len, or its table is longer than
    max_blocks (the eager step raises for the first two).

    seqs: the step's seqs (resolved: whole block tables). block_size: tokens per KV block.
    """
    k = graph_k(seqs)
    if k < 1:
        return None
    w = 1 + k
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    lens: list[int] = []
    rows: list[int] = []
    offsets = [0]
    real_lens: list[int] = []
    last_pos = max_model_len - 1
    for i, s in enumerate(seqs):
        n = len(s.token_ids)
        if not s.sample or n != 1 + s.num_draft or PENDING_TOKEN in s.token_ids:
            return None
        if s.sampling is not None and s.sampling.prompt_logprobs is not None and s.start_pos < s.num_prompt_tokens:
            return None
        start, table = s.start_pos, s.block_table
        end = start + n
        if end > len(table) * block_size or end > max_model_len or len(table) > max_blocks:
            return None
        ids.extend(s.token_ids)
        pos.extend(range(start, end))
        blk, off = divmod(start, block_size)
        if off + n <= block_size:  # the usual case: every real token in one block
            base = table[blk] * block_size
            slots.extend(range(base + off, base + off + n))
        else:
            slots.extend([table[p // block_size] * block_size + p % block_size for p in range(start, end)])
        if n < w:
            ids.extend([0] * (w - n))
            pos.extend([min(p, last_pos) for p in range(end, start + w)])
            slots.extend([-1] * (w - n))
        lens.append(start + w)
        rows.extend(range(i * w, i * w + n))
        offsets.append(offsets[-1] + n)
        real_lens.append(end)
    return VerifyLayout(k, ids, pos, slots, lens, rows, offsets, real_lens)
