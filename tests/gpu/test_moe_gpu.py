"""The fused-MoE Triton path (`kernels.moe.fused_moe` on CUDA) against `fused_moe_ref` at the
Qwen3-30B-A3B layer shape (E = 128 experts, top-8, H = 2048, I = 768), T = 1, 16, 256 tokens
(decode, a small batch, a prefill chunk: the three default-config regimes).

Tolerances (relative norm error vs the reference run in fp32 on the upcast inputs, as
tests/gpu/test_kernels_gpu.py): bf16 2e-2 (the bf16 reference itself is ~4e-3 off its fp32
run: tests/unit/test_moe_ref.py), fp32 2e-3 (tl.dot runs as tf32). Also: the dispatcher
picks Triton, int32 ids, T = 0, and a CUDA-graph capture of the whole op (moe_align
included: no host sync) replayed on new inputs. The decode path (`kernels.moe.moe_block` at
T = 1, 4, 8: router + alignment, gate_up, the down projection with the sum over k) against the
same reference on the torch routing, against the five-launch path (DECODE_FUSED off), and in a
CUDA graph; those tests set DECODE_FUSED themselves (it is on by default). The two-launch
decode path (GATE_UP "gemv": gate_up and down kernels that route each token themselves) with the
layer residual against the reference, the three-launch path and in a CUDA graph. Skipped without
CUDA or triton.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kernels import moe, moe_decode_triton  # noqa: E402

E, K, H, INTER = 128, 8, 2048, 768
TOL = {torch.bfloat16: 2e-2, torch.float32: 2e-3}


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite output"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, device="cuda", generator=g) / H ** 0.5
    w2 = torch.randn(E, H, INTER, device="cuda", generator=g) / INTER ** 0.5
    return w13, w2  # fp32 masters


def routed(t: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, H, device="cuda", generator=g)
    logits = torch.randn(t, E, device="cuda", generator=g)
    w, ids = torch.softmax(logits, dim=-1).topk(K, dim=-1)
    return x, w / w.sum(-1, keepdim=True), ids


def test_dispatcher_picks_triton_on_cuda():
    assert moe.fused_moe_triton is not None


@pytest.mark.parametrize("t", [1, 16, 256])
def test_triton_matches_reference_bf16(weights, t):
    w13, w2 = weights
    x, w, ids = routed(t, seed=t)
    truth = moe.fused_moe_ref(x, w13, w2, w, ids)
    args = (x.bfloat16(), w13.bfloat16(), w2.bfloat16(), w, ids)
    got = moe.fused_moe(*args)
    assert got.dtype == torch.bfloat16 and got.shape == (t, H)
    assert rel(got, truth) < TOL[torch.bfloat16]
    # the bf16 reference rounds at the same points: the two agree more closely still
    assert rel(got, moe.fused_moe_ref(*args)) < 1e-2
    assert torch.equal(moe.fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), w, ids.int()), got)


def test_triton_matches_reference_fp32(weights):
    w13, w2 = weights
    x, w, ids = routed(16, seed=7)
    assert rel(moe.fused_moe(x, w13, w2, w, ids), moe.fused_moe_ref(x, w13, w2, w, ids)) < TOL[torch.float32]


def test_zero_tokens(weights):
    w13, w2 = weights
    x, w, ids = routed(0, seed=1)
    assert moe.fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), w, ids).shape == (0, H)


def test_cuda_graph_capture_and_replay(weights):
    w13, w2 = (w.bfloat16() for w in weights)
    t = 16
    x, w, ids = routed(t, seed=3)
    x = x.bfloat16()
    moe.fused_moe(x, w13, w2, w, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(x, w13, w2, w, ids)
    for seed in (4, 5):
        x2, w_2, ids2 = routed(t, seed=seed)
        x.copy_(x2.bfloat16())
        w.copy_(w_2)
        ids.copy_(ids2)
        graph.replay()
        assert torch.equal(out, moe.fused_moe(x, w13, w2, w, ids))



@pytest.mark.parametrize("t", [1, 4, 8])
def test_decode_block_matches_reference_on_torch_routing(monkeypatch, weights, t):
    w13, w2 = weights
    monkeypatch.setattr(moe, "DECODE_FUSED", True)  # the decode path, whatever the default
    g = torch.Generator(device="cuda").manual_seed(100 + t)
    x = torch.randn(t, H, device="cuda", generator=g)
    # distinct logits, exact in bf16 (multiples of 1/16 below 8): no ties, the same experts
    # whichever dtype routes
    logits = torch.stack([torch.randperm(E, device="cuda", generator=g) for _ in range(t)]).float() / 16
    assert moe_decode_triton.fits(t, E, K)
    w, ids = moe.topk_softmax_ref(logits, K, True)
    truth = moe.fused_moe_ref(x, w13, w2, w, ids)
    xb, w13b, w2b = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    got = moe.moe_block(xb, logits.bfloat16(), w13b, w2b, K, True)
    assert got.dtype == torch.bfloat16 and got.shape == (t, H)
    assert rel(got, truth) < TOL[torch.bfloat16]
    # the five-launch path on the same bf16 logits: equal but for summation order
    monkeypatch.setattr(moe, "DECODE_FUSED", False)
    five = moe.moe_block(xb, logits.bfloat16(), w13b, w2b, K, True)
    monkeypatch.setattr(moe, "DECODE_FUSED", True)
    assert rel(got, five) < 1e-2
    # fp32 operands: the products are fp32 (no tensor cores in the down kernel)
    assert rel(moe.moe_block(x, logits, w13, w2, K, True), truth) < TOL[torch.float32]


def test_decode_block_in_a_cuda_graph(monkeypatch, weights):
    monkeypatch.setattr(moe, "DECODE_FUSED", True)
    w13, w2 = (w.bfloat16() for w in weights)
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(1, H, device="cuda", generator=g).bfloat16()
    logits = torch.randn(1, E, device="cuda", generator=g).bfloat16()
    moe.moe_block(x, logits, w13, w2, K, True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.moe_block(x, logits, w13, w2, K, True)
    for seed in (12, 13):
        g.manual_seed(seed)
        x.copy_(torch.randn(1, H, device="cuda", generator=g))
        logits.copy_(torch.randn(1, E, device="cuda", generator=g))
        graph.replay()
        assert torch.equal(out, moe.moe_block(x, logits, w13, w2, K, True))


@pytest.mark.parametrize("t", [1, 4, 8])
def test_two_launch_decode_path_matches_reference_and_replays_in_a_graph(monkeypatch, weights, t):
    # GATE_UP "gemv": the routed one-row gate_up kernel and the routed down kernel, with the layer
    # residual, against the reference on the torch routing and the three-launch path
    monkeypatch.setattr(moe, "DECODE_FUSED", True)
    w13, w2 = weights
    g = torch.Generator(device="cuda").manual_seed(200 + t)
    x = torch.randn(t, H, device="cuda", generator=g)
    logits = torch.stack([torch.randperm(E, device="cuda", generator=g) for _ in range(t)]).float() / 16
    r = torch.randn(t, H, device="cuda", generator=g).bfloat16()
    truth = moe.fused_moe_ref(x, w13, w2, *moe.topk_softmax_ref(logits, K, True))
    xb, lb, w13b, w2b = x.bfloat16(), logits.bfloat16(), w13.bfloat16(), w2.bfloat16()
    monkeypatch.setattr(moe_decode_triton, "GATE_UP", "grouped")
    three = moe.moe_block(xb, lb, w13b, w2b, K, True, residual=r)
    monkeypatch.setattr(moe_decode_triton, "GATE_UP", "gemv")
    monkeypatch.setattr(moe_decode_triton, "GEMV_MAX_TOKENS", moe_decode_triton.MAX_TOKENS)
    two = moe.moe_block(xb, lb, w13b, w2b, K, True, residual=r)
    assert rel(two.double() - r.double(), truth) < TOL[torch.bfloat16]
    assert rel(two, three) < 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.moe_block(xb, lb, w13b, w2b, K, True, residual=r)
    for seed in (1, 2):
        g.manual_seed(seed)
        xb.copy_(torch.randn(t, H, device="cuda", generator=g))
        lb.copy_(torch.randn(t, E, device="cuda", generator=g))
        graph.replay()
        assert torch.equal(out, moe.moe_block(xb, lb, w13b, w2b, K, True, residual=r))
