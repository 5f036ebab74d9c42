"""The fp8_e4m3 KV cache in the Triton kernels (docs/ARCHITECTURE.md §4.6): the helpers every
kernel that writes or reads the paged KV cache shares (`kernels.attention_triton` store,
decode and prefill, `kernels.attention_multi_query`, `kernels.rope_decode`,
`kernels.rotary`). The torch references are `kernels.kv_quant.quantize_fp8` and
`dequantize_fp8`.

Format: the cache holds float8_e4m3fn with one fp32 dequantization scale per layer for K and
one for V (0-d device tensors, read by the kernels through a pointer: nothing host-synced,
and a CUDA graph replays with whatever the tensors hold). Write: e4m3(x / scale), saturated
to +-448 (hardware round to nearest even). Read: the kernels load the bytes, widen them
exactly to the dots' dtype (below) and fold the scales out of the inner loops, which is
exact algebra: q . (k8 * ks) = (q . k8) * ks, so the K scale multiplies the softmax scale once, and
sum_j p_j (v8_j * vs) = vs * sum_j p_j v8_j, so the V scale multiplies each program's fp32
accumulator once before it is stored or normalised.

The caches are passed to the kernels as their bytes (uint8 views) and bitcast after the
load, so that masked lanes load integer zeros (+0.0) with no fp8 constant to convert (as
`kernels.fp8_gemv` does with its weights).

The dot format of the decode kernels (`kernels.attention_triton._decode_kernel`,
`kernels.rope_decode`; their config key "fp8_dot", a name of FP8_DOTS; §4.6):
- "q": tiles widened to q's dtype (for a bf16 model e4m3 -> fp16 -> bf16, two conversions
  an element: the format of the first H200 figures, slower than bf16 KV);
- "fp16": the dots in fp16: tiles e4m3 -> fp16 (one hardware conversion, two values an
  instruction; every e4m3 value is an fp16 one), q put into fp16 once per program by a
  power-of-two scale (`fp8_dot_q`: exact, any q range), the probabilities rounded to fp16
  (in [0, 1]: finer than bf16 down to 2^-14, flushed to 0 below 2^-24) for the P@V dot;
- "fp16_bits": as "fp16" with the widening in integer ops (`e4m3_fp16_bits`: the tile holds
  value * 2^-8, the 2^8 folded into the K and V scales, `fp8_read_scale`).
The multi-query and prefill kernels widen to q's dtype ("q").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device_info import num_sms

FP8_E4M3_MAX = 448.0  # also kernels.kv_quant.FP8_E4M3_MAX
# the decode kernels' dot formats (module doc): config name -> the kernels' FP8_DOT constexpr
FP8_DOTS = {"q": 0, "fp16": 1, "fp16_bits": 2}


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
def e4m3_fp16_bits(x):
    """e4m3 codes x (uint8) -> fp16 holding value * 2^-8, by integer ops only (no conversion
    instruction): the code's exponent and mantissa bits (6..0) shifted left by 7 land in
    fp16's exponent and mantissa fields (bias 15 against e4m3's 7: the factor 2^-8; e4m3's
    subnormals land on fp16 subnormals, the same factor), the sign bit (7) on bit 15 through
    the int8 sign extension, bit 14 cleared. Exact for the 254 finite codes; the NaN codes
    0x7F / 0xFF read as +-480 * 2^-8 (a cache holds none: writes saturate at +-448)."""
    h = x.to(tl.int8, bitcast=True).to(tl.int16)  # sign extended: bits 15..7 = the sign
    y = ((h << 7) & -16512).to(tl.int16)  # -16512 = 0xBF80 as int16: sign, exponent, mantissa
    return y.to(tl.float16, bitcast=True)


@triton.jit
def kv_dot_tile(x, like, KV_FP8: tl.constexpr, FP8_DOT: tl.constexpr):
    """A loaded cache tile for a decode kernel's dots with q `like` (from `fp8_dot_q`): as
    `kv_tile` (widened to like's dtype, fp16 with FP8_DOT 1), or with FP8_DOT 2 (an fp8
    cache) `e4m3_fp16_bits`."""
    if KV_FP8 and FP8_DOT == 2:  # one return (see kv_tile)
        y = e4m3_fp16_bits(x)
    else:
        y = kv_tile(x, like, KV_FP8)
    return y


@triton.jit
def fp8_dot_q(q, KV_FP8: tl.constexpr, FP8_DOT: tl.constexpr):
    """(q for the dots, the factor on the scores that undoes its scaling): for an fp8 cache
    with FP8_DOT 1 or 2, q times 2^e in fp16, e chosen from the program's max |q| (its fp32
    exponent bits) so that max |q| 2^e lies in [2^14, 2^15) (fp16's largest finite value is
    65504): exact but for q values below 2^-29 of the max (fp16 subnormals, negligible in a
    dot), the factor 2^-e exact; else (q, 1.0). All-zero q gives zeros; inf / NaN propagate."""
    if KV_FP8 and FP8_DOT != 0:  # one return (see kv_tile)
        qf = q.to(tl.float32)
        amax = tl.max(tl.max(tl.abs(qf), 1), 0)
        ex = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent: amax in [2^(ex-127), 2^(ex-126))
        sb = tl.minimum(tl.maximum(268 - ex, 1), 253)  # biased exponent of 2^e, e = 141 - ex
        up = (sb << 23).to(tl.float32, bitcast=True)
        qd = (qf * up).to(tl.float16)
        undo = ((254 - sb) << 23).to(tl.float32, bitcast=True)  # 2^-e
    else:
        qd = q
        undo = 1.0
    return qd, undo


@triton.jit
def fp8_read_scale(KV_FP8: tl.constexpr, FP8_DOT: tl.constexpr):
    """The factor on the K and V scales that undoes the widening's: 2^8 for FP8_DOT 2 on an
    fp8 cache (`e4m3_fp16_bits`), else 1.0."""
    if KV_FP8 and FP8_DOT == 2:
        f = 256.0
    else:
        f = 1.0
    return f


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


def fp8_overrides(table: dict, num_seqs: int, num_kv_heads: int, head_dim: int, device: torch.device) -> dict:
    """A decode kernel's launch overrides for an fp8_e4m3 cache: table["few"] when the
    launch's seqs x kv_heads programs (before splits) are fewer than the device's SMs, else
    table["many"] (`kernels.attention_triton.DECODE_FP8_DEFAULTS`,
    `kernels.rope_decode.ROPE_DECODE_FP8_DEFAULTS`). Host ints only (capturable). For
    head_dim > 128 the class's block_n is halved (the same bytes a key tile)."""
    cfg = dict(table["few" if num_seqs * num_kv_heads < num_sms(device) else "many"])
    if cfg.get("block_n") and triton.next_power_of_2(head_dim) > 128:
        cfg["block_n"] = max(16, cfg["block_n"] // 2)
    return cfg


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
