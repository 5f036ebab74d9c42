"""One mixed-k verify step's attention in both layouts, for the padding tests: the eager step's
(each seq its 1 + k_i queries) and the padded one of a verify graph (`verify_layout`: 1 + K
rows a seq, padding rows after the real ones). Used in process with the torch reference
(tests/unit/test_verify_layout.py) and under TRITON_INTERPRET=1 with the Triton kernels
(tests/unit/verify_padding_interp.py).

The cache holds random K/V everywhere, and values 100x larger at every position a padded
step reads that its eager step does not (each seq's positions past its real end, through
its table and the stale block ids staged past it), so a real row that attended to one would
be far off. The staged table rows are `VerifyGraphs.table_width` wide, as in the graphs.
"""

from __future__ import annotations

import torch

from services.worker.verify_layout import VerifyLayout, verify_layout
from shared.protocol import SamplingParams, ScheduledSeq

BS = 4  # tokens per block
MAX_MODEL_LEN = 40
# (start_pos, k) per seq: K = 4; the second ends at max_model_len, its padding past it and
# past its table; the third is a decode (k = 0) at position 0
SEQS = ((5, 3), (39, 0), (0, 0), (13, 1), (30, 4))
H, KVH, D = 4, 2, 16


def build(dtype: torch.dtype, seed: int = 0):
    """(layout, eager inputs, padded inputs, caches) of the SEQS step on the CPU.

    eager / padded: (q [T, H, D], cu_seqlens_q [b + 1] int32, seq_lens [b] int32,
    block_tables [b, width] int32) with T = sum(1 + k_i) / b (1 + K); the padded q's real
    rows are the eager q. caches: (k_cache, v_cache) [blocks, BS, KVH, D].
    """
    g = torch.Generator().manual_seed(seed)
    width = -(-(MAX_MODEL_LEN + max(k for _, k in SEQS)) // BS)  # VerifyGraphs.table_width
    num_blocks = sum(-(-(s + 1 + k) // BS) for s, k in SEQS) + 4
    perm = torch.randperm(num_blocks, generator=g).tolist()
    seqs = []
    for i, (s, k) in enumerate(SEQS):
        table = [perm.pop() for _ in range(-(-(s + 1 + k) // BS))]
        seqs.append(ScheduledSeq(f"s{i}", list(range(1 + k)), s, table, True, SamplingParams(), 1, num_draft=k))
    lay = verify_layout(seqs, BS, MAX_MODEL_LEN, -(-MAX_MODEL_LEN // BS))
    assert lay is not None and lay.k == 4
    kc = torch.randn(num_blocks, BS, KVH, D, generator=g)
    vc = torch.randn(num_blocks, BS, KVH, D, generator=g)
    stale = perm  # blocks no seq owns: what a staged row holds past a table's end
    eager_tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
    staged = torch.tensor([stale[(i + j) % len(stale)] for i in range(len(seqs)) for j in range(width)],
                          dtype=torch.int32).view(len(seqs), width)
    for i, s in enumerate(seqs):
        t = torch.tensor(s.block_table, dtype=torch.int32)
        eager_tables[i, :len(t)] = t
        staged[i, :len(t)] = t
        for p in range(s.start_pos + 1 + s.num_draft, lay.seq_lens[i]):  # read by the padded step only
            b = int(staged[i, p // BS])
            kc[b, p % BS] *= 100
            vc[b, p % BS] *= 100
    q_pad = torch.randn(len(lay.ids), H, D, generator=g)
    rows = torch.tensor(lay.rows)
    eager = (q_pad[rows].to(dtype), torch.tensor(lay.offsets, dtype=torch.int32),
             torch.tensor(lay.real_seq_lens, dtype=torch.int32), eager_tables)
    padded = (q_pad.to(dtype), torch.arange(0, len(lay.ids) + 1, 1 + lay.k, dtype=torch.int32),
              torch.tensor(lay.seq_lens, dtype=torch.int32), staged)
    return lay, eager, padded, (kc.to(dtype), vc.to(dtype))


def real_rows(lay: VerifyLayout, out: torch.Tensor) -> torch.Tensor:
    """The real rows of a padded step's output [b (1 + K), ...], in the eager step's order."""
    return out[torch.tensor(lay.rows)]
