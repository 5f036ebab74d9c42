"""The AWQ and GPTQ 4-bit packed weight layouts, read into Kestrel's one layout, and a
reference quantizer that writes them (tests, dummy weights; docs/ARCHITECTURE.md §6.4).

A linear layer y = x @ W.T with W [N, K] (N out_features, K in_features) is stored as 4-bit
integers q in 0..15 per element, in groups of G consecutive input columns (G divides K) that
share one fp16 scale s and one integer zero point z per output column: W[n, k] =
(q[k, n] - z[k // G, n]) * s[k // G, n].

AWQ (AutoAWQ, `WQLinear_GEMM`, quant_method "awq", version "gemm", zero_point true;
source: AutoAWQ awq/modules/linear/gemm.py `from_linear` and vLLM
model_executor/layers/quantization/awq_triton.py `AWQ_REVERSE_ORDER`):
  qweight int32 [K, N / 8]: 8 values of consecutive output columns per int32, nibble i (bits
    4i..4i+3) holding column 8c + AWQ_ORDER[i], AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7];
  qzeros int32 [K / G, N / 8]: the zero points z packed the same way;
  scales fp16 [K / G, N];  W = (q - z) * s.
GPTQ (AutoGPTQ / GPTQModel, quant_method "gptq", checkpoint_format "gptq" = v1; source:
AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py `pack`, GPTQModel's v1 format):
  qweight int32 [K / 8, N]: 8 values of consecutive input rows per int32, row 8r + j in nibble j
    (low bits first);
  qzeros int32 [K / G, N / 8]: zero points packed along N in natural order (nibble j = column
    8c + j), stored as z - 1 ("v1": the reader adds 1 back, so a stored 15 means 16);
  scales fp16 [K / G, N]; g_idx int32 [K] optional (k // G without act-order; another g_idx,
  desc_act true, is refused: no reordering here);  W = (q - (stored_z + 1)) * s.

Kestrel's layout (`kernels.w4a16_linear.W4Weight`), one for both: qweight int32 [K / 8, N]
packed along K as GPTQ's, zeros uint8 [K / G, N] (the real zero point, 0..16), scales fp16
[K / G, N]. Values are in two's-complement int32; a nibble is (word >> 4i) & 15.

The reference quantizer (`quantize_groups`) is AutoAWQ's / GPTQ's round-to-nearest min-max
(no activation-aware search, no Hessian updates: the layout, not the quantizer, is what the
kernels read): asymmetric s = (max - min) / 15 per group, z = clamp(round(-min / s), 0, 15),
q = clamp(round(w / s) + z, 0, 15); symmetric (GPTQ sym) s = 2 max|w| / 15, z = 8.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column 8c + AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j sits in nibble AWQ_REVERSE_ORDER[j]
NATURAL_ORDER = tuple(range(8))
PACK = 8  # 4-bit values per int32


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    """int64 words in 0..2^32-1 as int32 (two's complement, the bit pattern kept)."""
    return torch.where(v >= 2 ** 31, v - 2 ** 32, v).to(torch.int32)


def pack_cols(q: torch.Tensor, order: tuple[int, ...] = NATURAL_ORDER) -> torch.Tensor:
    """q [R, C] integers 0..15 (C a multiple of 8) -> int32 [R, C / 8]: nibble i of word c holds
    column 8c + order[i]. Raises ValueError for C not a multiple of 8 or values outside 0..15."""
    r, c = q.shape
    if c % PACK or (q.numel() and (int(q.min()) < 0 or int(q.max()) > 15)):
        raise ValueError(f"pack: {tuple(q.shape)} needs a multiple of 8 columns of values 0..15")
    g = q.to(torch.int64).reshape(r, c // PACK, PACK)
    out = torch.zeros(r, c // PACK, dtype=torch.int64, device=q.device)
    for i, col in enumerate(order):
        out |= g[:, :, col] << (4 * i)
    return _to_int32(out)


def unpack_cols(p: torch.Tensor, order: tuple[int, ...] = NATURAL_ORDER) -> torch.Tensor:
    """The inverse of `pack_cols`: int32 [R, C / 8] -> int64 [R, C] values 0..15."""
    r, c8 = p.shape
    w = p.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(r, c8, PACK, dtype=torch.int64, device=p.device)
    for i, col in enumerate(order):
        out[:, :, col] = (w >> (4 * i)) & 0xF
    return out.reshape(r, c8 * PACK)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] integers 0..15 (K a multiple of 8) -> int32 [K / 8, N], row 8r + j in nibble j
    of word r (GPTQ's qweight, Kestrel's layout)."""
    return pack_cols(q.t()).t().contiguous()


def unpack_rows(p: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_rows`: int32 [K / 8, N] -> int64 [K, N] values 0..15."""
    return unpack_cols(p.t().contiguous()).t().contiguous()


def quantize_groups(w: torch.Tensor, group_size: int, sym: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit quantization of w [N, K] (any float; fp32 math) in groups of
    group_size input columns (module docstring): returns (q int64 [K, N] 0..15, z int64
    [K / G, N] 0..15, s fp16 [K / G, N]), with W ~ (q - z[k // G]) * s[k // G]; s is at
    least 2^-14 (fp16's smallest normal; a constant group). Raises ValueError when group_size does not divide K."""
    n, k = w.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"quantize: group size {group_size} does not divide K = {k}")
    g = w.float().t().reshape(k // group_size, group_size, n)
    if sym:
        amax = g.abs().amax(dim=1)
        s = (2 * amax / 15).clamp_min(2.0 ** -14).half().float()
        z = torch.full_like(s, 8.0)
    else:
        lo, hi = g.amin(dim=1), g.amax(dim=1)
        s = ((hi - lo) / 15).clamp_min(2.0 ** -14).half().float()
        z = torch.round(-lo / s).clamp(0, 15)
    q = torch.clamp(torch.round(g / s[:, None, :]) + z[:, None, :], 0, 15)
    return q.reshape(k, n).to(torch.int64), z.to(torch.int64), s.half()


def dequantize_groups(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 W [N, K] of q [K, N], z [K / G, N], s [K / G, N]: W[n, k] = (q[k, n] - z[g, n]) *
    s[g, n], g = k // G (the per-element math of both formats)."""
    k = q.shape[0]
    rep = k // z.shape[0]
    zf = z.float().repeat_interleave(rep, dim=0)
    sf = s.float().repeat_interleave(rep, dim=0)
    return ((q.float() - zf) * sf).t().contiguous()


def to_awq(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> dict[str, torch.Tensor]:
    """AWQ checkpoint tensors {qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16
    [K/G, N]} of quantized values (`quantize_groups`)."""
    return {"qweight": pack_cols(q, AWQ_ORDER), "qzeros": pack_cols(z, AWQ_ORDER), "scales": s.half()}


def to_gptq(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: bool = True) -> dict[str, torch.Tensor]:
    """GPTQ v1 checkpoint tensors {qweight int32 [K/8, N], qzeros int32 [K/G, N/8] (z - 1, as
    a nibble: a zero of 0 is stored as 15 and reads back as 16, v1's wrap), scales fp16
    [K/G, N], g_idx int32 [K] (k // G; left out with g_idx False)}."""
    k, g = q.shape[0], z.shape[0]
    out = {"qweight": pack_rows(q), "qzeros": pack_cols((z - 1) & 0xF), "scales": s.half()}
    if g_idx:
        out["g_idx"] = (torch.arange(k) // (k // g)).to(torch.int32)
    return out


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kestrel's (qweight int32 [K/8, N], zeros uint8 [K/G, N], scales fp16 [K/G, N]) of AWQ
    tensors (module docstring). Raises ValueError for shapes that do not fit together."""
    k, n8 = qweight.shape
    if k % PACK or qzeros.shape[1] != n8 or scales.shape != (qzeros.shape[0], n8 * PACK) or \
            qzeros.shape[0] == 0 or k % qzeros.shape[0]:
        raise ValueError(f"awq: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, scales "
                         f"{tuple(scales.shape)} do not fit [K, N/8], [K/G, N/8], [K/G, N] (K a multiple of 8)")
    q = unpack_cols(qweight, AWQ_ORDER)
    z = unpack_cols(qzeros, AWQ_ORDER)
    return pack_rows(q), z.to(torch.uint8), scales.half().contiguous()


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kestrel's (qweight, zeros, scales) of GPTQ v1 tensors (module docstring): qweight kept,
    zeros = stored + 1. Raises ValueError for shapes that do not fit, or a g_idx other than
    k // G (act-order, desc_act true)."""
    k8, n = qweight.shape
    groups = qzeros.shape[0]
    if qzeros.shape[1] * PACK != n or scales.shape != (groups, n) or groups == 0 or (k8 * PACK) % groups:
        raise ValueError(f"gptq: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, scales "
                         f"{tuple(scales.shape)} do not fit [K/8, N], [K/G, N/8], [K/G, N]")
    k = k8 * PACK
    if g_idx is not None:
        want = torch.arange(k, device=g_idx.device) // (k // groups)
        if g_idx.shape != (k,) or not torch.equal(g_idx.to(torch.int64), want):
            raise ValueError("gptq: g_idx is not k // group_size (act-order weights, desc_act true); "
                             "Kestrel does not reorder: use a checkpoint quantized with desc_act false")
    z = unpack_cols(qzeros) + 1
    return qweight.contiguous(), z.to(torch.uint8), scales.half().contiguous()
