"""The fused rotary + KV write + multi-query attention of verify steps (`kernels.rope_verify`)
against the two-launch references (`rotary_and_store_kv_ref`, then `paged_attention_ref`),
under the Triton interpreter on CPU tensors (no GPU needed), and a tiny Qwen3's verify step
through `VerifyAttention` against the reference backend.

The checks run in one subprocess (`rope_verify_interp_checks.py`, whose docstring says what each
measures) with TRITON_INTERPRET=1 set before triton is imported. Bounds:
- attention, relative norm error of the real rows: fp32 1e-5 (summation order; measured
  ~2e-7), fp16 3e-3 (the fp16 rounding of the probabilities before the P@V dot; measured
  ~3e-4), as tests/unit/test_mq_fused_interp.py; an fp8 cache against the reference over the
  kernel's own writes (the interpreter's e4m3 cast is not torch's, see kv_fp8_interp_checks).
- the written slots: a cache in q's dtype bit for bit without the q/k norm, and in fp16 with it
  (measured 0); with the norm in fp32 within 4 roundings of each row's largest value (measured
  up to 1.9: torch's F.rms_norm and the kernel sum the squares in another order, so the
  normalised values may differ by an ulp, which a rotation near 0 keeps at the inputs' scale);
  fp8 within one e4m3 step of the rotated rows put through the interpreter's cast (measured 0);
  int8 within one code step of `quantize_int8`'s rows (measured 2.5e-5) and its scales within
  1e-6 relative (measured 2e-7).
- every other slot and scale untouched, bit for bit; `_merge_kernel` launched once with
  several splits, never with one split or the fused merge; the merge counters back at 0.
- the model: logits and KV caches within 1e-5 relative (fp32; measured ~6e-7 and ~2e-7), the
  fused path taken in every layer.
- the start-up warm-up (`warm_up_rope_verify`): one launch per multi-query variant with the
  switch on, none with it off, the cache and scales untouched.
Skipped when triton is not installed.
"""

from __future__ import annotations

import pytest

from tests.interp_runner import run_interp_checks

pytest.importorskip("triton")

CASES = ["splits7", "splits7_nonorm_prefetch", "gqa4_fused", "one_split_hd24", "auto"]
ATTN_TOL = {"float32": 1e-5, "float16": 3e-3}


@pytest.fixture(scope="module")
def interp_results() -> dict:
    return run_interp_checks("tests/unit/rope_verify_interp_checks.py", "1", timeout_s=600)  # "1": the seed


def _bound(case: str, kv: str, dtype: str) -> float:
    if kv == "fp8" or kv == "int8":
        return 1.0
    if dtype == "float32" and "nonorm" not in case:
        return 4.0
    return 0.0


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kv", ["none", "fp8", "int8"])
@pytest.mark.parametrize("case", CASES)
def test_fused_verify_attention_matches_rotary_store_then_paged_attention(interp_results, case, kv, dtype):
    r = interp_results[f"{case}_{kv}_{dtype}"]
    assert r["attn"] <= ATTN_TOL[dtype], f"attention: relative error {r['attn']}"
    assert r["write"] <= _bound(case, kv, dtype), f"written slots: {r['write']}"
    assert r["scale"] <= 1e-6, f"int8 scales: relative error {r['scale']}"
    assert r["untouched"] == 0.0, "a slot or scale other than the step's tokens' changed"
    splits = case != "one_split_hd24" and "fused" not in case
    assert r["merge_launches"] == (1 if splits else 0)
    assert r["counters_zero"]


def test_tiny_qwen3_verify_step_through_the_fused_backend_matches_the_reference_backend(interp_results):
    r = interp_results["model_qwen3"]
    assert r["fused_calls"] == r["layers"] > 0, r
    assert r["logits"] <= 1e-5 and r["kv"] <= 1e-5, r


def test_warm_up_launches_each_multi_query_variant_only_with_the_switch_and_writes_nothing(interp_results):
    r = interp_results["warmup"]
    assert r["launches_off"] == 0 and r["launches_on"] == r["variants"] > 0, r
    assert r["untouched"], "the warm-up wrote the cache or its scales"
