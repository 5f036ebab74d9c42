"""The hybrid glue kernels (kernels/hybrid_glue.py: the gated attention's sigmoid gate, the
shared expert's combine) against their torch references under the Triton interpreter on CPU
tensors, in fp32 and fp16 (checks in `hybrid_glue_interp_checks.py`, one subprocess; bf16,
whose casts the interpreter does not round as torch does, in tests/gpu/test_hybrid_glue_gpu.py).
Tolerance: the kernels round at the references' points (the sigmoid, the product, the sum),
so they differ only where the fp32 exp differs in its last bits: fp32 1e-6 absolute (values
of a few units), fp16 one ulp of the largest output (|out| < ~8: 2^-7)."""

from __future__ import annotations

import pytest

from tests.interp_runner import run_interp_checks

pytest.importorskip("triton")

TOL = {"float32": 1e-6, "float16": 2 ** -7}
CASES = [f"gate_t{t}_h{h}_d{d}" for t, h, d in ((1, 4, 16), (3, 5, 24))] + \
        [f"combine_t{t}_h{h}" for t, h in ((1, 64), (4, 1100))]


@pytest.fixture(scope="module")
def interp_results() -> dict[str, float]:
    return run_interp_checks("tests/unit/hybrid_glue_interp_checks.py")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", CASES)
def test_glue_kernel_matches_its_torch_reference_under_interpreter(interp_results, case, dtype):
    e = interp_results[f"{case}_{dtype}"]
    assert e <= TOL[dtype], f"{case} {dtype}: max abs error {e}"
