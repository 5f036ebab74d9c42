"""Triton GEMM of the W4A16 linear layer for more rows than the decode kernels take
(prefill chunks; `kernels.w4a16_linear`, docs/ARCHITECTURE.md §6.4): y [M, N] = x [M, K] @ W.T
(+ bias), W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n], with q packed 8 to an int32
along K (qweight int32 [K / 8, N]), zeros uint8 [K / G, N], scales fp16 [K / G, N]
(`kernels.w4a16_formats`, Kestrel's layout). 1..16 rows: `kernels.w4a16_gemv`.

`_w4_kernel`, grid (N tiles, M tiles): a program walks K in tiles of BLOCK_K rows: it loads
the tile's packed words [BLOCK_K / 8, BLOCK_N] (coalesced along N), unpacks them with shifts
into [BLOCK_K / 8, 8, BLOCK_N] (row 8r + j is nibble j of word r), subtracts the zero point
and multiplies by the scale in fp32, reshapes the tile to [BLOCK_K, BLOCK_N], rounds it to
x's dtype and accumulates tl.dot(x, w) in fp32; the bias is added before the one rounding.
ONE_GROUP: BLOCK_K divides G (and tiles start at multiples of BLOCK_K), so a tile has one
scale and zero row [BLOCK_N]; otherwise each packed row r gathers its group's (G a multiple
of 8: a word never spans two groups). The dequantize-in-registers GEMM of vLLM's
awq_triton.py; its tiles (GEMM_TUNING) were not tuned on a GPU.
The truth is `kernels.w4a16_linear.w4a16_linear_ref` (fp32 dequantized weight).
"""

from __future__ import annotations

import torch

from kernels.w4a16_gemv import pick_block_k

# tiles of block_m x block_n, K tiles of (at most) block_k rows
GEMM_TUNING: dict = {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 2}

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: kernels.w4a16_linear keeps its torch reference
    triton = None

w4_gemm_triton = None  # set below when Triton imports


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


if triton is not None:
    from kernels.w4a16_gemv import check_operands

    @triton.jit
    def _w4_tile(qw_ptr, z_ptr, s_ptr, k0, k_hi, rn, nmask, N, G, KP: tl.constexpr,
                 ONE_GROUP: tl.constexpr):
        """W rows k0 .. k0 + 8 KP of columns rn, dequantized in fp32: [KP, 8, BLOCK_N] (rows
        at or past k_hi are (0 - z) * s: callers zero them through x)."""
        rkp = k0 // 8 + tl.arange(0, KP)
        pmask = (rkp * 8 < k_hi)[:, None] & nmask[None, :]
        p = tl.load(qw_ptr + rkp.to(tl.int64)[:, None] * N + rn[None, :], mask=pmask, other=0)
        shifts = tl.arange(0, 8) * 4
        q = ((p[:, None, :] >> shifts[None, :, None]) & 0xF).to(tl.float32)
        if ONE_GROUP:
            g = k0 // G
            s = tl.load(s_ptr + g * N + rn, mask=nmask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g * N + rn, mask=nmask, other=0).to(tl.float32)
            w = (q - z[None, None, :]) * s[None, None, :]
        else:
            goff = ((rkp * 8) // G).to(tl.int64)[:, None] * N + rn[None, :]
            s = tl.load(s_ptr + goff, mask=pmask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + goff, mask=pmask, other=0).to(tl.float32)
            w = (q - z[:, None, :]) * s[:, None, :]
        return w

    @triton.jit
    def _w4_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, b_ptr, y_ptr, M, N, K, G, sx_m, sy_m, HAS_BIAS: tl.constexpr,
                   ONE_GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # grid (N tiles, M tiles); x [M, K], y [M, N]
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        KP: tl.constexpr = BLOCK_K // 8
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = rm < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * sx_m
        for k0 in range(0, K, BLOCK_K):
            w = _w4_tile(qw_ptr, z_ptr, s_ptr, k0, K, rn, nmask, N, G, KP, ONE_GROUP)
            rk = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_rows + rk[None, :], mask=mmask[:, None] & (rk < K)[None, :], other=0.0)
            acc += tl.dot(xv, tl.reshape(w, (BLOCK_K, BLOCK_N)).to(xv.dtype))
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * sy_m + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])

    def w4_gemm_triton(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                       group_size: int, bias: torch.Tensor | None = None, *,
                       tuning: dict | None = None) -> torch.Tensor:
        """y [M, N] = x @ W.T (+ bias) in x's dtype for any M (prefill; module docstring), tiles
        of GEMM_TUNING (or `tuning`). Tensors as `kernels.w4a16_gemv.w4_gemv_triton`; raises
        ValueError as it does for tensors that do not fit."""
        m, n, k = check_operands(x, qweight, zeros, scales, group_size)
        t = GEMM_TUNING if tuning is None else {**GEMM_TUNING, **tuning}
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if m == 0 or n == 0:
            return y
        bk, one = pick_block_k(group_size, t["block_k"])
        b = y if bias is None else bias
        grid = (_cdiv(n, t["block_n"]), _cdiv(m, t["block_m"]))
        _w4_kernel[grid](x, qweight, zeros, scales, b, y, m, n, k, group_size, x.stride(0), y.stride(0),
                         HAS_BIAS=bias is not None, ONE_GROUP=one,
                         BLOCK_M=t["block_m"], BLOCK_N=t["block_n"], BLOCK_K=bk, num_warps=t["num_warps"],
                         num_stages=t["num_stages"])
        return y
