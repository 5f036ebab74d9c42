"""Triton kernels of the W4A16 linear layer (`kernels.w4a16_linear`, docs/ARCHITECTURE.md §6.4):
y [M, N] = x [M, K] @ W.T (+ bias), W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n], with q
packed 8 to an int32 along K (qweight int32 [K / 8, N]), zeros uint8 [K / G, N], scales fp16
[K / G, N] (`kernels.w4a16_formats`, Kestrel's layout).

One kernel (`_w4_kernel`), grid (N tiles, K splits, M tiles). A program walks its K range in
tiles of BLOCK_K rows: it loads the tile's packed words [BLOCK_K / 8, BLOCK_N] (coalesced
along N), unpacks them with shifts into [BLOCK_K / 8, 8, BLOCK_N] (row 8r + j is nibble j of
word r), subtracts the zero point and multiplies by the scale in fp32, then
- ONE_ROW (M = 1, decode at batch 1): multiplies by x in fp32 and sums over K (FMAs, no
  tensor cores: a decode step is bound by the weight bytes);
- otherwise (2..16 rows in one 16-row tile, or prefill tiles of GEMM_TUNING's rows): reshapes
  the tile to [BLOCK_K, BLOCK_N], rounds it to x's dtype and accumulates tl.dot(x, w) in fp32.
ONE_GROUP: BLOCK_K divides G (and tiles start at multiples of BLOCK_K), so a tile has one
scale and zero row [BLOCK_N]; otherwise each packed row r gathers its group's (G a multiple
of 8: a word never spans two groups).
Few rows: K is split until the grid has GEMV_TUNING's programs per SM; the splits store fp32
partials [SPLIT, M, N] and `_w4_split_sum_kernel` sums them in split order (deterministic,
no atomics: safe in CUDA-graph capture), adds the bias and rounds once to x's dtype.
Structure after kernels/fp8_gemv.py (split-K GEMV) and the dequantize-in-registers GEMM of
vLLM's awq_triton.py; not tuned on a GPU at the time of writing (tuning dicts below).
The truth is `kernels.w4a16_linear.w4a16_linear_ref` (fp32 dequantized weight).
"""

from __future__ import annotations

import torch

from kernels.device_info import num_sms

# few rows: BLOCK_N columns a program, K tiles of (at most) block_k rows, K split until
# programs_per_sm programs per SM (at most max_split); GEMM: tiles of block_m x block_n
GEMV_TUNING: dict = {"block_n": 64, "block_k": 128, "programs_per_sm": 2, "max_split": 16, "num_warps": 4}
GEMM_TUNING: dict = {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 2}

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: kernels.w4a16_linear keeps its torch reference
    triton = None

w4_gemv_triton = None  # set below when Triton imports
w4_gemm_triton = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pick_block_k(group_size: int, target: int) -> tuple[int, bool]:
    """(BLOCK_K, ONE_GROUP): the largest power of two <= target, >= 16, dividing group_size
    (one scale row a tile), else target with per-row scale gathers."""
    bk = target
    while bk > 16 and group_size % bk:
        bk //= 2
    return (bk, True) if group_size % bk == 0 else (target, False)


def gemv_plan(n: int, k: int, group_size: int, device: torch.device) -> tuple[int, int, int, bool]:
    """(BLOCK_N, BLOCK_K, SPLIT, ONE_GROUP) of the few-rows kernel for W [n, k]: the K split
    doubles (whole BLOCK_K tiles, at most max_split) until programs_per_sm programs per SM."""
    bn = GEMV_TUNING["block_n"]
    bk, one = pick_block_k(group_size, GEMV_TUNING["block_k"])
    tiles, split = _cdiv(n, bn), 1
    most = max(1, min(GEMV_TUNING["max_split"], _cdiv(k, bk)))
    while tiles * split < GEMV_TUNING["programs_per_sm"] * num_sms(device) and split < most:
        split *= 2
    return bn, bk, min(split, most), one


if triton is not None:

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
    def _w4_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, G, sx_m, sy_m, k_per_split,
                   HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, ONE_ROW: tl.constexpr,
                   ONE_GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
        # grid (N tiles, K splits, M tiles); x [M, K], y [M, N]; ws [SPLIT, M, N] fp32 partials
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        KP: tl.constexpr = BLOCK_K // 8
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        if ONE_ROW:
            acc1 = tl.zeros([BLOCK_N], tl.float32)
            kk = tl.arange(0, KP)[:, None] * 8 + tl.arange(0, 8)[None, :]
            for k0 in range(k_lo, k_hi, BLOCK_K):
                w = _w4_tile(qw_ptr, z_ptr, s_ptr, k0, k_hi, rn, nmask, N, G, KP, ONE_GROUP)
                xv = tl.load(x_ptr + k0 + kk, mask=k0 + kk < k_hi, other=0.0).to(tl.float32)
                acc1 += tl.sum(tl.sum(w * xv[:, :, None], axis=1), axis=0)
            if SPLIT:
                tl.store(ws_ptr + pid_k * N + rn, acc1, mask=nmask)
            else:
                if HAS_BIAS:
                    acc1 += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
                tl.store(y_ptr + rn, acc1.to(y_ptr.dtype.element_ty), mask=nmask)
        else:
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            mmask = rm < M
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            x_rows = x_ptr + rm.to(tl.int64)[:, None] * sx_m
            for k0 in range(k_lo, k_hi, BLOCK_K):
                w = _w4_tile(qw_ptr, z_ptr, s_ptr, k0, k_hi, rn, nmask, N, G, KP, ONE_GROUP)
                rk = k0 + tl.arange(0, BLOCK_K)
                xv = tl.load(x_rows + rk[None, :], mask=mmask[:, None] & (rk < k_hi)[None, :], other=0.0)
                acc += tl.dot(xv, tl.reshape(w, (BLOCK_K, BLOCK_N)).to(xv.dtype))
            omask = mmask[:, None] & nmask[None, :]
            if SPLIT:
                tl.store(ws_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=omask)
            else:
                if HAS_BIAS:
                    acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptr + rm.to(tl.int64)[:, None] * sy_m + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                         mask=omask)

    @triton.jit(do_not_specialize=["M", "n_splits"])
    def _w4_split_sum_kernel(ws_ptr, b_ptr, y_ptr, M, N, sy_m, n_splits, HAS_BIAS: tl.constexpr,
                             BLOCK: tl.constexpr):
        # y[m] = (sum over splits of ws[s, m], in split order) + bias, rounded once
        m = tl.program_id(0)
        rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        nmask = rn < N
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(0, n_splits):
            acc += tl.load(ws_ptr + (s * M + m) * N + rn, mask=nmask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * sy_m + rn, acc.to(y_ptr.dtype.element_ty), mask=nmask)

    def _check(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
               group_size: int) -> tuple[int, int, int]:
        m, k = x.shape
        n = qweight.shape[1]
        groups = k // group_size if group_size > 0 else 0
        if (qweight.shape != (k // 8, n) or k % 8 or group_size <= 0 or group_size % 8 or k % group_size
                or zeros.shape != (groups, n) or scales.shape != (groups, n) or x.stride(1) != 1
                or not (qweight.is_contiguous() and zeros.is_contiguous() and scales.is_contiguous())):
            raise ValueError(f"w4a16: x {tuple(x.shape)} stride {tuple(x.stride())}, qweight "
                             f"{tuple(qweight.shape)}, zeros {tuple(zeros.shape)}, scales {tuple(scales.shape)}, "
                             f"group {group_size}: want [K/8, N], [K/G, N] contiguous, G a multiple of 8 "
                             "dividing K, x with unit column stride")
        return m, n, k

    def w4_gemv_triton(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                       group_size: int, bias: torch.Tensor | None = None, *, split: int | None = None,
                       block_n: int | None = None) -> torch.Tensor:
        """y [M, N] = x @ W.T (+ bias) in x's dtype for 1 <= M <= 16 (module docstring).

        x: [M, K] bf16 / fp16 (fp32 works: tl.dot then runs in tf32), unit column stride.
        qweight int32 [K / 8, N], zeros uint8 [K / G, N], scales fp16 [K / G, N], contiguous;
        bias [N] or None. split / block_n override the plan (tests). Raises ValueError for
        M outside 1..16 or tensors that do not fit."""
        m, n, k = _check(x, qweight, zeros, scales, group_size)
        if not 1 <= m <= 16:
            raise ValueError(f"w4a16 gemv: {m} rows, want 1..16 (w4_gemm_triton for more)")
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if n == 0:
            return y
        bn, bk, sp, one = gemv_plan(n, k, group_size, x.device)
        bn, sp = block_n or bn, max(1, split or sp)
        k_per = _cdiv(_cdiv(k, sp), bk) * bk  # whole K tiles a split (ONE_GROUP needs it)
        sp = _cdiv(k, k_per)
        ws = torch.empty((sp, m, n), dtype=torch.float32, device=x.device) if sp > 1 else y
        b = y if bias is None else bias
        _w4_kernel[(_cdiv(n, bn), sp, 1)](x, qweight, zeros, scales, b, y, ws, m, n, k, group_size,
                                          x.stride(0), y.stride(0), k_per, HAS_BIAS=bias is not None,
                                          SPLIT=sp > 1, ONE_ROW=m == 1, ONE_GROUP=one, BLOCK_M=16,
                                          BLOCK_N=bn, BLOCK_K=bk, num_warps=GEMV_TUNING["num_warps"])
        if sp > 1:
            blk = 1024
            _w4_split_sum_kernel[(m, _cdiv(n, blk))](ws, b, y, m, n, y.stride(0), sp,
                                                     HAS_BIAS=bias is not None, BLOCK=blk)
        return y

    def w4_gemm_triton(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                       group_size: int, bias: torch.Tensor | None = None, *,
                       tuning: dict | None = None) -> torch.Tensor:
        """y [M, N] = x @ W.T (+ bias) in x's dtype for any M (prefill; module docstring), tiles
        of GEMM_TUNING (or `tuning`), no K split. Tensors as `w4_gemv_triton`."""
        m, n, k = _check(x, qweight, zeros, scales, group_size)
        t = GEMM_TUNING if tuning is None else {**GEMM_TUNING, **tuning}
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if m == 0 or n == 0:
            return y
        bk, one = pick_block_k(group_size, t["block_k"])
        b = y if bias is None else bias
        grid = (_cdiv(n, t["block_n"]), 1, _cdiv(m, t["block_m"]))
        _w4_kernel[grid](x, qweight, zeros, scales, b, y, y, m, n, k, group_size, x.stride(0), y.stride(0), k,
                         HAS_BIAS=bias is not None, SPLIT=False, ONE_ROW=False, ONE_GROUP=one,
                         BLOCK_M=t["block_m"], BLOCK_N=t["block_n"], BLOCK_K=bk, num_warps=t["num_warps"],
                         num_stages=t["num_stages"])
        return y
