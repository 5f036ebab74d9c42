"""The W4A16 Triton kernels (kernels/w4a16_gemm.py) against `kernels.w4a16_linear.w4a16_linear_ref`
under the Triton interpreter on CPU tensors (no GPU needed): the one-row kernel (one group a
tile, a forced ragged K split, gathered scales for a group size of 24, per-channel), the
2..16-row path (split and not), the GEMM kernel at 37 and 70 rows, AWQ and GPTQ weights,
with and without bias.

The checks run in one subprocess (`w4a16_interp_checks.py`) with TRITON_INTERPRET=1 set
before triton is imported. Tolerances (relative norm error against the fp32 product of the
dequantized weight): fp32 1e-5 (summation order; ~2e-7 measured); fp16 2e-3 (the output's
fp16 rounding and, on the tl.dot path, the dequantized weight rounded to fp16; ~3e-4
measured). Skipped when triton is not installed.
"""

from __future__ import annotations

import pytest

from tests.interp_runner import run_interp_checks

pytest.importorskip("triton")

TOL = {"float32": 1e-5, "float16": 2e-3}
CASES = ["m1_g32_awq", "m1_split3_gptq", "m1_g24_gather", "m1_perchannel", "m5_awq", "m16_gptq",
         "m37_gemm_awq", "m70_gemm_g24"]


@pytest.fixture(scope="module")
def interp_results() -> dict[str, float]:
    return run_interp_checks("tests/unit/w4a16_interp_checks.py")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", CASES)
def test_w4a16_kernel_matches_reference_under_interpreter(interp_results, case, dtype):
    err = interp_results[f"{case}_{dtype}"]
    assert err <= TOL[dtype], f"{case} {dtype}: relative error {err}"
