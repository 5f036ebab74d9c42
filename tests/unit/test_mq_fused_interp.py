"""The multi-query (verify-step) attention kernel with its split merge in the kernel
(`kernels.attention_multi_query`, MQ_DEFAULTS "fused_merge") and by the second launch,
against `paged_attention_ref` under the Triton interpreter on CPU tensors (no GPU needed).

The checks run in one subprocess (`mq_fused_interp_checks.py`, whose docstring says what each
compares) with TRITON_INTERPRET=1 set before triton is imported. Tolerances as
tests/unit/test_kernels_triton_interp.py: fp32 1e-5 (summation order), fp16 3e-3 (the fp16
rounding of the probabilities before the P@V dot), and the same for the two paths against
each other (they merge the same fp32 partials in a different order). Skipped when triton is
not installed.
"""

from __future__ import annotations

import pytest

from tests.interp_runner import run_interp_checks

pytest.importorskip("triton")

TOL = {"float32": 1e-5, "float16": 3e-3}
CHECKS = ["fused", "launch", "fused_vs_launch", "fused_auto_splits", "fp8_fused", "fp8_launch",
          "fp8_fused_vs_launch"]


@pytest.fixture(scope="module")
def interp_results() -> dict[str, float]:
    return run_interp_checks("tests/unit/mq_fused_interp_checks.py", "1")  # "1": the inputs' seed


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("check", CHECKS)
def test_multi_query_merge_in_kernel_matches_reference_and_the_merge_launch(interp_results, check, dtype):
    err = interp_results[f"{check}_{dtype}"]
    assert err <= TOL[dtype], f"{check} {dtype}: relative error {err}"


def test_multi_query_partitions_follow_each_seqs_own_length_under_a_graph_bound(interp_results):
    assert interp_results["own_length_partitions"] == 0.0
