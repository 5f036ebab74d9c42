"""One step's model inputs, flattened over its sequences (docs/ARCHITECTURE.md §6).

Prefill chunks and decodes run together: sequence i's new tokens are rows cu_seqlens_q[i] ..
cu_seqlens_q[i+1]-1 of input_ids and positions, and each token's KV slot comes from the
sequence's block table. For the GPU kernels every integer input goes to the device in one
host-to-device copy; the torch reference gets the step's gather plan instead
(`kernels.attention.build_ref_plan`).
"""

from __future__ import annotations

import torch

from kernels.attention import build_ref_plan
from services.worker.layers.attention import AttentionMetadata
from shared.protocol import ScheduledSeq


def prepare_step(seqs: list[ScheduledSeq], block_size: int, max_model_len: int, device: torch.device,
                 kernels: bool) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids [T] int64, positions [T] int64, metadata) of a step, on `device`.

    seqs: the step's sequences (block tables resolved, at least one). kernels: the metadata
    is for the GPU kernels (host-side max_q_len / max_seq_len, one packed copy), else for
    the torch reference (a `RefAttentionPlan`).
    Raises ValueError when a sequence has no tokens, or its tokens do not fit its block
    table or max_model_len.
    """
    bs = block_size
    ids: list[int] = []
    q_lens, starts, seq_lens = [], [], []
    width = max(len(s.block_table) for s in seqs)
    tables: list[int] = []
    for s in seqs:
        n = len(s.token_ids)
        end = s.start_pos + n
        if end > len(s.block_table) * bs or end > max_model_len or n == 0:
            raise ValueError(f"request {s.request_id}: {n} tokens at {s.start_pos} do not fit its "
                             f"{len(s.block_table)} blocks of {bs} or max_model_len {max_model_len}")
        ids.extend(s.token_ids)
        q_lens.append(n)
        starts.append(s.start_pos)
        seq_lens.append(end)
        tables.extend(s.block_table)
        tables.extend([-1] * (width - len(s.block_table)))
    b, t = len(seqs), len(ids)
    block_tables = torch.tensor(tables, dtype=torch.int32).view(b, width)
    starts_t = torch.tensor(starts, dtype=torch.long)
    cu = torch.zeros(b + 1, dtype=torch.int32)
    if t == b:  # decode only
        positions, seq_idx = starts_t, torch.arange(b)
        cu[1:] = torch.arange(1, b + 1, dtype=torch.int32)
    else:
        q_lens_t = torch.tensor(q_lens, dtype=torch.long)
        cu[1:] = q_lens_t.cumsum(0)
        seq_idx = torch.repeat_interleave(torch.arange(b), q_lens_t)
        positions = starts_t[seq_idx] + torch.arange(t) - cu[:-1].long()[seq_idx]
    slots = block_tables[seq_idx, positions // bs].long() * bs + positions % bs
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    dev = device
    if kernels:  # GPU kernels: one host->device copy of all int inputs
        # each part starts on a 16-byte boundary (an even int64 offset): Triton compiles a
        # kernel per pointer alignment, and unaligned views made steps of some shapes
        # compile mid-run (0.8 s each, H200 offline benchmark)
        parts = [torch.tensor(ids, dtype=torch.long), positions, slots, cu.long(),
                 seq_lens_t.long(), block_tables.long().flatten()]
        sizes = [p.numel() for p in parts]
        packed = torch.empty(sum(n + n % 2 for n in sizes), dtype=torch.long,
                             pin_memory=dev.type == "cuda")
        off = 0
        for p, n in zip(parts, sizes):
            packed[off:off + n] = p
            off += n + n % 2
        d = packed.to(dev, non_blocking=True)
        views, off = [], 0
        for n in sizes:
            views.append(d[off:off + n])
            off += n + n % 2
        ids_d, pos_d, slots_d, cu_d, sl_d, bt_d = views
        meta = AttentionMetadata(cu_d, sl_d, bt_d.view(b, width), slots_d, None,
                                 max_q_len=max(q_lens), max_seq_len=max(seq_lens))
        return ids_d, pos_d, meta
    tables_dev = block_tables.to(dev)
    plan = build_ref_plan(cu, seq_lens_t, tables_dev, bs)
    meta = AttentionMetadata(cu.to(dev), seq_lens_t.to(dev), tables_dev, slots.to(dev), plan)
    return torch.tensor(ids, dtype=torch.long, device=dev), positions.to(dev), meta
