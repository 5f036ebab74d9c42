"""The quantized KV caches (fp8_e4m3, int8) in the Triton kernels (docs/ARCHITECTURE.md §4.6): the
helpers every kernel that writes or reads the paged KV cache shares (`kernels.attention_triton`
store, decode and prefill, `kernels.attention_multi_query`, `kernels.rope_decode`,
`kernels.rotary`). The torch references are `kernels.kv_quant.quantize_fp8` /
`dequantize_fp8` and `quantize_int8` / `dequantize_int8`.

The kernels take the cache's format as the constexpr KV_QUANT (`kv_operands`): 0 the model
dtype, 1 fp8_e4m3 (KV_FP8), 2 int8 (KV_INT8). Every fp8 branch tests KV_QUANT == 1, so the
fp8 code is what it was under the former KV_FP8 flag.

int8 (one fp32 scale per token and KV head for K and for V): the write's quantization and the
read's per-key scales are `kernels.kv_int8_triton`'s; this module's `kv_tile` widens the codes
and `kv_operands` checks the scale tensors.

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
  value * 2^-8, the 2^8 folded into the K and V scales, `fp8_read_scale`);
- "fp16_words": as "fp16_bits" but the main loop loads the tiles as uint32 words (four codes)
  and widens each word with 32-bit integer ops (`e4m3_words_fp16`: 7 ALU ops per 4 values, no
  conversion instruction); "fp16_vwords": words for V only, K by the hardware conversion of
  "fp16" (the conversion and ALU pipes shared). Why (sm_90 SASS of the "fp16"
  loop, 128-key tiles, per warp and tile): 128 F2FP conversions (a quarter-rate pipe) and,
  for V, 128 one-byte shared-memory loads (LDS.U8) plus ~250 IMADs packing them: the compiler
  moves the widening behind the shared-memory stage, where the P@V operand wants 4
  consecutive keys of one column, 128 bytes apart; widened in registers first (words), V
  goes through shared memory as fp16 like a bf16 tile (ldmatrix) (docs/ARCHITECTURE.md §4.6).
The format's code (the kernels' FP8_DOT) is k_way + 8 * v_way, a way per tile: 0 q's dtype,
1 the hardware conversion to fp16, 2 `e4m3_fp16_bits`, 3 words (`kv_load_dot_tile`).
The multi-query and prefill kernels widen to q's dtype ("q").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device_info import num_sms

FP8_E4M3_MAX = 448.0  # also kernels.kv_quant.FP8_E4M3_MAX
KV_NONE, KV_FP8, KV_INT8 = 0, 1, 2  # the kernels' KV_QUANT constexpr (`kv_operands`)
# the decode kernels' dot formats (module doc): config name -> the kernels' FP8_DOT constexpr,
# k_way + 8 * v_way (0 q's dtype, 1 hardware fp16, 2 e4m3_fp16_bits, 3 words)
FP8_DOTS = {"q": 0, "fp16": 9, "fp16_bits": 18, "fp16_words": 27, "fp16_vwords": 25}


@triton.jit
def kv_tile(x, like, KV_QUANT: tl.constexpr):
    """A loaded cache tile in the compute dtype (that of the tensor `like`, the kernel's q):
    the e4m3 bytes (uint8) of an fp8 cache bitcast and widened exactly (through fp16); the
    int8 codes of an int8 cache converted exactly (|code| <= 127); a model-dtype tile
    unchanged."""
    # one return after a static if/else: Triton 3.6 refuses early returns of two types
    if KV_QUANT == 1:
        y = x.to(tl.float8e4nv, bitcast=True).to(tl.float16).to(like.dtype)
    elif KV_QUANT == 2:
        y = x.to(like.dtype)
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
def e4m3_words_fp16(w, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """uint32 words w [BLOCK_N, BLOCK_D // 4], four e4m3 codes each (little-endian: code i in
    bits 8i..8i+7) -> fp16 [BLOCK_N, BLOCK_D] holding value * 2^-8, codes 0, 2, 1, 3 of each
    word (the order of its two results' halves: no byte permutes; `word_order`), as
    `e4m3_fp16_bits` (same values, NaN codes included) but two values per 32-bit op: codes 1
    and 3 need (w >> 1) & 0x3F803F80 (exponent and mantissa into the two halves' bits 13..7)
    | w & 0x80008000 (the signs already on bits 15 and 31); codes 0 and 2 the same on w << 8."""
    hi = ((w >> 1) & 0x3F803F80) | (w & 0x80008000)  # codes 1 (low half), 3 (high half)
    lo = ((w << 7) & 0x3F803F80) | ((w << 8) & 0x80008000)  # codes 0, 2
    c0 = lo.to(tl.uint16).to(tl.float16, bitcast=True)
    c1 = hi.to(tl.uint16).to(tl.float16, bitcast=True)
    c2 = (lo >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    c3 = (hi >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    # join(x, y) stacks on a new last axis: [.., i, j] = (x, y)[j][.., i], flattened 2i + j
    return tl.reshape(tl.join(tl.join(c0, c1), tl.join(c2, c3)), (BLOCK_N, BLOCK_D))  # 0, 2, 1, 3


@triton.jit
def word_order(dd, WAY: tl.constexpr):
    """The cache column each position of a tile widened the tile's way (`kv_dot_tile`) holds,
    for the column indices dd = arange(BLOCK_D): way 3 (`e4m3_words_fp16` in its registers'
    order: codes 0, 2, 1, 3 of each word, no byte permutes) swaps bits 0 and 1 of the index,
    other ways keep dd. A kernel loads q (for K) and stores its output (for V) at these
    columns: the dots do not depend on the order of the head_dim axis."""
    if WAY == 3:
        y = (dd & -4) | ((dd & 1) << 1) | ((dd >> 1) & 1)
    else:
        y = dd
    return y


@triton.jit
def kv_dot_tile(x, like, KV_QUANT: tl.constexpr, WAY: tl.constexpr):
    """A loaded cache tile (bytes) for a decode kernel's dots with q `like` (from `fp8_dot_q`),
    widened the tile's way (module doc: FP8_DOT % 8 for K, FP8_DOT // 8 for V): as `kv_tile`
    (to like's dtype: fp16 for way 1), or for ways 2 and 3 (an fp8 cache) `e4m3_fp16_bits`
    (the words' values, for tiles loaded as bytes: prefetched or the step's token)."""
    if KV_QUANT == 1 and WAY >= 2:  # one return (see kv_tile)
        y = e4m3_fp16_bits(x)
    else:
        y = kv_tile(x, like, KV_QUANT)
    return y


@triton.jit
def kv_load_dot_tile(ptr, off, nm, dd, dmask, head_dim, like, KV_QUANT: tl.constexpr, WAY: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Load and widen the cache rows at element offsets off [BLOCK_N] (valid where nm; dd, dmask
    the head_dim columns, in `word_order`) for the dots with `like`: `kv_dot_tile` of the bytes, or for way 3
    (an fp8 cache, head_dim % 4 == 0 and rows 4-byte aligned: the launchers check) the rows as
    uint32 words through `e4m3_words_fp16`."""
    if KV_QUANT == 1 and WAY == 3:
        dw = tl.arange(0, BLOCK_D // 4)
        wp = (ptr + off[:, None]).to(tl.pointer_type(tl.uint32)) + dw[None, :]
        y = e4m3_words_fp16(tl.load(wp, mask=nm[:, None] & (dw < head_dim // 4)[None, :], other=0), BLOCK_N, BLOCK_D)
    else:
        y = kv_dot_tile(tl.load(ptr + off[:, None] + dd[None, :], mask=nm[:, None] & dmask[None, :], other=0),
                        like, KV_QUANT, WAY)
    return y


@triton.jit
def fp8_dot_q(q, KV_QUANT: tl.constexpr, FP8_DOT: tl.constexpr):
    """(q for the dots, the factor on the scores that undoes its scaling): for an fp8 cache
    with an fp16 format (FP8_DOT != 0), q times 2^e in fp16, e chosen from the program's max |q| (its fp32
    exponent bits) so that max |q| 2^e lies in [2^14, 2^15) (fp16's largest finite value is
    65504): exact but for q values below 2^-29 of the max (fp16 subnormals, negligible in a
    dot), the factor 2^-e exact; else (q, 1.0). All-zero q gives zeros; inf / NaN propagate."""
    if KV_QUANT == 1 and FP8_DOT != 0:  # one return (see kv_tile)
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
def fp8_read_scale(KV_QUANT: tl.constexpr, WAY: tl.constexpr):
    """The factor on the K or V scale that undoes its tiles' widening (WAY as `kv_dot_tile`):
    2^8 for the integer ways 2 and 3 on an fp8 cache (`e4m3_fp16_bits`, `e4m3_words_fp16`),
    else 1.0."""
    if KV_QUANT == 1 and WAY >= 2:
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
def kv_cast_store(x, scale, KV_QUANT: tl.constexpr):
    """A K or V row to store: `fp8_bytes` for an fp8 cache, else x unchanged (the store
    casts to the cache's dtype)."""
    if KV_QUANT == 1:  # one return (see kv_tile)
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


def fp8_dot_code(name: str, k_cache: torch.Tensor, head_dim: int, kv_fp8: bool) -> int:
    """The FP8_DOT constexpr of dot format `name` (FP8_DOTS) for a launch over k_cache (the
    uint8 view of `kv_operands`; V's has the same strides), 0 unless kv_fp8: the word way (3) needs rows of
    4-byte aligned words (head_dim, the cache's strides and its address multiples of 4), else
    it falls back to way 2 (`e4m3_fp16_bits`: the same values and scales, byte loads).
    Raises ValueError for an unknown name."""
    if name not in FP8_DOTS:
        raise ValueError(f"fp8_dot {name!r}: one of {sorted(FP8_DOTS)}")
    code = FP8_DOTS[name] if kv_fp8 else 0
    aligned = head_dim % 4 == 0 and k_cache.data_ptr() % 4 == 0 and all(s % 4 == 0 for s in k_cache.stride()[:-1])
    if not aligned:
        code = sum((2 if (code >> sh) & 7 == 3 else (code >> sh) & 7) << sh for sh in (0, 3))
    return code


def kv_operands(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """What a kernel launch takes for a layer's cache: (k_cache, v_cache, k_scale, v_scale,
    kv_quant), kv_quant the KV_QUANT constexpr (KV_NONE, KV_FP8, KV_INT8).
    An fp8_e4m3 cache [num_blocks, block_size, kv_heads, head_dim] float8_e4m3fn comes back as
    its uint8 views (same strides) with its 0-d fp32 scales on the cache's device; an int8
    cache (contiguous) as itself with its fp32 scale tensors [num_blocks, block_size,
    kv_heads] (contiguous); a cache in the model dtype as itself, with the caches standing in
    for the unused scale pointers. Every kernel that calls this reads and writes all three
    formats (a kernel without int8 would refuse it here with a TypeError naming itself).
    Raises ValueError for a quantized cache without both scales, or int8 scales or caches not
    of that shape, dtype, device and contiguity."""
    if k_cache.dtype == torch.float8_e4m3fn:
        if k_scale is None or v_scale is None:
            raise ValueError("an fp8_e4m3 KV cache needs its layer's k_scale and v_scale")
        return k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale, v_scale, KV_FP8
    if k_cache.dtype == torch.int8:
        if k_scale is None or v_scale is None:
            raise ValueError("an int8 KV cache needs its per-token k_scale and v_scale tensors")
        for c, sc in ((k_cache, k_scale), (v_cache, v_scale)):
            if (sc.dtype != torch.float32 or tuple(sc.shape) != tuple(c.shape[:3]) or not sc.is_contiguous()
                    or not c.is_contiguous() or sc.device != c.device):
                raise ValueError(f"int8 KV cache {tuple(c.shape)} {c.dtype}: its scales must be contiguous fp32 "
                                 f"{tuple(c.shape[:3])} on its device, got {tuple(sc.shape)} {sc.dtype}")
        return k_cache, v_cache, k_scale, v_scale, KV_INT8
    return k_cache, v_cache, k_cache, v_cache, KV_NONE
