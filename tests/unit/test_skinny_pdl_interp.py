"""The one-tile skinny kernel (`kernels.linear._skinny_pdl_kernel`, `SKINNY_PDL`: W tile
before the PDL wait, the K split summed in the kernel, the fused prologues and residual
epilogue) under the Triton interpreter, against `linear_ref`; and the fused layer path of a
tiny Llama / Qwen3 through it against the unfused path. The checks run in a subprocess
(tests/unit/skinny_pdl_interp_checks.py, which documents the cases). Tolerances (relative
norm error) as test_fused_linear.py: fp32 1e-5, fp16 3e-3."""

from __future__ import annotations

import pytest

from tests.interp_runner import run_interp_checks
from tests.unit.skinny_pdl_interp_checks import CASES, MODELS

TOL = {"float32": 1e-5, "float16": 3e-3}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interp_checks("tests/unit/skinny_pdl_interp_checks.py", timeout_s=600)


@pytest.mark.parametrize("case", CASES)
def test_one_tile_skinny_kernel_matches_reference(results, case):
    r = results[case]
    assert r["err"] <= TOL[case.rsplit("_", 1)[1]], f"{case}: relative error {r['err']}"
    assert r["counters_zero"], f"{case}: a tile counter was left non-zero"
    assert r["residual_exact"], f"{case}: the residual add is not round(round(y) + r)"
    assert r["old_kernels"] == 0, case
    assert r["equal_to_split_sum_kernel"], f"{case}: the in-kernel split sum differs from the 2-kernel one"


def test_cases_really_split_k(results):
    assert {results[c]["splits"] for c in CASES} == {1, 2, 3}


@pytest.mark.parametrize("case", MODELS)
def test_fused_layer_path_through_one_tile_kernel_matches_unfused_path(results, case):
    r = results[case]
    assert r["one_tile_calls"] == 4 * 2 * 4, r  # 4 projections x 2 layers x 4 steps
    assert r["split_calls"] == r["one_tile_calls"], r  # K ranges of 32: every projection splits
    assert r["err"] <= TOL[case.rsplit("_", 1)[1]], f"{case}: relative error {r['err']}"
