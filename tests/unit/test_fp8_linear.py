"""FP8 (e4m3) weights (kernels/fp8_linear.py) and their wiring into `Linear`
(services/worker/layers/fp8.py), on the CPU with the torch references:

- the per-row quantizer within the e4m3 error bound (3 mantissa bits, subnormals in steps of
  2^-9) on awkward shapes with outliers, zero rows and values in the subnormal range;
- the W8A16 and W8A8 references against the float product, within the bound that the
  per-element errors imply (|x| @ err(W).T, plus err(x) @ |Wq|.T for W8A8);
- `Fp8Weight` padding to 16 rows and columns (the `torch._scaled_mm` rule) without changing
  the weight it stands for;
- checkpoint conversions: per-tensor and per-channel kept exactly, block scales dequantized
  block by block and quantized again per row within the bound of those values;
- a stacked `Linear` under MODE "quantize": the fused keyword arguments against `linear_ref`
  on the dequantized weight, the bytes held, a router that stays dense, `dense_weights`;
- the fusion plan leaves quantized (meta-placeholder) projections unfused.
"""

from __future__ import annotations

import pytest
import torch

from kernels import fp8_linear as F
from kernels.linear_ref import linear_ref
from services.worker.fusion import FusionPlan
from services.worker.layers.linear import Linear, held_weight_bytes, quantized_weight_bytes
from services.worker.loader import dense_weights, process_weights_after_loading


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A random [n, k] weight with outliers (what per-row scales absorb) and a row of tiny
    values (e4m3's subnormal range after scaling by another row's scale: none, each row has
    its own scale, so tiny values only arise inside a row with an outlier)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w.view(-1)[torch.randint(0, n * k, (max(1, n * k // 53),), generator=g)] *= 40.0
    return w


def _bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The e4m3 error bound of each element of w [N, K] at row scales [N]."""
    return torch.maximum(w.abs() * F.FP8_REL_ERR, scale[:, None] * F.FP8_SUBNORMAL_ERR) * (1 + 1e-6)


@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (33, 100), (64, 576), (3, 40), (17, 2048)])
def test_row_quantization_within_the_e4m3_bound(shape):
    w = _weights(*shape)
    w[0] = 0.0  # an all-zero row: scale 1, exact zeros
    if shape[1] > 2:
        w[-1, 0], w[-1, 1] = 1000.0, 1e-4  # a value far below the row's scale: subnormal or zero
    q, scale = F.quantize_fp8_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (shape[0],)
    deq = F.dequantize_fp8_rows(q, scale)
    assert torch.all((deq - w).abs() <= _bound(w, scale))
    assert scale[0] == 1 and deq[0].abs().max() == 0
    amax = w.abs().amax(1)
    rows = amax > 0
    assert torch.allclose(scale[rows], amax[rows] / 448)
    # the largest entry of each row is exact (448 is an e4m3 value)
    idx = w.abs().argmax(1)
    assert torch.allclose(deq.gather(1, idx[:, None]), w.gather(1, idx[:, None]), rtol=1e-6)
    assert bool(torch.isfinite(q.float()).all()) and float(q.float().abs().max()) <= 448


@pytest.mark.parametrize("m", [1, 5, 33])
def test_references_within_the_error_the_elements_imply(m):
    n, k = 40, 100
    w = _weights(n, k, seed=1)
    q, s = F.quantize_fp8_rows(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    b = torch.randn(n)
    exact = x.double() @ w.double().t() + b.double()
    ew = _bound(w, s).double()
    y = F.fp8_linear_ref(x, q, s, b)
    assert y.shape == (m, n) and y.dtype == torch.float32
    tol = x.double().abs() @ ew.t() + 1e-4
    assert torch.all((y.double() - exact).abs() <= tol)
    # W8A8: the activations' own rounding on top, err(x) @ |Wq|.T
    xq, sx = F.quantize_fp8_rows(x)
    ex = _bound(x, sx).double()
    wq = F.dequantize_fp8_rows(q, s).double()
    y8 = F.fp8_linear_w8a8_ref(x, q, s, b)
    assert torch.all((y8.double() - exact).abs() <= tol + ex @ wq.abs().t())
    # and the W8A8 product is not the W8A16 one (the activation rounding shows)
    assert not torch.equal(y8, y)
    assert F.fp8_linear_ref(x.to(torch.bfloat16), q, s).dtype == torch.bfloat16


def test_fp8_weight_pads_to_16_and_stands_for_the_same_weight():
    w = _weights(37, 100, seed=2)
    fw = F.Fp8Weight.quantize(w)
    assert fw.qweight.shape == (48, 112) and fw.scale.shape == (48,) and fw.qweight.is_contiguous()
    assert fw.qweight[37:].float().abs().max() == 0 and fw.qweight[:, 100:].float().abs().max() == 0
    assert torch.equal(fw.scale[37:], torch.ones(11))
    q, s = F.quantize_fp8_rows(w)
    assert torch.equal(fw.dequantize(), F.dequantize_fp8_rows(q, s))
    assert fw.nbytes == 48 * 112 + 48 * 4
    x = torch.randn(3, 100)
    assert torch.equal(fw.matmul(x), F.fp8_linear_ref(x, q, s))
    with pytest.raises(ValueError, match="does not fit"):
        fw.matmul(torch.randn(3, 112))
    aligned = F.Fp8Weight.quantize(_weights(32, 64))
    assert aligned.qweight.shape == (32, 64)
    with pytest.raises(ValueError, match="Fp8Weight"):
        F.Fp8Weight.from_rows(torch.zeros(4, 8), torch.ones(4))


def test_checkpoint_rows_keep_tensor_and_channel_scales_exactly():
    w = _weights(24, 40, seed=3)
    q, s = F.quantize_fp8_rows(w)
    q2, s2 = F.checkpoint_rows(q, s[:, None])  # compressed-tensors "channel": [N, 1]
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    amax = w.abs().max()
    qt = (w / (amax / 448)).to(torch.float8_e4m3fn)  # "tensor": one scale for the matrix
    for one in ((amax / 448).reshape(1), (amax / 448).reshape(()), (amax / 448).reshape(1, 1).bfloat16()):
        q3, s3 = F.checkpoint_rows(qt, one)
        assert torch.equal(q3.view(torch.uint8), qt.view(torch.uint8))
        assert torch.equal(s3, one.float().reshape(1).expand(24))
    with pytest.raises(ValueError, match="neither per tensor"):
        F.checkpoint_rows(q, torch.ones(5))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        F.checkpoint_rows(w, s)


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((64, 64), (128, 128)), ((50, 70), (16, 32))])
def test_block_scales_dequantize_by_block_and_convert_to_rows_within_the_bound(shape, block):
    n, k = shape
    bn, bk = block
    w = _weights(n, k, seed=4)
    sb = torch.rand(-(-n // bn), -(-k // bk)) * 0.01 + 1e-3  # one scale per block (weight_scale_inv)
    full = sb.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    values = q.float() * full  # what the checkpoint means, computed the plain way
    assert torch.equal(F.dequantize_checkpoint(q, sb, block), values)
    q2, s2 = F.checkpoint_rows(q, sb, block)
    assert q2.shape == (n, k) and s2.shape == (n,)
    assert torch.all((F.dequantize_fp8_rows(q2, s2) - values).abs() <= _bound(values, s2))


def test_stacked_linear_quantized_at_load_with_fused_arguments(monkeypatch):
    monkeypatch.setattr(F, "MODE", "quantize")
    k = 72  # not a multiple of 16: the weight is padded
    qkv = Linear(k, [48, 16, 16])
    w = _weights(80, k, seed=5)
    qkv.weight.data.copy_(w)
    process_weights_after_loading(qkv)
    assert isinstance(qkv.qweight, F.Fp8Weight) and qkv.fp8_layer
    assert qkv.weight.device.type == "meta" and qkv.weight.shape == (80, k) and qkv.weight.shard_sizes == [48, 16, 16]
    deq = qkv.qweight.dequantize()
    q, s = F.quantize_fp8_rows(w)
    assert torch.equal(deq, F.dequantize_fp8_rows(q, s))
    x, nw, res = torch.randn(5, k), torch.rand(k) + 0.5, torch.randn(5, 80)
    from kernels.norm import rms_norm
    close = lambda y, ref: torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)  # noqa: E731
    close(qkv(x), linear_ref(x, deq))
    close(qkv(x, norm_weight=nw, eps=1e-5), linear_ref(rms_norm(x, nw, 1e-5), deq))
    close(qkv(x, residual=res.clone()), linear_ref(x, deq) + res)
    down = Linear(32, 24, bias=True)
    down.weight.data.copy_(_weights(24, 32, seed=6))
    down.bias.data.copy_(torch.randn(24))
    process_weights_after_loading(down)
    from kernels.activation import silu_and_mul
    xs = torch.randn(3, 64)
    close(down(xs, silu_mul=True), linear_ref(silu_and_mul(xs), down.qweight.dequantize(), down.bias))
    assert held_weight_bytes(qkv) == quantized_weight_bytes(qkv) == qkv.qweight.nbytes < 80 * k * 4 / 3
    process_weights_after_loading(qkv)  # a second pass changes nothing
    assert torch.equal(qkv.qweight.dequantize(), deq)


def test_router_stays_dense_and_dense_weights_quantize_again(monkeypatch):
    monkeypatch.setattr(F, "MODE", "quantize")
    router = Linear(32, 8, quantizable=False)
    router.weight.data.copy_(_weights(8, 32))
    process_weights_after_loading(router)
    assert router.qweight is None and router.weight.device.type == "cpu"
    lin = Linear(64, [32, 32])
    w = _weights(64, 64, seed=7)
    lin.weight.data.copy_(w)
    process_weights_after_loading(lin)
    old = lin.qweight.dequantize()
    monkeypatch.setattr(F, "MODE", "checkpoint")  # a layer fp8 before dense_weights stays fp8 in any mode
    with torch.no_grad(), dense_weights(lin):
        assert lin.qweight is None and lin.weight.device.type == "cpu"
        assert torch.equal(lin.weight.data, old)
        lin.weight.data[:32] *= 2.0
    assert isinstance(lin.qweight, F.Fp8Weight)
    new = lin.qweight.dequantize()
    assert torch.all((new[:32] - 2 * old[:32]).abs() <= _bound(2 * old[:32], lin.qweight.scale[:32]))
    assert torch.equal(new[32:], old[32:])  # requantizing e4m3 values with their own scale: exact


def test_fusion_plan_leaves_meta_placeholders_unfused():
    meta = torch.empty(64, 32, dtype=torch.bfloat16, device="meta")
    plan = FusionPlan.choose([meta], torch.device("cuda"), torch.bfloat16)
    assert plan.rows == frozenset() and not plan.fused(1)


def test_fusion_plan_fuses_one_row_of_fp8_weights_only_where_their_kernel_fuses(monkeypatch):
    """FP8 projections (their `Fp8Weight`s, as llama's fusable_projections gives them) take the
    fused path at one row on CUDA in bf16 / fp16 with the gemv-based one-row kernel, never at
    2+ rows, on the CPU, with the legacy kernel, with fusion.FUSE_QUANTIZED_ONE_ROW off, or
    beside a weight whose kernel does not fuse (W4A16)."""
    from kernels import fp8_gemv
    from kernels.w4a16_linear import W4Weight

    pytest.importorskip("triton")
    cuda = torch.device("cuda")
    from services.worker import fusion

    fws = [F.Fp8Weight.quantize(_weights(n, k, seed=n)) for n, k in ((48, 32), (32, 16), (64, 32), (32, 32))]
    monkeypatch.setattr(fusion, "FUSE_QUANTIZED_ONE_ROW", False)  # the default (measured no faster)
    assert not FusionPlan.choose(fws, cuda, torch.bfloat16).fused(1)
    monkeypatch.setattr(fusion, "FUSE_QUANTIZED_ONE_ROW", True)
    plan = FusionPlan.choose(fws, cuda, torch.bfloat16, small_batches=True)
    assert plan.rows == frozenset({1}) and plan.fused(1) and not plan.fused(2)
    assert FusionPlan.choose(fws, cuda, torch.float16).fused(1)
    assert not FusionPlan.choose(fws, cuda, torch.float32).fused(1)
    assert not FusionPlan.choose(fws, torch.device("cpu"), torch.bfloat16).fused(1)
    assert not FusionPlan.choose(fws, cuda, torch.bfloat16, quantized=False).fused(1)
    assert not FusionPlan.choose(fws, cuda, torch.bfloat16, one_row=False).fused(1)
    w4 = W4Weight.quantize(_weights(32, 128, seed=3), 32)
    assert not FusionPlan.choose(fws + [w4], cuda, torch.bfloat16).fused(1)
    monkeypatch.setattr(fp8_gemv, "ONE_ROW", "legacy")
    assert not FusionPlan.choose(fws, cuda, torch.bfloat16).fused(1)


def test_fp8_fused_steps_on_the_cpu_follow_the_fused_reference():
    """`fp8_linear` with the fused keywords off the one-row kernel (CPU tensors): the ops
    apart, as `fp8_linear_fused_ref` orders them (the reference on the CPU: equal)."""
    fw = F.Fp8Weight.quantize(_weights(24, 40, seed=5))
    q, s = fw.qweight[:24, :40], fw.scale[:24]
    g = torch.Generator().manual_seed(2)
    x, x2 = torch.randn(3, 40, generator=g), torch.randn(3, 80, generator=g)
    nw, r, b = torch.rand(40, generator=g) + 0.5, torch.randn(3, 24, generator=g), torch.randn(24, generator=g)
    for fused, xi in (({"norm_weight": nw, "eps": 1e-5}, x), ({"silu_mul": True, "residual": r}, x2),
                      ({"residual": r}, x)):
        assert torch.allclose(F.fp8_linear(xi, fw, b, **fused), F.fp8_linear_fused_ref(xi, q, s, b, **fused),
                              rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m", [1, 7, 300])
@pytest.mark.parametrize("n,k", [(37, 100), (48, 80), (16, 32)])
def test_scaled_mm_wrapper_on_the_cpu_build_of_scaled_mm(m, n, k):
    """`scaled_mm_linear`'s own work (x quantized and padded to W's K', the padding columns
    of the output dropped, the bias, the dtype) through torch's CPU `_scaled_mm`, against the
    W8A8 reference; the CUDA kernel behind it is tests/gpu/test_fp8_linear_gpu.py's."""
    fw = F.Fp8Weight.quantize(_weights(n, k, seed=8))
    q, s = fw.qweight[:n, :k], fw.scale[:n]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    b = torch.randn(n).bfloat16()
    y = F.scaled_mm_linear(x, fw, b)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16 and y.is_contiguous()
    ref = F.fp8_linear_w8a8_ref(x.float(), q, s, b.float())
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2
    y32 = F.scaled_mm_linear(x.float(), fw)
    assert y32.dtype == torch.float32
    assert float((y32 - F.fp8_linear_w8a8_ref(x.float(), q, s)).norm() / ref.norm()) < 1e-2
