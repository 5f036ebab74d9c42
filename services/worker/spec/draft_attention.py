"""Attention inputs and KV writes of the drafters with their own KV group (EAGLE head,
DFlash drafter; docs/ARCHITECTURE.md §5.5).

- `store_kv_only`: rotate (and k-norm) keys and write keys and values into a drafter
  layer's paged cache, with no query: what `observe` does over a step's tokens (a drafter
  layer's K/V at a position depend on its input there only, so no attention runs).
- `row_inputs`: attention inputs where every query row is a sequence of its own, over a
  block table and up to a length given per row. A chained EAGLE step is a decode (row at
  position p sees 0..p); DFlash's block rows all see the context and the whole block, which
  makes the attention within the block bidirectional with the causal kernels unchanged.
- `row_backend`: the backend for such rows; DFlash's rows of one block read each other's
  K/V, so they go through the write-then-attend path (`PagedAttention`), never the fused
  decode kernel, whose programs write and read K/V in one launch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.attention import build_ref_plan
from kernels.rotary import rotary_and_store_kv
from services.worker.layers.attention import (AttentionBackend, AttentionLayer, AttentionMetadata,
                                              PagedAttention, ReferenceAttention, select_backend)


def device_ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """values as an int64 tensor on `device`; on CUDA through pinned memory with a
    non-blocking copy, so that the host does not wait for the stream (a pageable copy
    would)."""
    cuda = device.type == "cuda"
    return torch.tensor(list(values), dtype=torch.long, pin_memory=cuda).to(device, non_blocking=cuda)


def store_kv_only(layer: AttentionLayer, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, kv_heads, head_dim] (views with a unit last stride; k is normed and
    rotated in place) into `layer`'s cache at slot_mapping [T] int64 (< 0: skipped on the
    GPU), rotated at positions [T] int64, with the layer's k norm when it has one. The
    rotary kernel's query is an empty view of k (no head)."""
    q = k[:, :0]
    kn = layer.k_norm
    rotary_and_store_kv(q, k, v, positions, layer.cos_sin, layer.k, layer.v, slot_mapping,
                        kn, kn, layer.eps)


def row_inputs(positions: Sequence[int], seq_lens: Sequence[int], tables: Sequence[Sequence[int]],
               block_size: int, device: torch.device, kernels: bool) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions [N] int64, metadata) of N query rows, row i a sequence of its own: its
    token at positions[i] (K/V written at that position's slot of tables[i]) seeing cache
    positions 0 .. seq_lens[i] - 1 of tables[i]. kernels: metadata for the GPU kernels (one
    host-to-device copy), else for the torch reference (a `RefAttentionPlan`).
    Raises ValueError when a row's table does not cover max(position + 1, seq_len) tokens."""
    n = len(positions)
    width = max(len(t) for t in tables)
    flat: list[int] = []
    slots: list[int] = []
    for p, s, t in zip(positions, seq_lens, tables):
        if max(p + 1, s) > len(t) * block_size:
            raise ValueError(f"drafter row at {p} seeing {s} tokens: its table holds {len(t)} blocks "
                             f"of {block_size}")
        slots.append(t[p // block_size] * block_size + p % block_size)
        flat.extend(t)
        flat.extend([-1] * (width - len(t)))
    if kernels:  # one host-to-device copy; each part 16-byte aligned, as step_inputs.prepare_step does
        parts = [list(positions), slots, list(range(n + 1)), list(seq_lens), flat]
        host: list[int] = []
        for part in parts:
            host.extend(part)
            host.extend([0] * (len(part) % 2))
        d = device_ints(host, device)
        views, off = [], 0
        for part in parts:
            views.append(d[off:off + len(part)])
            off += len(part) + len(part) % 2
        pos_d, slots_d, cu_d, lens_d, bt_d = views
        meta = AttentionMetadata(cu_d, lens_d, bt_d.view(n, width), slots_d, None, max_q_len=1,
                                 max_seq_len=max(seq_lens))
        return pos_d, meta
    cu = torch.arange(n + 1, dtype=torch.int32)
    lens = torch.tensor(list(seq_lens), dtype=torch.int32)
    tables_dev = torch.tensor(flat, dtype=torch.int32).view(n, width).to(device)
    plan = build_ref_plan(cu, lens, tables_dev, block_size)
    meta = AttentionMetadata(cu.to(device), lens.to(device), tables_dev,
                             torch.tensor(slots, dtype=torch.long, device=device), plan)
    return torch.tensor(list(positions), dtype=torch.long, device=device), meta


def row_backend(layers: Sequence[AttentionLayer], meta: AttentionMetadata, reference: bool,
                rows_read_each_other: bool) -> AttentionBackend:
    """The backend for `row_inputs` rows: the reference when `reference`; with
    rows_read_each_other (DFlash's block) `PagedAttention` (every row's K/V written before
    any row attends); else the runner's choice (`select_backend`: the fused decode kernel on
    CUDA)."""
    if reference:
        return ReferenceAttention(layers, meta)
    if rows_read_each_other:
        return PagedAttention(layers, meta)
    return select_backend(layers, meta, reference)
