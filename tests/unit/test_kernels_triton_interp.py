"""Every Triton kernel of `kernels/` against its torch reference, under the Triton
interpreter on CPU tensors (no GPU needed).

The checks run in one subprocess (`triton_interp_checks.py`) with TRITON_INTERPRET=1 set
before triton is imported: in this process triton may already be imported in compiled
mode by other tests. Skipped when triton is not installed (it is in the `test` extra).
Tolerances (relative norm error, METHOD.md): fp32 1e-5, fp16 3e-3 (fp16 rounding of the
softmax probabilities before the P@V dot).
"""

from __future__ import annotations

import pytest

from tests.interp_runner import run_interp_checks

pytest.importorskip("triton")

TOL = {"float32": 1e-5, "float16": 3e-3}


@pytest.fixture(scope="module")
def interp_results() -> dict[str, float]:
    return run_interp_checks("tests/unit/triton_interp_checks.py", "1")  # "1": the inputs' seed


KERNELS = ["rms_norm", "fused_add_rms_norm", "rms_norm_strided", "silu_and_mul",
           "rotary_store_kv_rot16", "rotary_store_kv_rot8", "apply_rotary", "store_kv",
           "attn_decode_gqa_bs16", "attn_decode_long_splitk", "attn_decode_graph_bound", "attn_decode_prefetch",
           "attn_decode_fused_merge", "attn_prefill_varlen_prefix", "attn_mixed_prefill_decode_hd24",
           "attn_multi_query_verify", "attn_multi_query_one_split", "attn_multi_query_graph_bound",
           "attn_multi_query_off",
           "sample_gumbel", "sample_gumbel_chunked", "skinny_linear", "gemv", "gemv_rows", "gemv_xn_out", "rotary_qk_norm", "rope_decode",
           "rope_decode_fused_merge", "decode_live_split_merge", "pending_ids"]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_triton_kernel_matches_reference_under_interpreter(interp_results, kernel, dtype):
    err = interp_results[f"{kernel}_{dtype}"]
    assert err <= TOL[dtype], f"{kernel} {dtype}: relative error {err}"
