"""The AWQ / GPTQ 4-bit layouts (kernels/w4a16_formats.py), `W4Weight` and the torch reference
product (kernels/w4a16_linear.py), against independent per-element math: each value read
from its int32 word with Python integers exactly as the published packers write it (AutoAWQ
`WQLinear_GEMM.from_linear`: nibble i of word c holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i];
AutoGPTQ `pack`: qweight row 8r + j in nibble j, qzeros natural order, stored z - 1), and the
config parse and its refusals (shared/weight_quant.py)."""

from __future__ import annotations

import pytest
import torch

from kernels import w4a16_formats as fmt
from kernels.w4a16_linear import W4Weight, w4a16_linear, w4a16_linear_ref
from shared.weight_quant import check_w4a16_setting, parse_quantization_config, w4a16_in_use

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _words(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2 ** 31, 2 ** 31 - 1, shape, dtype=torch.int32, generator=g)


def _nib(word: int, i: int) -> int:
    return ((word & 0xFFFFFFFF) >> (4 * i)) & 0xF


def _awq_elem(p: torch.Tensor, r: int, n: int) -> int:
    """Column n of row r of an AWQ-packed tensor: the nibble i with AWQ_PACK_ORDER[i] == n % 8."""
    return _nib(int(p[r, n // 8]), AWQ_PACK_ORDER.index(n % 8))


def test_awq_unpack_matches_per_element_math():
    p = _words(5, 3)
    q = fmt.unpack_cols(p, fmt.AWQ_ORDER)
    want = torch.tensor([[_awq_elem(p, r, n) for n in range(24)] for r in range(5)])
    assert torch.equal(q, want)
    assert torch.equal(fmt.pack_cols(q, fmt.AWQ_ORDER), p)


def test_gptq_unpack_matches_per_element_math():
    p = _words(3, 10, seed=1)
    q = fmt.unpack_rows(p)
    want = torch.tensor([[_nib(int(p[k // 8, n]), k % 8) for n in range(10)] for k in range(24)])
    assert torch.equal(q, want)
    assert torch.equal(fmt.pack_rows(q), p)


def test_checkpoint_tensors_dequantize_as_the_formats_define():
    k, n, g = 64, 16, 32
    qw_awq, qz, sc = _words(k, n // 8, seed=2), _words(k // g, n // 8, seed=3), torch.rand(k // g, n).half()
    w = W4Weight.from_awq(qw_awq, qz, sc).dequantize()
    want = torch.tensor([[(_awq_elem(qw_awq, kk, nn) - _awq_elem(qz, kk // g, nn)) * float(sc[kk // g, nn])
                          for kk in range(k)] for nn in range(n)])
    assert torch.allclose(w, want, rtol=0, atol=1e-6)
    qw_gptq = _words(k // 8, n, seed=4)
    w = W4Weight.from_gptq(qw_gptq, qz, sc).dequantize()
    want = torch.tensor([[(_nib(int(qw_gptq[kk // 8, nn]), kk % 8) - (_nib(int(qz[kk // g, nn // 8]), nn % 8) + 1))
                          * float(sc[kk // g, nn]) for kk in range(k)] for nn in range(n)])
    assert torch.allclose(w, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("layout,sym", [("awq", False), ("gptq", False), ("gptq", True)])
@pytest.mark.parametrize("g", [32, 128])
def test_quantizer_round_trip_is_within_half_a_step(layout, sym, g):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(48, 256, generator=gen)
    q, z, s = fmt.quantize_groups(w, g, sym=sym)
    t = fmt.to_awq(q, z, s) if layout == "awq" else fmt.to_gptq(q, z, s)
    ww = (W4Weight.from_awq(t["qweight"], t["qzeros"], t["scales"]) if layout == "awq" else
          W4Weight.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"]))
    assert ww.group_size == g and (ww.out_features, ww.in_features) == (48, 256)
    assert torch.equal(ww.dequantize(), fmt.dequantize_groups(q, z, s))
    step = s.float().repeat_interleave(g, 0).t()
    err = (ww.dequantize() - w).abs()
    # asymmetric: within half a step (+ the fp16 scale's rounding over 15 steps); symmetric
    # clamps the top value (+amax maps to 8 + 7.5 -> 15): up to one step there
    bound = step * (1.0 if sym else 0.5) + step * 15 * 2 ** -11 + 1e-6
    assert bool((err <= bound).all()), float((err - bound).max())


def test_both_formats_land_in_the_same_layout():
    gen = torch.Generator().manual_seed(6)
    q, z, s = fmt.quantize_groups(torch.randn(24, 64, generator=gen), 32)
    z = z.clamp_min(1)  # GPTQ v1 cannot store a zero point of 0 (it wraps to 16)
    a, b = fmt.to_awq(q, z, s), fmt.to_gptq(q, z, s)
    wa = W4Weight.from_awq(a["qweight"], a["qzeros"], a["scales"])
    wb = W4Weight.from_gptq(b["qweight"], b["qzeros"], b["scales"], b["g_idx"])
    for f in ("qweight", "zeros", "scales"):
        assert torch.equal(getattr(wa, f), getattr(wb, f)), f


def test_gptq_v1_zero_of_zero_wraps_to_sixteen():
    z = torch.zeros(1, 8, dtype=torch.int64)
    stored = fmt.to_gptq(torch.zeros(8, 8, dtype=torch.int64), z, torch.ones(1, 8).half())["qzeros"]
    assert _nib(int(stored[0, 0]), 0) == 15
    assert int(fmt.from_gptq(fmt.pack_rows(torch.zeros(8, 8, dtype=torch.int64)), stored,
                             torch.ones(1, 8).half())[1][0, 0]) == 16


def test_act_order_g_idx_is_refused():
    q, z, s = fmt.quantize_groups(torch.randn(8, 64), 32)
    t = fmt.to_gptq(q, z, s)
    with pytest.raises(ValueError, match="desc_act"):
        W4Weight.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"].flip(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_product_is_the_dequantized_float_product(dtype):
    gen = torch.Generator().manual_seed(7)
    w = W4Weight.quantize(torch.randn(40, 128, generator=gen), 64)
    x = torch.randn(5, 128, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen)
    want = (x.double() @ w.dequantize().double().t() + bias.double())
    got = w4a16_linear(x, w, bias.to(dtype))
    assert got.dtype == dtype and torch.allclose(got.double(), want, rtol=2e-2 if dtype != torch.float32 else 1e-5,
                                                 atol=2e-2 if dtype != torch.float32 else 1e-5)
    assert torch.equal(w4a16_linear_ref(x, w), w.matmul(x))


def test_cat_stacks_shards_along_n():
    gen = torch.Generator().manual_seed(8)
    parts = [torch.randn(n, 64, generator=gen) for n in (16, 8, 8)]
    ws = W4Weight.cat([W4Weight.quantize(p, 32) for p in parts])
    assert torch.equal(ws.dequantize(), torch.cat([W4Weight.quantize(p, 32).dequantize() for p in parts]))


AWQ_CFG = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
           "modules_to_not_convert": None}
GPTQ_CFG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
            "damp_percent": 0.01, "true_sequential": True, "checkpoint_format": "gptq", "static_groups": False}


def test_awq_and_gptq_configs_parse():
    a = parse_quantization_config(AWQ_CFG)
    assert a is not None and a.is_w4 and (a.method, a.bits, a.group_size, a.sym) == ("awq", 4, 128, False)
    b = parse_quantization_config(GPTQ_CFG)
    assert b is not None and b.is_w4 and (b.method, b.group_size, b.sym) == ("gptq", 128, True)
    assert "gptq 4-bit (group 128, symmetric)" == b.describe()


@pytest.mark.parametrize("edit,match", [
    ({**AWQ_CFG, "bits": 8}, "bits 8"), ({**AWQ_CFG, "version": "gemv"}, "version 'gemv'"),
    ({**AWQ_CFG, "zero_point": False}, "zero_point"), ({**AWQ_CFG, "group_size": 100}, "group_size 100"),
    ({**GPTQ_CFG, "desc_act": True}, "desc_act"), ({**GPTQ_CFG, "checkpoint_format": "gptq_v2"}, "gptq_v2"),
    ({**GPTQ_CFG, "checkpoint_format": "marlin"}, "marlin")])
def test_unsupported_4bit_configs_are_refused_by_name(edit, match):
    with pytest.raises(ValueError, match=match):
        parse_quantization_config(edit)


def test_w4a16_settings_refused_where_they_cannot_run():
    awq = parse_quantization_config(AWQ_CFG)
    with pytest.raises(ValueError, match="CUDA only.*--quantization none"):
        check_w4a16_setting("awq", "cpu", "float32", awq, dummy=False)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        check_w4a16_setting("gptq", "cuda", "float32", None, dummy=True)
    with pytest.raises(ValueError, match="needs a checkpoint quantized with gptq.*awq checkpoint"):
        check_w4a16_setting("gptq", "cuda", "bfloat16", awq, dummy=False)
    with pytest.raises(ValueError, match="does not quantize to 4 bits"):
        check_w4a16_setting("awq", "cuda", "bfloat16", None, dummy=False)
    with pytest.raises(ValueError, match="'fp8' on a awq"):
        check_w4a16_setting("fp8", "cuda", "bfloat16", awq, dummy=False)
    check_w4a16_setting("awq", "cuda", "bfloat16", None, dummy=True)
    check_w4a16_setting("none", "cpu", "float32", awq, dummy=False)  # dequantized at load
    assert w4a16_in_use("none", awq, "cuda", "bfloat16", False)
    assert not w4a16_in_use("none", awq, "cpu", "float32", False)
    assert not w4a16_in_use("none", None, "cuda", "bfloat16", False)
    assert w4a16_in_use("awq", None, "cuda", "float16", True)
