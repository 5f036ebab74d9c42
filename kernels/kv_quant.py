"""Quantized KV cache formats: the torch references of their write and read
(docs/ARCHITECTURE.md §4.6).

- fp8_e4m3: the cache holds torch.float8_e4m3fn (OCP FP8 E4M3: 4 exponent bits, 3 mantissa
  bits, no infinities, largest finite value 448). One dequantization scale per layer for K
  and one for V (0-d fp32 tensors): stored = round_to_nearest(x / scale), saturated to
  +-448; read = stored * scale. Scales are 1.0 unless the checkpoint carries calibrated
  ones (`self_attn.k_scale` / `v_scale` tensors, the convention of FP8 checkpoints
  written by llm-compressor, ModelOpt and others: real value = stored value * scale).
- int8: the cache holds torch.int8, symmetric, one scale per token and KV head for K and
  one for V, in fp32 tensors [num_blocks, block_size, num_kv_heads] beside the cache:
  scale = amax over head_dim / 127, stored = round_half_even(x / scale) in [-127, 127],
  read = stored * scale (a zero row has scale 0 and reads back as zeros).

Error bounds (per element, for a value inside the format's range), used by the tests:
fp8_e4m3 rounds to 3 mantissa bits, |read - x| <= 2^-4 |x| for normal values and <= 2^-10
* scale in the subnormal range; int8 rounds to a grid of step scale, |read - x| <= scale / 2
= amax / 254.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INT8_MAX = 127
QUANTIZED_KV_DTYPES = (torch.float8_e4m3fn, torch.int8)


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a KV cache dtype is one of the quantized formats of this module."""
    return dtype in QUANTIZED_KV_DTYPES


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to the nearest float8_e4m3fn (ties to even), saturated to +-448.

    x: any shape, float. scale: a 0-d (or broadcastable) fp32 tensor > 0.
    Returns x's shape in torch.float8_e4m3fn."""
    return (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale in fp32. q: float8_e4m3fn, any shape; scale: 0-d fp32."""
    return q.float() * scale


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per row of the last dim (per token and head).

    x: [..., head_dim] float. Returns (q [..., head_dim] int8, scale [...] fp32) with
    scale = amax(|x|, last dim) / 127 and q = round(x / scale) (ties to even), so that
    q * scale[..., None] is within scale / 2 of x. A zero row gets scale 0 and q 0."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / INT8_MAX
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(xf * inv[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale[..., None] in fp32. q: [..., head_dim] int8; scale: [...] fp32."""
    return q.float() * scale[..., None]


def store_quantized(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Quantize new keys and values and write them (and, for int8, their scales) at their
    slots, in place.

    k, v: [num_tokens, num_kv_heads, head_dim] float. k_cache, v_cache: [num_blocks,
    block_size, num_kv_heads, head_dim] of float8_e4m3fn or int8. slot_mapping:
    [num_tokens] int64, every slot in [0, num_blocks * block_size). k_scale, v_scale:
    fp8: the layer's 0-d fp32 scales (read); int8: the [num_blocks, block_size,
    num_kv_heads] fp32 scale tensors (written at the same slots).
    Raises TypeError for another cache dtype."""
    kvh, d = k_cache.shape[-2:]
    if k_cache.dtype == torch.float8_e4m3fn:
        kq, vq = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
    elif k_cache.dtype == torch.int8:
        (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
        k_scale.view(-1, kvh).index_copy_(0, slot_mapping, ks)
        v_scale.view(-1, kvh).index_copy_(0, slot_mapping, vs)
    else:
        raise TypeError(f"not a quantized KV cache dtype: {k_cache.dtype}")
    # index_copy_ has no float8 kernel on the CPU: copy the bytes (both formats are 1 byte)
    k_cache.view(torch.uint8).view(-1, kvh, d).index_copy_(0, slot_mapping, kq.view(torch.uint8))
    v_cache.view(torch.uint8).view(-1, kvh, d).index_copy_(0, slot_mapping, vq.view(torch.uint8))


def gather_dequantized(cache: torch.Tensor, scale: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks of a quantized cache, dequantized to fp32.

    cache: [num_blocks, block_size, num_kv_heads, head_dim] float8_e4m3fn or int8. scale:
    the layer's 0-d scale (fp8) or its [num_blocks, block_size, num_kv_heads] scales
    (int8). blocks: [n] int64 block ids. Returns [n, block_size, num_kv_heads, head_dim]
    fp32. Raises TypeError for another cache dtype."""
    q = cache.index_select(0, blocks)
    if cache.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(q, scale)
    if cache.dtype == torch.int8:
        return dequantize_int8(q, scale.index_select(0, blocks))
    raise TypeError(f"not a quantized KV cache dtype: {cache.dtype}")
