"""`VerifyGraphs` on the CPU, for the runner-level tests of padded verify steps
(tests/unit/test_verify_graphs_padded.py): the real class's buffers, staging, layout and
outputs, each (size, k) "graph" replayed by running what a capture would record
(`VerifyGraphs._forward`: the input copy, then the forward over the padded buffers) eagerly,
with the torch reference attention. Two differences from a CUDA graph, both forced by the
reference: `store_kv_ref` takes no negative slot, so padding rows write to `scratch_slot` (a
block no test seq uses; the Triton kernels skip slot -1), and the reference refuses a seq of
length 0 with queries, so every batch size is "captured" (no padding seqs;
tests/gpu/test_verify_graphs_gpu.py covers them on real graphs). `check_mixed_step` compares a
step through verify graphs (these or real ones) with the same step run eagerly."""

from __future__ import annotations

import dataclasses

import torch

from services.worker.verify_graphs import VerifyForward, VerifyGraphs
from shared.protocol import StepPlan


class _NoEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Replay:
    """One (size, k) entry of `graphs`: `replay` runs the capture's body eagerly."""

    def __init__(self, vg: VerifyGraphs, forward: VerifyForward, bs: int, k: int):
        self.vg, self.forward, self.bs, self.k = vg, forward, bs, k

    def replay(self) -> None:
        vg = self.vg
        vg.outputs[(self.bs, self.k)] = vg._forward(self.bs, self.k, self.forward, vg.meta(self.bs, self.k))


class EagerReplayGraphs(VerifyGraphs):
    """CPU `VerifyGraphs` (module doc) over `forward` (the runner's `_verify_graph_forward`);
    sizes 1..min(max_num_seqs, 32), k 1..max_k; slot -1 rows write at scratch_slot."""

    def __init__(self, forward: VerifyForward, max_num_seqs: int, max_k: int, max_model_len: int,
                 block_size: int, scratch_slot: int):
        self._alloc(max_num_seqs, max_k, max_model_len, block_size, torch.device("cpu"), pin_memory=False)
        self.sizes = list(range(1, self.max_bs + 1))
        self._copied = _NoEvent()  # type: ignore[assignment]

        def scratch(ids, pos, meta):
            slots = torch.where(meta.slot_mapping < 0, scratch_slot, meta.slot_mapping)
            return forward(ids, pos, dataclasses.replace(meta, slot_mapping=slots))

        for k in range(1, max_k + 1):
            for bs in self.sizes:
                self.graphs[(bs, k)] = _Replay(self, scratch, bs, k)  # type: ignore[assignment]
        self.capture_seconds = 0.0


def caches(r) -> list[torch.Tensor]:
    """Every KV tensor of a runner with a drafter group: the target's (k, v per layer), then
    the drafter's."""
    assert r.draft_kv is not None
    return [t for h in (*r.kv.layers, *r.draft_kv.layers) for t in (h.k, h.v)]


def run_capturing(r, fake, plan):
    """Execute plan on runner r (its proposer the FakeDrafter `fake`). Returns (the step's
    logits, its StepResult, fake's record of the view, (view hidden, aux hidden,
    cu_seqlens_q, seq_lens) copied, fake's ProposeRequests of the step)."""
    got: dict = {}
    forward, observe = r._forward, fake.observe

    def keep_logits(p):
        got["fwd"] = out = forward(p)
        return out

    def keep_view(view):
        got["view"] = (view.hidden.clone(), view.aux_hidden.clone(), view.meta.cu_seqlens_q.tolist(),
                       view.meta.seq_lens.tolist())
        observe(view)

    r._forward, fake.observe = keep_logits, keep_view
    try:
        res = r.execute(plan)
    finally:
        del r._forward, fake.observe
    assert res.error is None, res.error
    return got["fwd"].logits.clone(), res, fake.seen[-1], got["view"], fake.requests[-1]


def check_mixed_step(r, fake, vg, seqs, step: int, blocks: list[int], atol: float, tokens: bool = True):
    """Run the verify step `seqs` (resolved whole tables, sampling set, the KV before them
    written) through verify graphs `vg`, then, from the same KV, eagerly; assert that it
    replayed once and that both give the same logits (within atol, relative too), the same
    proposer view (ids, positions, slots, drafter KV; hidden and aux within atol) and
    ProposeRequests, and the same KV in `blocks` (both groups; within atol), and that each
    run wrote KV only at the step's real slots (the target's at every one of them); with
    `tokens`, the same emitted tokens. Returns the graph run's StepResult. Leaves the KV of
    the eager run; uses step ids step and step + 1."""
    bs = r.block_size
    idx = torch.tensor(blocks, device=r.kv.layers[0].k.device)
    before = [t.index_select(0, idx) for t in caches(r)]
    saved, n0 = r.verify_graphs, vg.replays
    r.verify_graphs = vg
    try:
        g = run_capturing(r, fake, StepPlan(step, seqs))
    finally:
        r.verify_graphs = None
    assert vg.replays == n0 + 1, "the step did not replay a verify graph"
    after_graph = [t.index_select(0, idx) for t in caches(r)]
    for t, b in zip(caches(r), before):
        t.index_copy_(0, idx, b)
    try:
        e = run_capturing(r, fake, StepPlan(step + 1, seqs))
    finally:
        r.verify_graphs = saved
    assert vg.replays == n0 + 1
    after_eager = [t.index_select(0, idx) for t in caches(r)]
    (g_logits, g_res, g_seen, g_view, g_reqs), (e_logits, e_res, e_seen, e_view, e_reqs) = g, e
    assert g_logits.shape == e_logits.shape == (sum(len(s.token_ids) for s in seqs), r.spec.vocab_size)
    assert torch.isfinite(g_logits).all()
    torch.testing.assert_close(g_logits, e_logits, atol=atol, rtol=atol)
    if tokens:
        assert g_res.sampled_token_ids == e_res.sampled_token_ids and g_res.num_sampled == e_res.num_sampled
    for key in ("ids", "positions", "slots", "kv", "hidden", "aux"):
        assert g_seen[key] == e_seen[key], key
    torch.testing.assert_close(g_view[0], e_view[0], atol=atol, rtol=atol)  # hidden
    torch.testing.assert_close(g_view[1], e_view[1], atol=atol, rtol=atol)  # aux hidden
    assert g_view[2:] == e_view[2:]  # cu_seqlens_q, seq_lens
    # what a ProposeRequest emitted, and so where it goes on, follows the accepted tokens: compared
    # only where the tokens are (bf16: the padded graph and the eager step may take different
    # kernel paths, so an argmax may flip within atol)
    def reqs(qs):
        return [(q.request_id, q.seq_index) + ((q.emitted, q.next_pos, q.row) if tokens else ()) for q in qs]
    assert reqs(g_reqs) == reqs(e_reqs)
    real = {s.block_table[p // bs] * bs + p % bs for s in seqs for p in range(s.start_pos, s.start_pos + len(s.token_ids))}
    n_target = 2 * len(r.kv.layers)
    for c, (x_g, x_e, b) in enumerate(zip(after_graph, after_eager, before)):
        torch.testing.assert_close(x_g, x_e, atol=atol, rtol=atol)
        for x in (x_g, x_e):  # the slots each run wrote
            rows = (x != b).flatten(2).any(2).nonzero().tolist()  # (index in blocks, offset)
            touched = {blocks[i] * bs + o for i, o in rows}
            assert touched <= real, f"cache {c}: KV written outside the step's real slots"
            assert touched == real or c >= n_target  # the target's at every real slot
    return g_res
