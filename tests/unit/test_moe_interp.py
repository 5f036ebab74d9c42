"""The fused-MoE Triton path against `kernels.moe.fused_moe_ref` under the Triton interpreter
on CPU tensors (no GPU needed): one token, k = 1, T*k / E above BLOCK_M (an expert over
several M tiles), an expert no token picks and one every token picks, H and I that are not
whole tiles, int32 and int64 ids, the grouped program order, the default config, and
workspaces poisoned with NaN (padding rows must store nothing, every pair's row once).
The decode path (`kernels/moe_decode_triton.py`): the router + alignment program against the
torch routing and `moe_align` (ids and layout exactly; ties; E not a power of two; shared
experts), the three-launch block against `fused_moe_ref` on the torch routing (one row, shared
experts, the down projection's K loop, k = 1, the default configs; and with a shared expert
added in the down kernel's epilogue against kernels.hybrid_glue's combine reference, and with the
decoder layer's residual added last there; the two-launch path of GATE_UP "gemv", whose gate_up
and down kernels route each token themselves, the same ways), the down kernel alone
against a float64 sum into a NaN-poisoned output.

The checks run in one subprocess (`moe_interp_checks.py`) with TRITON_INTERPRET=1 set before
triton is imported. Tolerances (relative norm error, METHOD.md): fp32 1e-5 (summation
order); fp16 3e-3 (the two paths round gate, up, silu, act and the down output to fp16 at
the same points, and a different summation order can move a rounding by one ulp).
Skipped when triton is not installed.
"""

from __future__ import annotations

import pytest

from tests.interp_runner import run_interp_checks

pytest.importorskip("triton")

TOL = {"float32": 1e-5, "float16": 3e-3}
CASES = ["t1", "t3_k1", "t40", "t40_bm32", "t20_default", "t40_e2_group4"]


@pytest.fixture(scope="module")
def interp_results() -> dict[str, float]:
    return run_interp_checks("tests/unit/moe_interp_checks.py")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", CASES)
def test_triton_moe_matches_reference_under_interpreter(interp_results, case, dtype):
    err = interp_results[f"{case}_{dtype}"]
    assert err <= TOL[dtype], f"{case} {dtype}: relative error {err}"


def test_padding_rows_store_nothing(interp_results):
    assert interp_results["poisoned_workspace_float32"] <= TOL["float32"]


@pytest.mark.parametrize("case", ["align_t1", "align_t37_e3", "align_t300", "align_t5_bm1"])
def test_one_program_alignment_matches_torch(interp_results, case):
    assert interp_results[case] == 0.0, f"{case}: moe_align_triton's layout differs from moe_align's"


@pytest.mark.parametrize("case", ["router_e128_k8", "router_e60_k4_raw", "router_e8_k1"])
def test_one_launch_router_matches_torch_topk_softmax(interp_results, case):
    assert interp_results[case] <= 1e-6, f"{case}: {interp_results[case]} (inf: other experts chosen)"


@pytest.mark.parametrize("case", ["route_align_t1_e128_k8", "route_align_t8_e60_k4_raw", "route_align_t5_e8_k3_bm1",
                                  "route_align_t3_e8_k1", "route_align_t6_e4_k4_ties"])
def test_router_and_alignment_program_matches_torch_routing_then_moe_align(interp_results, case):
    assert interp_results[case] <= 1e-6, f"{case}: {interp_results[case]} (inf: ids or layout differ)"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", ["decode_t1", "decode_t3_shared", "decode_t8_kloop", "decode_t2_k1"])
def test_three_launch_decode_block_matches_reference_on_torch_routing(interp_results, case, dtype):
    err = interp_results[f"{case}_{dtype}"]
    assert err <= TOL[dtype], f"{case} {dtype}: relative error {err}"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", ["decode_t1", "decode_t3_shared", "decode_t8_kloop", "decode_t2_k1"])
def test_decode_block_adds_a_shared_expert_in_its_down_kernel_as_the_combine_reference(interp_results, case, dtype):
    err = interp_results[f"{case}_shared_{dtype}"]
    assert err <= TOL[dtype], f"{case} {dtype}: relative error {err}"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("part", ["gemv", "gemv_shared_res", "gemv_kloop"])
@pytest.mark.parametrize("case", ["decode_t1", "decode_t3_shared", "decode_t8_kloop", "decode_t2_k1"])
def test_two_launch_decode_path_routes_in_its_kernels_as_the_reference(interp_results, case, part, dtype):
    # GATE_UP "gemv": the routed one-row gate_up kernel and the routed down kernel
    err = interp_results[f"{case}_{part}_{dtype}"]
    assert err <= TOL[dtype], f"{case} {part} {dtype}: relative error {err}"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("part", ["res", "shared_res"])
@pytest.mark.parametrize("case", ["decode_t1", "decode_t3_shared", "decode_t8_kloop", "decode_t2_k1"])
def test_decode_block_adds_the_layer_residual_last_in_its_down_kernel(interp_results, case, part, dtype):
    err = interp_results[f"{case}_{part}_{dtype}"]
    assert err <= TOL[dtype], f"{case} {part} {dtype}: relative error {err}"


@pytest.mark.parametrize("case", ["decode_t1", "decode_t3_shared", "decode_t8_kloop", "decode_t2_k1"])
def test_down_projection_sums_the_k_experts_into_each_row(interp_results, case):
    assert interp_results[f"{case}_down_only"] <= TOL["float32"], interp_results[f"{case}_down_only"]
