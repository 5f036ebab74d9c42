"""GGUF's 4-bit blocks as int4 groups of 32 in the tinygemm format of the CPU int4 kernel.

The CPU int4 kernel (`torch.ops.aten._weight_int4pack_mm_for_cpu`, kernels/cpu_quant_linear.py)
reads w = (q - 8) * scale + zero, q in 0..15, one (scale, zero) per group of G consecutive
input columns of one output row (checked against the kernel itself by a round trip:
tests/unit/test_gguf_quant.py). ggml's 4-bit types are such groups, G = 32, along a row's K
(ggml's ne[0]; GGUF rows are output channels), so their codes are taken as they are and only
the scale and zero are re-expressed:

- Q4_0 (block of 32, 18 bytes: d fp16, 16 bytes of nibbles): w = d * (q - 8)
  -> scale = d, zero = 0;
- Q4_1 (block of 32, 20 bytes: d fp16, m fp16, nibbles): w = d * q + m
  -> scale = d, zero = m + 8 d;
- Q4_K (super-block of 256, 144 bytes: d fp16, dmin fp16, 12 bytes of 6-bit sub-block scales
  sc_j and mins m_j, j = 0..7, then 128 bytes of nibbles): w = d sc_j q - dmin m_j per
  sub-block j of 32 -> scale = d sc_j, zero = 8 d sc_j - dmin m_j.

In a block of 32 of Q4_0 / Q4_1, byte i holds element i (low nibble) and i + 16 (high); in
Q4_K each 32-byte chunk c of the nibbles holds sub-block 2c (low nibbles) and 2c + 1 (high),
and the 6-bit scales and mins are packed as ggml's `get_scale_min_k4` reads them (bytes 0-3:
sc_0..3 and the top bits of sc_4..7; 4-7: m_0..3 and the top bits of m_4..7; 8-11: the low
nibbles of sc_4..7 and m_4..7). Source: ggml's docs and ggml-quants.c (block_q4_0, block_q4_1,
block_q4_K, dequantize_row_*), as the `gguf` package's quants.py implements them; its
`dequantize` is the truth in the tests.

The scale and zero are computed in fp32 (exact for scale: an fp16 times a 6-bit integer) and
stored in the kernel's bf16 (cpu_quant_linear.ACT_DTYPE): that rounding, at most 2^-8 of
|scale| and |zero| relative, is the only change to the GGUF's weights. Q8_0 (w = d q, q an
int8, one d per 32) has no such form: per-channel int8 would need one scale per row, int4
16 levels; the loader dequantizes it (services/worker/gguf_loader.py).
"""

from __future__ import annotations

import torch

GROUP = 32  # elements per (scale, zero) of every type below
# GGML type name -> (elements per block, bytes per block)
INT4_TYPES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian fp16 bytes) -> [...] fp32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., B] uint8 -> [..., 2, B] of 0..15: the low nibbles, then the high ones."""
    return torch.stack([qs & 15, qs >> 4], dim=-2)


def q4k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 scale bytes [..., 12] uint8 -> (sc, m), each [..., 8] int32 of 0..63
    (ggml's get_scale_min_k4)."""
    s = packed.to(torch.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc, mn


def int4_groups(blocks: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tinygemm groups of a GGUF tensor's raw rows.

    blocks: uint8 [N, bytes per row] (a GGUF tensor's data as the `gguf` reader gives it for
    a 2-D quantized tensor: row n is output channel n, its blocks in K order).
    qtype: "Q4_0", "Q4_1" or "Q4_K" (`INT4_TYPES`).
    Returns (q uint8 [N, K] of 0..15, scale fp32 [N, K / 32], zero fp32 [N, K / 32]) with
    (q - 8) * scale + zero the GGUF's dequantized values (fp32 rounding aside).
    Raises ValueError for another type or a row length that is not whole blocks.
    """
    if qtype not in INT4_TYPES:
        raise ValueError(f"int4_groups: {qtype!r} is not one of {tuple(INT4_TYPES)}")
    per, size = INT4_TYPES[qtype]
    n, nbytes = blocks.shape
    if blocks.dtype != torch.uint8 or nbytes % size:
        raise ValueError(f"int4_groups: {qtype} rows of {nbytes} bytes ({blocks.dtype}) are not whole "
                         f"blocks of {size} bytes")
    nb = nbytes // size
    b = blocks.reshape(n, nb, size)
    if qtype == "Q4_K":
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]  # [N, nb, 1]
        sc, mn = q4k_scale_min(b[..., 4:16])  # [N, nb, 8]
        q = _nibbles(b[..., 16:144].reshape(n, nb, 4, 32))  # [N, nb, 4, 2, 32]: sub-block 2c + h
        scale = d * sc.float()
        zero = 8.0 * scale - dmin * mn.float()
        return q.reshape(n, nb * per), scale.reshape(n, -1), zero.reshape(n, -1)
    d = _f16(b[..., 0:2])  # [N, nb]
    q = _nibbles(b[..., size - 16:]).reshape(n, nb * per)  # [N, nb, 2, 16]: elements i, i + 16
    zero = torch.zeros_like(d) if qtype == "Q4_0" else _f16(b[..., 2:4]) + 8.0 * d
    return q, d, zero
