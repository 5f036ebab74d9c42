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
Skipped when triton is not installed.
"""

from __future__ import annotations

import pytest

from tests.interp_runner import run_interp_checks

pytest.importorskip("triton")

TOL = {"float32": 1e-5, "float16": 3e-3}
READERS = ["attn_decode_gqa_splitk", "attn_decode_one_split", "attn_decode_prefetch", "attn_decode_graph_bound_hd24",
           "attn_prefill_varlen_prefix", "attn_mixed_prefill_decode", "attn_multi_query_verify",
           "attn_multi_query_one_split", "rope_decode_attn"]


@pytest.fixture(scope="module")
def interp_results() -> dict[str, float]:
    return run_interp_checks("tests/unit/kv_fp8_interp_checks.py")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kernel", READERS)
def test_fp8_kv_attention_kernel_matches_the_dequantizing_reference_under_interpreter(interp_results, kernel,
                                                                                       dtype):
    err = interp_results[f"{kernel}_{dtype}"]
    assert err <= TOL[dtype], f"{kernel} {dtype}: relative error {err}"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fp8_kv_store_kernel_writes_the_references_scaled_saturated_values_byte_for_byte(interp_results, dtype):
    assert interp_results[f"store_kv_{dtype}"] == 0.0


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kernel", ["rotary_store", "rope_decode_write"])
def test_fp8_kv_rotary_writers_store_the_quantized_rotated_token(interp_results, kernel, dtype):
    assert interp_results[f"{kernel}_{dtype}"] <= 1e-2


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fp8_kv_store_kernel_rounds_as_torch_where_the_interpreter_casts_right(interp_results, dtype):
    if not interp_results["cast_ok"]:
        pytest.skip("this triton's interpreter casts fp32 to e4m3 wrongly (31.7 -> 16.0): checked on the GPU")
    assert interp_results[f"store_kv_torch_{dtype}"] == 0.0
