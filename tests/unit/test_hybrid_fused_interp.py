"""The hybrids' fused layer path through `kernels.gemv` under the Triton interpreter (checks in
tests/unit/hybrid_fused_interp_checks.py, one subprocess, which documents the cases): tiny
Qwen3-Next (a dense MLP layer) and Qwen3.5-MoE, projections stacked and apart, the one-row
decode steps with the zero-centred norms' scale in the gemv's prologue, xn_out and the residual
epilogue, against the unfused path on the reference ops.
Tolerances (relative norm error of the logits) as test_fused_linear.py: fp32 1e-5, fp16 3e-3.
The launches are counted over 3 decode steps of the 4-layer models (one attention and three
gated-DeltaNet layers): each layer's two first projections carry the norm (8 a step), the
mixers' output projections and a dense MLP's down the residual; xn_out is stored by each MoE
block's first projection, and apart by each gated-DeltaNet's in_proj_qkvz too."""

from __future__ import annotations

import pytest

from tests.interp_runner import run_interp_checks

pytest.importorskip("triton")
pytest.importorskip("transformers")

from tests.unit.hybrid_fused_interp_checks import CASES, case_name  # noqa: E402

TOL = {"float32": 1e-5, "float16": 3e-3}
STEPS, LAYERS, LINEAR_LAYERS = 3, 4, 3


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interp_checks("tests/unit/hybrid_fused_interp_checks.py", timeout_s=600)


@pytest.mark.parametrize(("arch", "stacked", "dtype"), CASES, ids=[case_name(*c) for c in CASES])
def test_fused_hybrid_decode_through_the_gemv_matches_the_unfused_path(results, arch, stacked, dtype):
    r = results[case_name(arch, stacked, dtype)]
    assert r["err"] <= TOL[dtype], r
    dense = 1 if arch == "qwen3_next" else 0  # Qwen3-Next's layer 3 has a dense MLP
    assert r["norm"] == 2 * LAYERS * STEPS, r
    assert r["residual"] == (LAYERS + dense) * STEPS, r  # the MoE blocks' add is in kernels.moe
    moe = LAYERS - dense
    assert r["xn_out"] == (moe + (0 if stacked else LINEAR_LAYERS)) * STEPS, r
