"""The fp8_e4m3 KV cache in the Triton kernels (docs/ARCHITECTURE.md §4.6): the helpers every
kernel that writes or reads the paged KV cache shares (`kernels.attention_triton` store,
decode and prefill, `kernels.attention_multi_query`, `kernels.rope_decode`,
`kernels.rotary`). The torch references are `kernels.kv_quant.quantize_fp8` and
`dequantize_fp8`.

Format: the cache holds float8_e4m3fn with one fp32 dequantization scale per layer for K and
one for V (0-d device tensors, read by the kernels through a pointer: nothing host-synced,
and a CUDA graph replays with whatever the tensors hold). Write: e4m3(x / scale), saturated
to +-448 (hardware round to nearest even). Read: the kernels load the bytes, widen them
exactly to the compute dtype (e4m3 -> fp16 -> q's dtype: every e4m3 value is an fp16 and a
bf16 value) and fold the scales out of the inner loops, which is exact algebra:
q . (k8 * ks) = (q . k8) * ks, so the K scale multiplies the softmax scale once, and
sum_j p_j (v8_j * vs) = vs * sum_j p_j v8_j, so the V scale multiplies each program's fp32
accumulator once before it is stored or normalised.

The caches are passed to the kernels as their bytes (uint8 views) and bitcast after the
load, so that masked lanes load integer zeros (+0.0) with no fp8 constant to convert (as
`kernels.fp8_gemv` does with its weights).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_E4M3_MAX = 448.0  # also kernels.kv_quant.FP8_E4M3_MAX


@triton.jit
def kv_tile(x, like, KV_FP8: tl.constexpr):
    """A loaded cache tile in the compute dtype (that of the tensor `like`, the kernel's q):
    the e4m3 bytes (uint8) of an fp8 cache bitcast and widened exactly (through fp16); a
    model-dtype tile unchanged."""
    # one return after a static if/else: Triton 3.6 refuses early returns of two types
    if KV_FP8:
        y = x.to(tl.float8e4nv, bitcast=True).to(tl.float16).to(like.dtype)
    else:
        y = x
    return y


@triton.jit
def fp8_bytes(x, scale):
    """x / scale saturated to +-448 and rounded to e4m3, as its bytes (uint8), for a store
    into an fp8 cache (`kernels.kv_quant.quantize_fp8`; Triton's fp32 division is not
    IEEE-exact, so a value on a rounding tie may land one e4m3 step from the reference's)."""
    y = tl.clamp(x.to(tl.float32) / scale, -448.0, 448.0)
    return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def kv_cast_store(x, scale, KV_FP8: tl.constexpr):
    """A K or V row to store: `fp8_bytes` for an fp8 cache, else x unchanged (the store
    casts to the cache's dtype)."""
    if KV_FP8:  # one return (see kv_tile)
        y = fp8_bytes(x, scale)
    else:
        y = x
    return y


def kv_operands(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """What a kernel launch takes for a layer's cache: (k_cache, v_cache, k_scale, v_scale,
    kv_fp8). An fp8_e4m3 cache [num_blocks, block_size, kv_heads, head_dim] float8_e4m3fn
    comes back as its uint8 views (same strides) with its 0-d fp32 scales on the cache's
    device; a cache in the model dtype as itself, with the caches standing in for the unused
    scale pointers.
    Raises ValueError for an fp8 cache without both scales, TypeError for an int8 cache
    (read by the torch references only, `kernels.kv_quant`)."""
    if k_cache.dtype == torch.float8_e4m3fn:
        if k_scale is None or v_scale is None:
            raise ValueError("an fp8_e4m3 KV cache needs its layer's k_scale and v_scale")
        return k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale, v_scale, True
    if k_cache.dtype == torch.int8:
        raise TypeError("an int8 KV cache is read by the torch references only (kernels.kv_quant); "
                        "the Triton kernels read fp8_e4m3")
    return k_cache, v_cache, k_cache, v_cache, False
