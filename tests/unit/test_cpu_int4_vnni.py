"""The CPU int4 x int8 VNNI kernel (kernels/cpu_int4_vnni.py, kernels/csrc/int4_vnni.cpp): its
format against the quantizer's weights, its Q8 of x against the pure-torch twin, its product
against a float64 truth of the dequantized weight times the int8-quantized x (tight) and against
the exact product with x unquantized (the Q8 bound), awkward shapes, the wiring into
`QuantWeight.matmul` / `Linear` and `pack_int4` (GGUF groups), and the fallback when the
extension is unavailable."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kernels import cpu_ext
from kernels import cpu_int4_vnni as vnni
from kernels import cpu_quant_linear as cq

needs_vnni = pytest.mark.skipif(not vnni.cpu_supported(),
                                reason="the CPU lacks AVX-512 F/BW/VL + AVX512_VNNI + F16C (the kernel's ISA)")
FP16_REL = 2.0 ** -11  # fp16's relative rounding (round to nearest, 10 stored mantissa bits)


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w.view(-1)[torch.randint(0, n * k, (max(1, n * k // 97),), generator=g)] *= 12.0  # outliers
    return w


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, ::37] *= 8.0  # a few large channels, as LLM hidden states have
    return x


@pytest.fixture(scope="module")
def ext():
    if not vnni.available():
        pytest.skip("the int4 VNNI extension did not build here (see the logged warning)")
    return vnni.extension()


def test_pack_holds_the_quantizers_weight_within_fp16_scales():
    """dequantize(pack(q, scale, zero)) is (q - 8) scale + zero within the fp16 rounding of
    s = scale and m = zero - 8 scale: |dw| <= (15 |s| + |m|) 2^-11 (+ fp32 rounding); N not a
    multiple of 16 and a group of 64 (its (s, m) repeated per 32 columns) included."""
    for n, k, g in [(7, 64, 32), (40, 96, 32), (17, 128, 64)]:
        q, scale, zero = cq.quantize_int4(_weights(n, k, seed=n), g)
        p = vnni.pack(q, scale, zero)
        assert p.shape == (-(-n // 16), k // 32, 320) and p.dtype == torch.uint8
        want = cq.dequantize_int4(q, scale, zero)
        m = (zero - 8 * scale).repeat_interleave(g // 32, dim=1)
        s = scale.repeat_interleave(g // 32, dim=1)
        bound = ((15 * s.abs() + m.abs()) * FP16_REL + 1e-7).repeat_interleave(32, dim=1)
        err = (vnni.dequantize(p, n, k) - want).abs()
        assert torch.all(err <= bound), float((err - bound).max())
    with pytest.raises(ValueError, match="multiples of 32"):
        vnni.pack(torch.zeros(4, 48, dtype=torch.int32), torch.ones(4, 3), torch.zeros(4, 3))
    with pytest.raises(ValueError, match="fp16"):
        vnni.pack(torch.zeros(4, 32, dtype=torch.int32), torch.full((4, 1), 1e5), torch.zeros(4, 1))


@needs_vnni
@pytest.mark.parametrize("planes", [1, 2])
def test_the_kernels_q8_of_x_is_the_torch_twins(ext, planes):
    for m, k in [(1, 576), (3, 40), (5, 100), (16, 1536)]:
        x = _x(m, k, seed=k)
        x[0, :32] = 0.0  # an all-zero group: dx 0, codes 0
        ng = -(-k // 32)
        got, want = vnni.quantize_x(x, ng, planes), vnni.quantize_x_ref(x, ng, planes)
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1], want[1]) and torch.allclose(got[2], want[2], rtol=1e-6, atol=0)
        # |x - x_hat| <= half the last plane's step, amax / 254 or / 254^2, + the fp32 rounding of
        # 127 / amax, v = x * that, d and d / 254 (each 2^-24 relative: < 2^-21 amax in all)
        err = (vnni.dequantize_x(*got[:2], k) - x.double()).abs()
        amax = torch.nn.functional.pad(x.abs(), (0, ng * 32 - k)).reshape(m, ng, 32).amax(2).double()
        bound = amax / (254 if planes == 1 else 254 * 254) + 2.0 ** -21 * amax
        assert torch.all(err <= bound.repeat_interleave(32, dim=1)[:, :k])


SHAPES = [(1, 960, 576), (3, 40, 96), (5, 576, 1536), (16, 17, 32), (1, 7, 40), (4, 33, 100), (2, 3072, 576)]


@needs_vnni
@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_kernel_matches_the_float64_truth_and_the_q8_bound(ext, m, n, k, planes):
    """mm against (1) mm_ref: float64 x_hat @ dequantize(packed).T, x_hat the quantized x,
    within fp32 accumulation, 2^-20 of sum |w| |x_hat| per output; (2) the exact x @ W.T with x
    unquantized: within the bound sum_g e_g sum_{k in g} |w[n, k]|, e_g = max_g |x| / 254 (one
    plane) or / 254^2 (two; round to nearest: half a step), and for these seeded inputs at
    least 2x under it in the worst output (it is a worst case: the rounding errors of a group's
    32 columns do not all take the sign of their weights; measured max 0.36 of the bound at
    K = 32..100, 0.14-0.22 at K = 576..1536, one plane)."""
    kp = -(-k // 32) * 32
    w = torch.nn.functional.pad(_weights(n, k, seed=m + n), (0, kp - k))
    p = vnni.pack(*cq.quantize_int4(w, 32))
    wd = vnni.dequantize(p, n, k).double()
    x = _x(m, k, seed=n)
    y = vnni.mm(x, p, n, planes)
    assert y.shape == (m, n) and y.dtype == torch.float32
    qx, dx, _ = vnni.quantize_x_ref(x, kp // 32, planes)
    scale_sum = vnni.dequantize_x(qx, dx, k).abs() @ wd.abs().t()
    assert torch.all((y.double() - vnni.mm_ref(x, p, n, planes).double()).abs() <= 2.0 ** -20 * scale_sum + 1e-30)
    truth = x.double() @ wd.t()
    wabs = torch.nn.functional.pad(wd.abs(), (0, kp - k)).reshape(n, -1, 32).sum(dim=2)  # [N, NG]
    amax = torch.nn.functional.pad(x.abs(), (0, kp - k)).reshape(m, -1, 32).amax(2).double()
    bound = (amax / (254 if planes == 1 else 254 ** 2)) @ wabs.t() + 2.0 ** -20 * scale_sum
    err = (y.double() - truth).abs()
    assert torch.all(err <= bound), float((err - bound).max())
    assert float((err / bound).max()) < 0.5


@needs_vnni
def test_bf16_and_row_strided_x_and_refused_shapes(ext):
    n, k = 48, 64
    p = vnni.pack(*cq.quantize_int4(_weights(n, k, seed=1), 32))
    xb = _x(3, k, seed=2).to(torch.bfloat16)
    y = vnni.mm(xb, p, n)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, vnni.mm(xb.float(), p, n).to(torch.bfloat16))
    wide = _x(3, 2 * k, seed=3)
    assert torch.equal(vnni.mm(wide[:, :k], p, n), vnni.mm(wide[:, :k].contiguous(), p, n))
    with pytest.raises(RuntimeError, match="columns"):
        vnni.mm(_x(1, k + 32, seed=4), p, n)
    with pytest.raises(RuntimeError, match="n_out"):
        vnni.mm(_x(1, k, seed=4), p, n + 16)


@needs_vnni
def test_quant_weight_holds_one_copy_and_the_switches_pick_the_product(ext, monkeypatch):
    """pack_int4 with INT4_VNNI on makes the VNNI copy alone (nbytes: its bytes; dequantize: its
    weight; matmul == vnni.mm for 1, 5, 16 and 40 rows); INT4_KEEP_TINYGEMM keeps tinygemm's too
    and INT4_VNNI then picks the product per call; off at pack time: tinygemm alone. GGUF groups
    (pack_int4 of Q4_K's groups) get the VNNI copy, the file's weight within fp16 (s, m)."""
    monkeypatch.setattr(cq, "INT4_VNNI", True)
    monkeypatch.setattr(cq, "INT4_KEEP_TINYGEMM", False)
    n, k = 40, 100  # N padded to 48, K to 128
    w = _weights(n, k, seed=5)
    qw = cq.quantize(w, "int4")
    assert qw.vnni is not None and qw.vnni.shape == (3, 4, 320) and qw.packed.numel() == 0
    assert qw.nbytes == qw.vnni.numel() == 3 * 4 * 320
    assert torch.equal(qw.dequantize(), vnni.dequantize(qw.vnni, n, k))
    for m in (1, 5, 16, 40):
        x = _x(m, k, seed=m)
        assert torch.equal(qw.matmul(x), vnni.mm(x, qw.vnni, n))
    monkeypatch.setattr(cq, "INT4_KEEP_TINYGEMM", True)
    both = cq.quantize(w, "int4")
    assert both.vnni is not None and both.packed.numel() > 0
    assert both.nbytes == both.packed.numel() + both.scales.numel() * 2 + both.vnni.numel()
    x = _x(2, k, seed=2)
    assert torch.equal(both.matmul(x), vnni.mm(x, both.vnni, n))
    monkeypatch.setattr(cq, "INT4_VNNI", False)
    tiny = cq.quant_linear_ref(x.to(cq.ACT_DTYPE).float(), both.dequantize())
    assert torch.all((both.matmul(x) - tiny).abs() <= 2.0 ** -7 * tiny.abs().amax(1, keepdim=True) + 1e-4)
    assert qw.vnni is not None and torch.equal(qw.matmul(x), vnni.mm(x, qw.vnni, n))  # its only copy
    assert cq.quantize(w, "int4").vnni is None  # off at pack time: tinygemm alone

    monkeypatch.setattr(cq, "INT4_VNNI", True)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from kernels.gguf_quant import int4_groups
    from tests.gguf_tiny import quantized
    wn = _weights(24, 256, seed=6).numpy().astype(np.float32)
    raw = torch.from_numpy(np.ascontiguousarray(quantized(wn, "Q4_K")))
    truth = torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType.Q4_K))
    q, scale, zero = int4_groups(raw, "Q4_K")
    qg = cq.pack_int4(q, scale, zero)
    assert qg.vnni is not None
    bound = ((15 * scale.abs() + (zero - 8 * scale).abs()) * FP16_REL + 1e-6).repeat_interleave(32, dim=1)
    assert torch.all((vnni.dequantize(qg.vnni, 24, 256) - truth).abs() <= bound)


@needs_vnni
def test_linear_with_fused_arguments_through_the_kernel(ext, monkeypatch):
    """A stacked int4 Linear with the fused norm / residual / silu_mul arguments takes the
    kernel at 5 rows: each equals mm_ref of the input it forms (within the kernel's fp32
    accumulation) plus the residual."""
    from kernels.activation import silu_and_mul
    from kernels.norm import rms_norm
    from services.worker.layers.linear import Linear
    from services.worker.loader import process_weights_after_loading

    monkeypatch.setattr(cq, "QUANTIZATION", "int4")
    monkeypatch.setattr(cq, "INT4_VNNI", True)
    k = 64
    qkv = Linear(k, [48, 16, 16])
    qkv.weight.data.copy_(_weights(80, k, seed=7))
    process_weights_after_loading(qkv)
    assert qkv.qweight is not None and qkv.qweight.vnni is not None
    p = qkv.qweight.vnni
    x, nw, res = _x(5, k, seed=8), torch.rand(k) + 0.5, torch.randn(5, 80)

    def close(y, ref):
        assert torch.all((y - ref).abs() <= 1e-5 * ref.abs().amax(1, keepdim=True) + 1e-6), float((y - ref).abs().max())

    close(qkv(x), vnni.mm_ref(x, p, 80))
    close(qkv(x, norm_weight=nw, eps=1e-5), vnni.mm_ref(rms_norm(x, nw, 1e-5), p, 80))
    close(qkv(x, residual=res.clone()), vnni.mm_ref(x, p, 80) + res)
    xs = _x(3, 2 * k, seed=9)
    up = Linear(k, 24)
    up.weight.data.copy_(_weights(24, k, seed=10))
    process_weights_after_loading(up)
    assert up.qweight is not None and up.qweight.vnni is not None
    close(up(xs, silu_mul=True), vnni.mm_ref(silu_and_mul(xs), up.qweight.vnni, 24))


def test_unavailable_extension_falls_back_to_tinygemm_with_one_warning(monkeypatch, caplog):
    """A CPU without the ISA (or a failed build): available() is False after one warning, int4
    weights get no VNNI copy, and matmul is tinygemm's."""
    monkeypatch.setattr(vnni, "_loader", cpu_ext.Loader(vnni._build))
    monkeypatch.setattr(vnni, "cpu_supported", lambda: False)
    monkeypatch.setattr(cq, "INT4_VNNI", True)
    with caplog.at_level(logging.WARNING, logger=vnni.__name__):
        assert not vnni.available() and not vnni.available()
        qw = cq.quantize(_weights(32, 64, seed=11), "int4")
    assert len([r for r in caplog.records if "VNNI kernel off" in r.getMessage()]) == 1
    assert qw.vnni is None
    x = _x(1, 64, seed=12)
    tiny = cq.quant_linear_ref(x.to(cq.ACT_DTYPE).float(), qw.dequantize())
    assert torch.all((qw.matmul(x) - tiny).abs() <= 2.0 ** -7 * tiny.abs().amax(1, keepdim=True) + 1e-4)


def test_a_failed_build_falls_back_with_one_warning(monkeypatch, caplog):
    """The build raising (no compiler, no ninja, a compile error) is a warning, not an error."""
    from torch.utils import cpp_extension

    def broken(**kw):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(vnni, "_loader", cpu_ext.Loader(vnni._build))
    monkeypatch.setattr(vnni, "cpu_supported", lambda: True)
    monkeypatch.setattr(cpp_extension, "load", broken)
    with caplog.at_level(logging.WARNING, logger=vnni.__name__):
        assert not vnni.available()
    msgs = [r.getMessage() for r in caplog.records if "VNNI kernel off" in r.getMessage()]
    assert len(msgs) == 1 and "Ninja is required" in msgs[0]
