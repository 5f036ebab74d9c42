"""Pending token ids of a CUDA-graph decode step, resolved on the device.

Under async scheduling a decode's input token is the one the previous step drew, which the
host has not seen yet (`shared.protocol.PENDING_TOKEN`). The graph's inputs are copied from
a pinned host buffer by the graph itself (`services.worker.cuda_graphs`), so the host
stages such a token as a reference instead: id -(j + 1) means "row j of the last draw".
`resolve_pending_ids` rewrites those entries in place from the last draw's ids, inside the
graph, before the embedding reads them.

Dispatcher `resolve_pending_ids` picks `resolve_pending_ids_triton` (one launch) on CUDA
when Triton imports, else `resolve_pending_ids_ref` (torch ops).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference runs
    triton = None


def encode_pending(row: int) -> int:
    """The staged id of a token that is row `row` (>= 0) of the last draw: -(row + 1)."""
    return -row - 1


def resolve_pending_ids_ref(ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """ids [n] int64: token ids >= 0, or -(j + 1) for row j of last [m] int64 (j < m).
    Rewrites the negative entries with last[j], in place. Returns ids."""
    neg = ids < 0
    src = (-1 - ids).clamp(min=0)
    ids.copy_(torch.where(neg, last[src.clamp(max=max(0, last.numel() - 1))], ids))
    return ids


def resolve_pending_ids(ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Dispatcher for `resolve_pending_ids_ref` (see there for shapes)."""
    if ids.is_cuda and resolve_pending_ids_triton is not None:
        return resolve_pending_ids_triton(ids, last)
    return resolve_pending_ids_ref(ids, last)


resolve_pending_ids_triton = None  # set below when Triton imports: resolve_pending_ids_ref's signature

if triton is not None:
    @triton.jit
    def _resolve_kernel(ids_ptr, last_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        ids = tl.load(ids_ptr + offs, mask=m, other=0)
        neg = ids < 0
        got = tl.load(last_ptr + tl.where(neg, -1 - ids, 0), mask=m & neg, other=0)
        tl.store(ids_ptr + offs, tl.where(neg, got, ids), mask=m & neg)

    def resolve_pending_ids_triton(ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """The CUDA path of `resolve_pending_ids` (ids and last contiguous int64)."""
        n = ids.numel()
        if n:
            block = min(1024, triton.next_power_of_2(n))
            _resolve_kernel[(triton.cdiv(n, block),)](ids, last, n, BLOCK=block, num_warps=1 if block <= 256 else 4)
        return ids
