"""The Triton kernels of the int8 KV cache (kernels/kv_quant_triton.py and the store, rotary,
decode, prefill, multi-query and fused rotary-decode kernels that use it) against the torch
references of kernels/kv_quant.py and kernels/attention.py, under the Triton interpreter on
CPU tensors (no GPU needed).

The checks run in one subprocess (`kv_int8_interp_checks.py`, whose docstring says what each
compares) with TRITON_INTERPRET=1 set before triton is imported.

Writers: the store kernel writes the reference's codes and scales bit for bit (fp32, fp16 and
bf16 K/V; ties to even, a zero row, a padding slot). The rotary writers (the rotary + store
kernel, the fused rotary decode's token write) quantize their own rotated rows, which may
differ from the rotary reference's by an fp32 rounding: a code may move by one step at a
rounding edge (bound 1 step + 1e-3; measured 5e-5 fp32, 0 fp16) and a scale by the rows'
rounding (bound 1e-5 relative; measured 2e-7 fp32, 0 fp16).

Readers, relative norm error against `paged_attention_ref` on the same reference-quantized
cache: fp32 1e-5 (summation order and the scales on the score and probability columns;
measured <= 4e-7), fp16 3e-3 (q . k8 in fp16 operands, the scaled probabilities rounded to
fp16 for P@V, as the fp8 path's bound; measured <= 4e-4). And against attention over the
unquantized K/V: the int8 rounding's bound, each element within scale / 2 = amax / 254 of
its value, about 1% rms for the tests' N(0, 1) rows of 16-24 (amax ~2.5): 2e-2 (measured
4e-3..8e-3).
Skipped when triton is not installed.
"""

from __future__ import annotations

import pytest

from tests.interp_runner import run_interp_checks

pytest.importorskip("triton")

TOL = {"float32": 1e-5, "float16": 3e-3}
QUANT_TOL = 2e-2  # the int8 rounding (amax / 254 an element) against unquantized K/V
READERS = ["decode_gqa_splitk", "decode_default_splits", "decode_one_split", "decode_prefetch",
           "decode_graph_bound_hd24", "decode_long_tiles", "decode_fused_merge", "decode_odd_hd18",
           "prefill_varlen_prefix", "mixed_prefill_decode", "multi_query_verify", "multi_query_one_split",
           "multi_query_fused_merge"]


@pytest.fixture(scope="module")
def interp_results() -> dict[str, float]:
    return run_interp_checks("tests/unit/kv_int8_interp_checks.py")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_int8_kv_store_kernel_writes_the_references_codes_and_scales_bit_for_bit(interp_results, dtype):
    assert interp_results[f"store_kv_{dtype}"] == 0.0


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kernel", ["rotary_store", "rope_decode_write"])
def test_int8_kv_rotary_writers_store_the_quantized_rotated_token_within_one_step(interp_results, kernel, dtype):
    assert interp_results[f"{kernel}_{dtype}"] <= 1.0 + 1e-3
    assert interp_results[f"{kernel}_scale_{dtype}"] <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kernel", READERS + ["rope_decode"])
def test_int8_kv_attention_kernel_matches_the_dequantizing_reference_under_interpreter(interp_results, kernel,
                                                                                       dtype):
    err = interp_results[f"attn_{kernel}_{dtype}"]
    assert err <= TOL[dtype], f"{kernel} {dtype}: relative error {err}"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kernel", READERS)
def test_int8_kv_attention_is_within_the_int8_rounding_of_unquantized_attention(interp_results, kernel, dtype):
    err = interp_results[f"quant_{kernel}_{dtype}"]
    assert err <= QUANT_TOL, f"{kernel} {dtype}: relative error {err} against unquantized K/V"


def test_kv_operands_passes_an_int8_cache_with_its_scales_and_refuses_malformed_scales():
    import torch

    from kernels.kv_quant_triton import KV_INT8, kv_operands

    kc, vc = torch.zeros(3, 16, 2, 8, dtype=torch.int8), torch.zeros(3, 16, 2, 8, dtype=torch.int8)
    ks, vs = torch.zeros(3, 16, 2), torch.zeros(3, 16, 2)
    k, v, s1, s2, quant = kv_operands(kc, vc, ks, vs)
    assert quant == KV_INT8 and k is kc and v is vc and s1 is ks and s2 is vs
    with pytest.raises(ValueError, match="per-token"):
        kv_operands(kc, vc, None, None)
    with pytest.raises(ValueError, match="contiguous fp32"):
        kv_operands(kc, vc, torch.zeros(3, 16), vs)  # not one per token and head
    with pytest.raises(ValueError, match="contiguous fp32"):
        kv_operands(kc, vc, torch.zeros(3, 2, 16).transpose(1, 2), vs)  # not contiguous: off // head_dim breaks
    with pytest.raises(ValueError, match="contiguous fp32"):
        kv_operands(kc, vc, ks.double(), vs)
