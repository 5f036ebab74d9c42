"""The Triton kernels of the fp8_e4m3 KV cache (kernels/kv_quant_triton.py and the store,
rotary, decode, prefill, multi-query and fused rotary-decode kernels that use it) against the
torch references of kernels/kv_quant.py and kernels/attention.py, under the Triton
interpreter on CPU tensors (no GPU needed).

The checks run in one subprocess (`kv_fp8_interp_checks.py`, whose docstring says what each
compares) with TRITON_INTERPRET=1 set before triton is imported. Readers: relative norm error
against `paged_attention_ref` on reference-quantized caches with scales != 1, tolerances as
tests/unit/test_kernels_triton_interp.py (fp32 1e-5: summation order and the scales folded
out of the loops; fp16 3e-3: the fp16 rounding of the probabilities before the P@V dot;
measured ~2e-7 and ~3e-4). Writers: against the reference's pre-cast values put through the
interpreter's own fp32 -> e4m3 cast (triton 3.9's rounds wrongly at binade edges, 31.7 ->
16.0): the store kernel byte for byte, the rotary writers within 1e-2 of their dequantized
values (measured 0: a rotation rounding that crosses an e4m3 edge moves one value by one step,
1/16 of it). The e4m3 rounding itself is checked against `quantize_fp8` here only when the
interpreter's cast is right, and always on the GPU (tests/gpu/test_fp8_kv_gpu.py).
The decode kernels (split-K decode, fused rotary decode) run in each of their fp8 dot formats
(`kernels.kv_quant_triton.FP8_DOTS`) and with their fp8 defaults: "q" in q's dtype (fp32 1e-5,
fp16 3e-3 as above), "fp16" / "fp16_bits" / "fp16_words" / "fp16_vwords" with q in fp16 by a power-of-two scale and fp16
probabilities (3e-3 for fp32 and fp16 q, measured ~1e-4..3e-4; bf16 q 2e-2, the GPU tests'
bound: the interpreter's bf16 output rounding, measured ~3e-3, ~1e-2 for the rotary decode
whose q the interpreter rotates in bf16). The integer widening is checked exactly on all 256
codes, the word widening (uint32 words, its column order `word_order`) against it on every code
at every byte position, and the q scaling at magnitudes 1e-30..1e30. Every variant of the
benchmark's --variants sweep (benchmarks/kv_quant_attention.py) runs on both decode kernels with
bf16 q (2e-2).
Skipped when triton is not installed.
"""

from __future__ import annotations

import pytest

from tests.interp_runner import run_interp_checks

pytest.importorskip("triton")

TOL = {"float32": 1e-5, "float16": 3e-3}
TOL_FP16_DOTS = {"float32": 3e-3, "float16": 3e-3, "bfloat16": 2e-2}  # the decode kernels' fp16 dot formats
READERS = ["attn_prefill_varlen_prefix", "attn_mixed_prefill_decode", "attn_multi_query_verify",
           "attn_multi_query_one_split"]
DECODE_READERS = ["attn_decode_gqa_splitk", "attn_decode_one_split", "attn_decode_prefetch",
                  "attn_decode_graph_bound_hd24", "attn_decode_long_tiles", "attn_decode_odd_hd18", "rope_decode_attn"]
DOTS = ["q", "fp16", "fp16_bits", "fp16_words", "fp16_vwords", "default"]  # FP8_DOTS and the fp8 defaults


@pytest.fixture(scope="module")
def interp_results() -> dict[str, float]:
    return run_interp_checks("tests/unit/kv_fp8_interp_checks.py")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kernel", READERS)
def test_fp8_kv_attention_kernel_matches_the_dequantizing_reference_under_interpreter(interp_results, kernel,
                                                                                       dtype):
    err = interp_results[f"{kernel}_{dtype}"]
    assert err <= TOL[dtype], f"{kernel} {dtype}: relative error {err}"


@pytest.mark.parametrize("dot", DOTS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kernel", DECODE_READERS)
def test_fp8_kv_decode_kernels_match_the_dequantizing_reference_in_every_dot_format(interp_results, kernel, dtype,
                                                                                    dot):
    if dtype == "bfloat16" and dot == "q":
        pytest.skip("bf16 dots: the interpreter's tl.dot on bf16 gives garbage (checked on the GPU)")
    err = interp_results[f"{kernel}_{dtype}_{dot}"]
    tol = TOL[dtype] if dot == "q" else TOL_FP16_DOTS[dtype]
    assert err <= tol, f"{kernel} {dtype} {dot}: relative error {err}"


@pytest.mark.parametrize("dot", DOTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_kv_decode_with_q_beyond_fp16_range_stays_finite_and_matches(interp_results, dtype, dot):
    if dtype == "bfloat16" and dot == "q":
        pytest.skip("bf16 dots: the interpreter's tl.dot on bf16 gives garbage (checked on the GPU)")
    err = interp_results[f"attn_decode_q_beyond_fp16_{dtype}_{dot}"]
    assert err <= (TOL[dtype] if dot == "q" else TOL_FP16_DOTS[dtype]), err


@pytest.mark.parametrize("dot", DOTS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fp8_kv_fused_rotary_decode_stores_the_quantized_token_in_every_dot_format(interp_results, dtype, dot):
    assert interp_results[f"rope_decode_write_{dtype}_{dot}"] <= 1e-2


def test_integer_widening_gives_every_finite_e4m3_code_exactly_times_two_to_minus_eight(interp_results):
    assert interp_results["bits_codes"] == 0.0


def test_word_widening_gives_the_integer_widenings_bits_for_every_code_at_every_byte_position(interp_results):
    assert interp_results["words_codes"] == 0.0


def _sweep_names() -> list[str]:
    from benchmarks.kv_quant_attention import fp8_variants

    return [f"{k}_{n}" for k in ("decode_kernel", "rope_decode_kernel") for n in fp8_variants(k)]


@pytest.mark.parametrize("name", _sweep_names())
def test_every_benchmarked_fp8_variant_matches_the_dequantizing_reference(interp_results, name):
    err = interp_results[f"variant_{name}"]
    assert err <= TOL_FP16_DOTS["bfloat16"], f"{name}: relative error {err}"


def test_every_dot_format_is_checked():
    from kernels.kv_quant_triton import FP8_DOTS

    assert sorted(FP8_DOTS) == sorted(d for d in DOTS if d != "default")


@pytest.mark.parametrize("mag", ["1e-30", "0.001", "1", "30000", "1e+30"])
def test_q_scaling_into_fp16_is_exact_to_fp16_rounding_at_any_magnitude(interp_results, mag):
    assert interp_results[f"q_scale_{mag}"] <= 2 ** -11  # fp16's relative rounding, rms well below
    assert 2 ** 14 <= interp_results[f"q_scale_{mag}_max"] <= 2 ** 15  # in fp16's range, none lost


def test_q_scaling_of_an_all_zero_q_gives_zeros(interp_results):
    assert interp_results["q_scale_zero"] == 0.0


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fp8_kv_store_kernel_writes_the_references_scaled_saturated_values_byte_for_byte(interp_results, dtype):
    assert interp_results[f"store_kv_{dtype}"] == 0.0


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kernel", ["rotary_store"])
def test_fp8_kv_rotary_writers_store_the_quantized_rotated_token(interp_results, kernel, dtype):
    assert interp_results[f"{kernel}_{dtype}"] <= 1e-2


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fp8_kv_store_kernel_rounds_as_torch_where_the_interpreter_casts_right(interp_results, dtype):
    if not interp_results["cast_ok"]:
        pytest.skip("this triton's interpreter casts fp32 to e4m3 wrongly (31.7 -> 16.0): checked on the GPU")
    assert interp_results[f"store_kv_torch_{dtype}"] == 0.0
