"""The W4A16 Triton kernels (kernels/w4a16_gemv.py, kernels/w4a16_gemm.py) against
`kernels.w4a16_linear.w4a16_linear_ref` under the Triton interpreter on CPU tensors (no GPU
needed): the one-row kernel (one group a tile, a forced ragged K split, per channel, a ragged
N with 27 splits; bf16 x as int32 pairs), the dot kernel (gathered scales for a group size of
24 at 1 and 8 rows, per channel, 2..16 rows split and not, ragged N, the fp32 dequantization
instead of the 16-bit magic numbers), the GEMM kernel at 37
and 70 rows, AWQ and GPTQ weights, with and without bias; and the K splits' two sums (in the
kernel, by the last program to arrive; by a second kernel) giving the same bits.

The checks run in one subprocess (`w4a16_interp_checks.py`) with TRITON_INTERPRET=1 set
before triton is imported. Tolerances (relative norm error against the fp32 product of the
dequantized weight): fp32 1e-5 (summation order; ~2e-7 measured); fp16 2e-3 (the output's
fp16 rounding and, on the GEMM path, the dequantized weight rounded to fp16; ~3e-4
measured); bf16 6e-3 (the interpreter truncates fp32 to bf16, 2^-8 of a value at most, where
the GPU rounds to nearest; ~3e-3 measured, and the kernel's fp32 result truncated was checked
equal to its output bit for bit). Skipped when triton is not installed.
"""

from __future__ import annotations

import pytest

from tests.interp_runner import run_interp_checks

pytest.importorskip("triton")

TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 6e-3}
CASES = ["m1_g32_awq", "m1_split3_gptq", "m1_g24_gather", "m1_perchannel", "m1_ragged_n_split27",
         "m2_perchannel_dot", "m3_ragged_split3_dot", "m5_awq", "m5_fp32_dequant_dot", "m8_g24_gather_dot", "m16_gptq",
         "m37_gemm_awq", "m70_gemm_g24"]
BF16 = ["m1_g32_awq", "m1_split3_gptq", "m1_perchannel", "m1_ragged_n_split27"]
SPLIT = ["m1_split3_gptq", "m1_g24_gather", "m1_ragged_n_split27", "m3_ragged_split3_dot", "m5_awq",
         "m8_g24_gather_dot"]


@pytest.fixture(scope="module")
def interp_results() -> dict[str, float]:
    return run_interp_checks("tests/unit/w4a16_interp_checks.py")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", CASES)
def test_w4a16_kernel_matches_reference_under_interpreter(interp_results, case, dtype):
    err = interp_results[f"{case}_{dtype}"]
    assert err <= TOL[dtype], f"{case} {dtype}: relative error {err}"


@pytest.mark.parametrize("case", BF16)
def test_one_row_kernel_reads_bf16_x_as_pairs_correctly(interp_results, case):
    err = interp_results[f"{case}_bfloat16"]
    assert err <= TOL["bfloat16"], f"{case} bf16: relative error {err}"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", SPLIT)
def test_split_sum_in_kernel_equals_second_kernel_bit_for_bit(interp_results, case, dtype):
    assert interp_results[f"split_sums_equal_{case}_{dtype}"] == 1.0


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", SPLIT)
def test_split_sum_is_the_same_bits_for_any_partials_loaded_at_a_time(interp_results, case, dtype):
    assert interp_results[f"sum_chunks_equal_{case}_{dtype}"] == 1.0
