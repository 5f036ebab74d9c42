"""`DecodeGraphs` on the CPU (services/worker/cuda_graphs.py): the real class's persistent
buffers, host staging, padding and recurrent-state view (`state_view`: slots, has_initial and
cu_seqlens as views of the staged header), each "graph" replayed by running what its capture
records (`DecodeGraphs._forward`: the input copy, pending ids, the forward over the padded
buffers) eagerly, with the torch reference attention. So the state path a CUDA graph
captures (static buffers, padding rows on the scratch slot) runs here as it would replay.
Two differences from a CUDA graph, both forced by the reference attention, neither on the
recurrent layers' path: `store_kv_ref` takes no negative slot, so padding rows write their
K/V at `scratch_kv_slot` (a block no test seq uses; the Triton kernels skip slot -1), and the
reference refuses a query longer than its sequence, so a padding row's length 0 becomes 1 (it
reads one stale key; its output is dropped). tests/gpu/test_hybrid_graphs_gpu.py replays real
graphs."""

from __future__ import annotations

import dataclasses

import torch

from services.worker.cuda_graphs import DecodeForward, DecodeGraphs
from services.worker.state_cache import StateCache


class _NoEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Replay:
    """One size of `graphs`: `replay` runs the capture's body eagerly."""

    def __init__(self, g: EagerReplayDecodeGraphs, forward: DecodeForward, bs: int):
        self.g, self.forward, self.bs = g, forward, bs

    def replay(self) -> None:
        g = self.g
        g.replays.append(self.bs)
        g.outputs[self.bs] = g._forward(self.bs, self.forward, g.meta(self.bs), g.state_view(self.bs))


class EagerReplayDecodeGraphs(DecodeGraphs):
    """CPU `DecodeGraphs` (module doc) over `forward` (the runner's `_graph_forward`), with
    the runner's state cache; the captured sizes of max_num_seqs. `replays`: the size of
    each replay, in order."""

    def __init__(self, forward: DecodeForward, max_num_seqs: int, max_model_len: int, block_size: int,
                 state_cache: StateCache | None, scratch_kv_slot: int):
        self._alloc(max_num_seqs, max_model_len, block_size, torch.device("cpu"), state_cache, pin_memory=False)
        self._copied = _NoEvent()  # type: ignore[assignment]
        self.replays: list[int] = []

        def reference_padding(ids, pos, meta, state):
            slots = torch.where(meta.slot_mapping < 0, scratch_kv_slot, meta.slot_mapping)
            return forward(ids, pos, dataclasses.replace(meta, slot_mapping=slots, seq_lens=meta.seq_lens.clamp(min=1)),
                           state)

        for bs in self.sizes:
            self.graphs[bs] = _Replay(self, reference_padding, bs)  # type: ignore[assignment]
        self.capture_seconds = 0.0
