"""The int8 KV cache in the Triton kernels (docs/ARCHITECTURE.md §4.6): the writers' quantization and
the readers' per-key scales, for the kernels of `kernels.kv_quant_triton` (KV_QUANT 2). The torch
references are `kernels.kv_quant.quantize_int8` and `dequantize_int8`.

Format: one fp32 scale per token and KV head for K and for V, tensors [num_blocks, block_size,
kv_heads] beside the cache, contiguous like it, so a cache row at element offset off has its
scale at off // head_dim. The writers quantize each K and V row (one token, one KV head)
exactly as `quantize_int8` does (`int8_quantize`: scale = amax / 127 and inv = 1 / scale by
IEEE divisions, codes = x * inv rounded half to even with comparisons only, clamped to
+-127) and store the codes and the scale. The readers widen the codes exactly to q's dtype
(|code| <= 127 fits bf16 and fp16), load the tile's scales (`kv_row_scales`, one per key)
and fold them into the softmax: q . (k8_j ks_j) = ks_j (q . k8_j) scales the score tile's
columns (with the softmax scale), sum_j p_j (v8_j vs_j) = sum_j (p_j vs_j) v8_j scales the
probabilities before the P@V dot (`kv_pv`: by vs_j / max_j vs_j, so the operand stays in
[0, 1] like p, and the tile's max on the fp32 product); the softmax's m and l use the
unscaled p; everything accumulates in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def int8_scale(amax):
    """(scale, inv) for rows of max |x| amax (fp32): scale = amax / 127 and inv = 1 / scale (0
    where scale is 0), both IEEE round-to-nearest divisions (`tl.math.div_rn`; Triton's `/`
    on fp32 is an approximate division on the GPU), as `kernels.kv_quant.quantize_int8`'s
    torch divisions."""
    scale = tl.math.div_rn(amax, 127.0)
    pos = scale > 0
    inv = tl.where(pos, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), tl.where(pos, scale, 1.0)), 0.0)
    return scale, inv


@triton.jit
def int8_codes(x, inv):
    """round_half_even(x * inv) clamped to +-127, as int8 (`quantize_int8`: torch.round of the
    fp32 product). The product is only compared and truncated, never added to, so no
    multiply-add contraction can change its rounding: a = |x * inv| (at most 128 here),
    t = trunc(a), h = t + 0.5 (exact); the code is t + 1 where a > h, or where a == h and t is
    odd (a tie to even), with x's sign."""
    y = x.to(tl.float32) * inv
    a = tl.minimum(tl.abs(y), 128.0)
    t = a.to(tl.int32)
    h = t.to(tl.float32) + 0.5
    r = t + (a > h).to(tl.int32) + ((a == h) & ((t & 1) == 1)).to(tl.int32)
    r = tl.minimum(r, 127)
    return tl.where(y < 0, -r, r).to(tl.int8)


@triton.jit
def int8_quantize(x):
    """Rows x [R, C] (float; masked lanes 0) -> (codes [R, C] int8, scales [R] fp32) as
    `kernels.kv_quant.quantize_int8` over the last dim (`int8_scale`, `int8_codes`)."""
    amax = tl.max(tl.abs(x.to(tl.float32)), 1)
    scale, inv = int8_scale(amax)
    return int8_codes(x, inv[:, None]), scale


@triton.jit
def kv_row_scales(s_ptr, off, nm, head_dim, KV_QUANT: tl.constexpr):
    """An int8 cache's scales [BLOCK_N] fp32 of the rows at element offsets off (valid where
    nm, 0.0 elsewhere): s_ptr + off // head_dim (scales [num_blocks, block_size, kv_heads]
    contiguous like the cache, `kv_operands` checks); 1.0 for other caches (unused)."""
    if KV_QUANT == 2:  # one return (see kv_tile)
        y = tl.load(s_ptr + off // head_dim, mask=nm, other=0.0)
    else:
        y = 1.0
    return y


@triton.jit
def kv_scores(s, ks, KV_QUANT: tl.constexpr):
    """Scores s [R, BLOCK_N] (q . k8 times the softmax scale, fp32) times the keys' int8
    scales ks [BLOCK_N] per column; s unchanged for other caches."""
    if KV_QUANT == 2:
        y = s * ks[None, :]
    else:
        y = s
    return y


@triton.jit
def kv_pv(p, v, vs, KV_QUANT: tl.constexpr):
    """The P@V product of one key tile in fp32: p [R, BLOCK_N] (fp32 probabilities, unnormalised),
    v [BLOCK_N, D] the tile in the dots' dtype. int8: sum_j p_j vs_j v8_j, computed as
    (p * vs / vmax) @ v8 * vmax with vmax = max_j vs_j (the operand in [0, 1], as p; exact
    algebra, one rounding of the operand to v's dtype); else p @ v."""
    if KV_QUANT == 2:
        vmax = tl.max(vs, 0)
        vmax = tl.where(vmax > 0, vmax, 1.0)
        y = tl.dot((p * (vs / vmax)[None, :]).to(v.dtype), v) * vmax
    else:
        y = tl.dot(p.to(v.dtype), v)
    return y
