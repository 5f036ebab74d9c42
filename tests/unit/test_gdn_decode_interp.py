"""Gated DeltaNet's in-place decode kernels (kernels/gdn_decode.py: the short convolution's
update and the gated-delta-rule step over the state slots) and the gated RMSNorm kernel
(kernels/norm.py) against their torch references, under the Triton interpreter on CPU
tensors (no GPU needed); and the layer's in-place decode on those kernels against its
gathered path (gather, references, scatter) over three steps, both projection layouts.

Slots (`gdn_decode_interp_checks.py`): rows on slots not in order, a new sequence on a
reused slot holding NaN (it must start from zeros), two fresh rows sharing one slot (a CUDA
graph's padding rows on the scratch slot), slots no row names (must stay bit-identical), the
has_initial flags read from an int64 row's low bytes as a graph stages them. Shapes: K not
a power of two, V not a whole number of value tiles, grouped and ungrouped heads, W 2..4,
with and without bias and SiLU, strided q/k/v/a/b/gate views. The recurrent step's launch
configs (`gdn_decode.REC_LAUNCH`'s entries and the sweep's tiles, both program orders) at a V
leaving a partial column tile; `rec_launch`'s choice by the number of rows.

Tolerances (relative norm error): fp32 1e-6 (summation order; measured <= 2e-7); fp16 1e-3
(the kernels round at the references' points; measured 0); bf16 2e-2, because Triton's
interpreter converts fp32 to bf16 by truncation (checked: every value of a 1024-sample
conversion equals the truncated one, against torch's round-to-nearest), a one-ulp
difference (measured <= 9.4e-3). The convolution's window is a copy of inputs: bit-identical
in every dtype. Skipped when triton is not installed.
"""

from __future__ import annotations

import pytest

from kernels import gdn_decode
from tests.interp_runner import run_interp_checks

pytest.importorskip("triton")

TOL = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 2e-2}
DTYPES = list(TOL)
CONV = [f"conv_w{w}_{kind}" for w in (2, 3, 4) for kind in ("bias_silu", "plain")]
REC = ["rec_g2_k12_v20", "rec_g1_k16_v8", "rec_g2_k8_v16_bv16", "rec_nonorm"]
# gdn_decode_interp_checks.launches(): every REC_LAUNCH entry's, the sweep's candidates, two
# loops whose items do not divide the tiles (that module runs only under the interpreter)
LAUNCHES = sorted({(e[1], e[3], e[4], e[5]) for e in gdn_decode.REC_LAUNCH}
                  | {(bv, o, 1, 1) for bv in (8, 16, 32, 64) for o in gdn_decode.REC_ORDERS}
                  | {(bv, "flat", items, st) for bv, _, items, st in gdn_decode.REC_LOOP_CANDIDATES}
                  | {(16, "flat", 3, 2), (64, "flat", 7, 3)})


@pytest.fixture(scope="module")
def interp_results() -> dict[str, float]:
    return run_interp_checks("tests/unit/gdn_decode_interp_checks.py")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CONV)
def test_conv_update_kernel_matches_reference_and_shifts_only_the_named_slots(interp_results, case, dtype):
    r = interp_results
    assert r[f"{case}_{dtype}_out"] <= TOL[dtype], r[f"{case}_{dtype}_out"]
    assert r[f"{case}_{dtype}_state"] == 0.0  # the shifted window: copies of inputs, bit-identical
    assert r[f"{case}_{dtype}_shared_slot"] == 0.0  # two fresh rows on one slot: one of their windows
    assert r[f"{case}_{dtype}_unnamed_slots"] == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", REC)
def test_recurrent_step_kernel_matches_reference_in_place_on_the_slots(interp_results, case, dtype):
    r = interp_results
    state_tol = TOL["float32"] if dtype != "bfloat16" else TOL["bfloat16"]  # fp32 state; bf16 inputs' beta
    assert r[f"{case}_{dtype}_out"] <= TOL[dtype], r[f"{case}_{dtype}_out"]
    assert r[f"{case}_{dtype}_state"] <= state_tol, r[f"{case}_{dtype}_state"]
    assert r[f"{case}_{dtype}_shared_slot"] <= state_tol, r[f"{case}_{dtype}_shared_slot"]
    assert r[f"{case}_{dtype}_unnamed_slots"] == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("block_v,order,items,stages", LAUNCHES)
def test_recurrent_step_launch_configs_match_reference(interp_results, block_v, order, items, stages, dtype):
    """Every launch-table entry's and sweep candidate's tile width, program order and tiles a
    program, at a V leaving a partial column tile (the checks' launch_checks)."""
    r = interp_results
    case = f"rec_launch_bv{block_v}_{order}" + (f"_i{items}_s{stages}" if items > 1 else "") + f"_{dtype}"
    state_tol = TOL["float32"] if dtype != "bfloat16" else TOL["bfloat16"]
    assert r[f"{case}_out"] <= TOL[dtype], r[f"{case}_out"]
    assert r[f"{case}_state"] <= state_tol, r[f"{case}_state"]
    assert r[f"{case}_shared_slot"] <= state_tol, r[f"{case}_shared_slot"]
    assert r[f"{case}_unnamed_slots"] == 0.0


def test_rec_launch_picks_the_first_covering_entry(monkeypatch):
    table = [(4, 8, 1, "grid3", 1, 1), (64, 32, 4, "flat", 1, 1), (None, 64, 8, "flat", 4, 2)]
    monkeypatch.setattr(gdn_decode, "REC_LAUNCH", table)
    small, mid, big = (8, 1, "grid3", 1, 1), (32, 4, "flat", 1, 1), (64, 8, "flat", 4, 2)
    assert [gdn_decode.rec_launch(n) for n in (1, 4, 5, 64, 65, 4096)] == [small, small, mid, mid, big, big]
    monkeypatch.setitem(gdn_decode.TUNING, "rec_table", False)  # the fixed config for every n
    assert gdn_decode.rec_launch(4096) == (8, 1, "grid3", 1, 1)
    monkeypatch.setitem(gdn_decode.TUNING, "rec_table", True)
    monkeypatch.setattr(gdn_decode, "REC_LAUNCH", table[:2])
    with pytest.raises(ValueError, match="covers 65 rows"):
        gdn_decode.rec_launch(65)
    for bad in ((None, 8, 1, "zigzag", 1, 1), (None, 8, 1, "grid3", 2, 1), (None, 8, 1, "flat", 0, 1)):
        monkeypatch.setattr(gdn_decode, "REC_LAUNCH", [bad])
        with pytest.raises(ValueError, match="bad recurrent-step launch"):
            gdn_decode.rec_launch(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["norm3d", "norm2d"])
def test_gated_rms_norm_kernel_matches_reference(interp_results, shape, dtype):
    assert interp_results[f"{shape}_{dtype}"] <= TOL[dtype]


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5"])
def test_layer_in_place_decode_equals_the_gathered_path(interp_results, layout):
    assert interp_results[f"layer_{layout}_out"] <= 1e-6
    assert interp_results[f"layer_{layout}_state"] <= 1e-6
