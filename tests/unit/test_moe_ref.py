"""The fused MoE reference (`kernels.moe.fused_moe_ref`, the CPU path) against a naive
per-token, per-slot loop in float64, and the invariants of `moe_align`.

Tolerances (relative norm error against the float64 loop on the same inputs): fp32 1e-5
(summation order only: ~2e-7 measured); bf16 1e-2 (the reference rounds gate_up, silu, act
and the down output to bf16, ~2**-9 relative each: 3e-3..4.4e-3 measured on these shapes).
"""

from __future__ import annotations

import pytest
import torch

from kernels import moe

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def naive_moe(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * w2[e] @ (silu(gate) * up), token by token in float64."""
    t_, h = x.shape
    inter = w2.shape[2]
    out = torch.zeros(t_, h, dtype=torch.float64)
    for t in range(t_):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gu = w13[e].double() @ x[t].double()
            act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            out[t] += float(topk_weights[t, j]) * (w2[e].double() @ act)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite output"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_case(t, h, inter, e, k, dtype, seed=0, ids=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter ** 0.5).to(dtype)
    if ids is None:  # distinct experts per token, as a router's top-k
        ids = torch.rand(t, e, generator=g).topk(k, dim=1).indices
    w = torch.softmax(torch.randn(t, k, generator=g), dim=1)
    return x, w13, w2, w, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,inter,e,k", [(1, 48, 40, 4, 1), (3, 72, 30, 8, 2), (17, 50, 24, 8, 2),
                                           (17, 64, 96, 4, 2), (5, 33, 7, 8, 1)])
def test_reference_matches_naive_loop(dtype, t, h, inter, e, k):
    x, w13, w2, w, ids = make_case(t, h, inter, e, k, dtype)
    got = moe.fused_moe_ref(x, w13, w2, w, ids)
    assert got.dtype == dtype and got.shape == (t, h)
    assert rel(got, naive_moe(x, w13, w2, w, ids)) < TOL[dtype]
    # the dispatcher keeps CPU tensors on the reference; int32 ids are the same
    assert torch.equal(moe.fused_moe(x, w13, w2, w, ids.int()), got)


def test_shared_experts_idle_experts_and_repeated_slots():
    # every token on expert 2 (slot 0), expert 5 never used, one token with expert 1 twice
    x, w13, w2, w, _ = make_case(9, 40, 24, 8, 2, torch.float32, seed=3)
    ids = torch.tensor([[2, j % 5 if j % 5 != 2 else 6] for j in range(9)])
    ids[4] = torch.tensor([1, 1])
    assert not (ids == 5).any()
    got = moe.fused_moe_ref(x, w13, w2, w, ids)
    assert rel(got, naive_moe(x, w13, w2, w, ids)) < TOL[torch.float32]
    # an expert's weights matter only through its tokens: changing expert 5 changes nothing
    w13b = w13.clone()
    w13b[5] = 100.0
    assert torch.equal(moe.fused_moe_ref(x, w13b, w2, w, ids), got)


def test_gate_and_up_halves_are_not_interchangeable():
    x, w13, w2, w, ids = make_case(4, 32, 16, 4, 2, torch.float32, seed=5)
    swapped = torch.cat([w13[:, 16:], w13[:, :16]], dim=1)
    assert rel(moe.fused_moe_ref(x, swapped, w2, w, ids), naive_moe(x, w13, w2, w, ids)) > 0.1


def test_zero_tokens_gives_empty_output():
    x, w13, w2, w, ids = make_case(0, 40, 24, 8, 2, torch.bfloat16)
    for fn in (moe.fused_moe_ref, moe.fused_moe):
        out = fn(x, w13, w2, w, ids)
        assert out.shape == (0, 40) and out.dtype == torch.bfloat16


def test_shape_errors():
    x, w13, w2, w, ids = make_case(3, 40, 24, 8, 2, torch.float32)
    with pytest.raises(ValueError):
        moe.fused_moe_ref(x, w13, w2.transpose(1, 2), w, ids)
    with pytest.raises(ValueError):
        moe.fused_moe_ref(x, w13, w2, w[:, :1], ids)
    with pytest.raises(ValueError):
        moe.fused_moe_ref(x.half(), w13, w2, w, ids)
    with pytest.raises(ValueError):
        moe.fused_moe_ref(x, w13, w2, w, ids.float())


@pytest.mark.parametrize("renorm", [True, False])
def test_routed_block_on_cpu_is_torch_routing_then_the_reference(renorm):
    # moe_block (the layer's entry) keeps CPU tensors on the torch routing and fused_moe_ref,
    # whatever DECODE_FUSED says; the routing against softmax then topk by hand
    x, w13, w2, _, _ = make_case(3, 40, 24, 8, 2, torch.float32, seed=9)
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    probs = torch.softmax(logits.double(), dim=-1)
    top = probs.topk(2, dim=-1)
    w, ids = moe.topk_softmax_ref(logits, 2, renorm)
    want_w = top.values / top.values.sum(-1, keepdim=True) if renorm else top.values
    assert torch.equal(ids, top.indices) and torch.allclose(w.double(), want_w, atol=1e-6)
    assert torch.equal(moe.moe_block(x, logits, w13, w2, 2, renorm), moe.fused_moe_ref(x, w13, w2, w, ids))
    assert rel(moe.moe_block(x, logits, w13, w2, 2, renorm), naive_moe(x, w13, w2, w, ids)) < TOL[torch.float32]


# ---------------------------------------------------------------- moe_align

def check_alignment(ids: torch.Tensor, e: int, bm: int) -> None:
    """Every invariant of moe_align's output for topk_ids `ids` (module doc of kernels.moe)."""
    n = ids.numel()
    sorted_ids, blocks, npp = moe.moe_align(ids, e, bm)
    p = -(-(n + min(e, n) * (bm - 1)) // bm) * bm
    assert sorted_ids.shape == (p,) and blocks.shape == (p // bm,) and npp.shape == (1,)
    assert sorted_ids.dtype == blocks.dtype == npp.dtype == torch.int32
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=e)
    want_npp = int(((counts + bm - 1) // bm * bm).sum())
    assert int(npp) == want_npp and want_npp % bm == 0 and want_npp <= p
    real = sorted_ids[sorted_ids != n].long()
    assert torch.equal(real.sort().values, torch.arange(n)), "each pair exactly once"
    assert ((sorted_ids >= 0) & (sorted_ids <= n)).all(), "anything else is the sentinel T*k"
    assert (sorted_ids[want_npp:] == n).all()
    used = int(npp) // bm
    assert (blocks[used:] == -1).all() and ((blocks[:used] >= 0) & (blocks[:used] < e)).all()
    tiles = sorted_ids.view(-1, bm).long()
    for b in range(used):
        tile = tiles[b][tiles[b] != n]
        assert tile.numel() > 0, "a used tile holds at least one pair"
        assert (flat[tile] == int(blocks[b])).all(), "a tile holds one expert's pairs"
        assert tiles[b][0] != n, "padding only at the end of an expert's group"
    # groups in expert order, pairs ascending within each, padding right after each group
    assert torch.equal(blocks[:used].long(), blocks[:used].long().sort().values)
    for ex in range(e):
        group = tiles[:used][blocks[:used] == ex].reshape(-1)
        assert group.numel() == -(-int(counts[ex]) // bm) * bm
        assert torch.equal(group[:int(counts[ex])], (flat == ex).nonzero().flatten())


@pytest.mark.parametrize("t,k,e,bm", [(1, 1, 4, 16), (3, 2, 8, 16), (17, 2, 8, 4), (17, 2, 4, 1), (40, 8, 128, 16),
                                      (64, 2, 8, 64), (5, 3, 8, 7)])
def test_moe_align_invariants(t, k, e, bm):
    g = torch.Generator().manual_seed(t * 131 + bm)
    ids = torch.rand(t, e, generator=g).topk(k, dim=1).indices
    check_alignment(ids, e, bm)
    check_alignment(ids.int(), e, bm)
    assert all(torch.equal(a, b) for a, b in zip(moe.moe_align(ids, e, bm), moe.moe_align(ids.int(), e, bm)))


def test_moe_align_shapes_depend_on_shapes_only():
    # all pairs on one expert vs spread over all: same shapes
    e, bm = 8, 16
    one = torch.full((6, 2), 3)
    spread = torch.arange(12).view(6, 2) % e
    a, b = moe.moe_align(one, e, bm), moe.moe_align(spread, e, bm)
    assert [x.shape for x in a] == [x.shape for x in b]
    assert int(a[2]) == 16 and int(b[2]) == 8 * 16
    assert a[1].tolist()[:2] == [3, -1]
    check_alignment(one, e, bm)
    check_alignment(spread, e, bm)
    # repeated ids within a token (not from a top-k) align too
    check_alignment(torch.tensor([[1, 1], [1, 0], [7, 7]]), e, 4)


def test_moe_align_zero_tokens_and_errors():
    s, b, npp = moe.moe_align(torch.zeros((0, 2), dtype=torch.long), 8, 16)
    assert s.shape == (0,) and b.shape == (0,) and npp.tolist() == [0]
    with pytest.raises(ValueError):
        moe.moe_align(torch.zeros((2, 2)), 8, 16)
    with pytest.raises(ValueError):
        moe.moe_align(torch.zeros((2, 2), dtype=torch.long), 8, 0)
