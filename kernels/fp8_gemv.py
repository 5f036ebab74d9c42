"""Triton kernels of the FP8-weight linear layer (`kernels.fp8_linear`, docs/ARCHITECTURE.md §6.4):
y [M, N] = x [M, K] @ (q [N, K] * scale [N, 1]).T (+ bias) for few rows, and the per-row
(per-token) e4m3 quantization of activations for the W8A8 product of many rows.

Why: a decode step at batch 1..16 reads every weight once and does little else, so its time
is the weight bytes; e4m3 weights are half of bf16's. These kernels read q in fp8, convert
each element to fp32 (one row, `fp8_gemv_triton` at M = 1) or to x's dtype for the
tensor-core dot (2..16 rows), accumulate in fp32 and multiply by the row scale once, in
the epilogue (x stays in its dtype: W8A16, no activation rounding).

The weight is passed as its bytes (uint8) and bitcast to e4m3 after the load, so that
masked lanes load integer zeros (+0.0) with no fp8 constant to convert.

Structure, as the bf16 kernels they follow:
- one row (ONE_ROW "gemv", `fp8_gemv_fused`): `kernels.gemv`'s own kernel on the e4m3 bytes,
  so the FP8 product has what the bf16 one has: programmatic dependent launch with the q
  tile loaded before the wait (the weight stream overlaps the kernel before), K splits
  summed inside the kernel by the last program of a row tile (no second launch), and the
  fused layer path's RMSNorm / SiLU-and-mul prologue and residual epilogue
  (`services.worker.fusion`); the row scale multiplies the fp32 sum before the bias. Program
  (n, s) loads its whole [BLOCK_N, BLOCK_K] tile of q at once (no K loop; BLOCK_K = next
  power of two of the split's columns), multiplies by x in fp32 and sums along K. The plan
  (`fp8_gemv_plan`) is PLANS[(N, K)] (benchmarks/qgemv_sweep.py) or
  `kernels.gemv.heuristic_plan`: at most tile_elems q elements a program, K split in ranges
  of at most max_block_k, row tiles halved until programs_per_sm programs per SM.
  ONE_ROW "legacy" (`_fp8_gemv_kernel`, the same layout without PDL, fused steps or the
  in-kernel sum) is kept for the A/B and as the fallback inside CUDA-graph capture when the
  split counters are not allocated yet.
- 2..64 rows (`_fp8_skinny_kernel`, `kernels.linear`'s skinny layout): x padded to 16 rows
  for `tl.dot`, a program owns BLOCK_N output columns and walks its K range in BLOCK_K tiles;
  K split until the grid has programs_per_sm programs per SM (at most 8 splits).
- with a K split the legacy one-row and the skinny kernel store fp32 partials [SPLIT, M, N] and a second kernel
  (`_fp8_split_sum_kernel`) sums them in split order (deterministic), then scales, adds
  the bias and rounds once. No counters, no atomics: safe in CUDA-graph capture.
Rounding: y = round(acc * scale + bias) in fp32, one rounding to x's dtype; the reference
(`kernels.fp8_linear.fp8_linear_ref`) multiplies by the dequantized weight instead, so
the two differ by fp32 rounding and summation order only.

`quant_rows_triton`: one program a row; pass 1 the row's absmax, scale = amax / 448 (1 for a
zero row), pass 2 q = e4m3(x / scale) (hardware round to nearest even, saturating), zero
columns up to the padded width. Triton's fp32 division is not IEEE-exact, so a value on a
rounding tie may land one e4m3 step from `quantize_fp8_rows`' (the GPU tests allow it).
Under the Triton interpreter (triton 3.9 CPU) the fp32 -> e4m3 cast rounds wrongly at
binade edges (31.7 -> 16.0), so this kernel is checked on the GPU only; fp8 loads and the
e4m3 -> fp32 conversion are exact there, and the matmul kernels are checked under it.
Measured (the legacy one-row kernel, unfused layers): docs/ARCHITECTURE.md §6.4; the gemv-based
one-row path is not measured yet (scripts/gpu_qgemv.sh).
"""

from __future__ import annotations

import torch

from kernels import gemv
from kernels.device_info import num_sms
from kernels.gemv import heuristic_plan

# one-row plan (as kernels.gemv.TUNING): at most tile_elems q elements a program, K ranges of
# at most max_block_k, at least programs_per_sm programs per SM (narrower row tiles first).
# Twice kernels.gemv's elements on twice its warps: the same 16 KB of weight a program, and
# the same fp32 values a thread, as the bf16 kernel (a guess, not measured yet)
GEMV_TUNING: dict = {"tile_elems": 16384, "max_block_k": 8192, "programs_per_sm": 2, "num_warps": 8}
# The one-row kernel: "gemv" = kernels.gemv's kernel on the e4m3 bytes (PDL with the weight load
# before the wait, the in-kernel split-K sum, the fused RMSNorm / SiLU-and-mul prologue and
# residual epilogue: `fp8_gemv_fused`); "legacy" = `_fp8_gemv_kernel` below (no PDL, a second
# kernel for split sums, no fused steps). benchmarks/decode_latency.py's fp8_one_row knob A/Bs them.
ONE_ROW = "gemv"
ONE_ROW_KERNELS = ("gemv", "legacy")
# (N, K) -> (block_n, split, num_warps) of the one-row kernel, from benchmarks/qgemv_sweep.py
# (decode_latency.py --fp8-plans); USE_PLANS False takes the heuristic for every shape
# Llama-3.1-8B's shapes from the 2026-12-03 H200 sweep (qgemv_sweep.py; decode_latency.py --ab q_old
# q_unfused: 3.06 -> 2.97 ms a token, benchmarks/results/2026-12-03_h200_qgemv_summary.json)
PLANS: dict[tuple[int, int], tuple[int, int, int]] = {
    (6144, 4096): (8, 1, 4), (4096, 4096): (8, 1, 4), (28672, 4096): (8, 1, 4), (4096, 14336): (8, 4, 4)}
USE_PLANS = True
# 2..64 rows (as kernels.linear.SKINNY_TUNING, K tile in fp8 elements)
SKINNY_TUNING: dict = {"block_k": 256, "programs_per_sm": 1, "num_warps": 4, "num_stages": 3}
QUANT_BLOCK = 1024  # columns a step of the activation quantizer
FP8_MAX = 448.0  # the largest finite float8_e4m3fn value (also kernels.fp8_linear.FP8_MAX)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: kernels.fp8_linear keeps its torch paths
    triton = None

fp8_gemv_triton = None  # set below when Triton imports
fp8_gemv_fused = None
quant_rows_triton = None


def _pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_gemv_plan(n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, SPLIT, num_warps) of the one-row kernel for q [n, k] (see the module
    docstring): PLANS[(n, k)] when USE_PLANS and present, else `kernels.gemv.heuristic_plan`
    with GEMV_TUNING."""
    if USE_PLANS and (n, k) in PLANS:
        return PLANS[(n, k)]
    return heuristic_plan(n, k, device, GEMV_TUNING)


def fp8_skinny_plan(n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT) of the 2..64-row kernel for q [n, k]: BLOCK_N 16..64 by the
    width, then K split (in whole BLOCK_K tiles, at most 8) until SKINNY_TUNING's
    programs_per_sm programs per SM (`kernels.linear.skinny_plan`'s rule)."""
    bn = 64 if n >= 32768 else 32 if n >= 8192 else 16
    bk = SKINNY_TUNING["block_k"]
    programs, split = -(-n // bn), 1
    max_split = max(1, min(8, -(-k // bk)))
    target = SKINNY_TUNING["programs_per_sm"] * num_sms(device)
    while programs * split < target and split < max_split:
        split *= 2
    return bn, bk, min(split, max_split)


if triton is not None:

    @triton.jit
    def _fp8_store(acc, s_ptr, b_ptr, y_ptr, rm, rn, mmask, nmask, sy_m, HAS_BIAS: tl.constexpr):
        """y[rm, rn] = round(acc * scale[rn] (+ bias[rn])) for acc [BLOCK_M, BLOCK_N] fp32."""
        acc = acc * tl.load(s_ptr + rn, mask=nmask, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * sy_m + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def _fp8_store_row(acc, s_ptr, b_ptr, y_ptr, rn, nmask, HAS_BIAS: tl.constexpr):
        """One row: y[rn] = round(acc * scale[rn] (+ bias[rn])) for acc [BLOCK_N] fp32."""
        acc = acc * tl.load(s_ptr + rn, mask=nmask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=nmask)

    @triton.jit
    def _fp8_gemv_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, N, K, sq_n, k_per_split,
                         HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        # x: [K], q: [N, K] e4m3 bytes (uint8, row stride sq_n), s: [N] fp32, y: [N]; ws: [SPLIT, N] fp32
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        rk = pid_k * k_per_split + kk
        nmask = rn < N
        kmask = (kk < k_per_split) & (rk < K)
        q = tl.load(q_ptr + rn.to(tl.int64)[:, None] * sq_n + rk[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        x = tl.load(x_ptr + rk, mask=kmask, other=0.0)
        acc = tl.sum(q.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        if SPLIT:
            tl.store(ws_ptr + pid_k * N + rn, acc, mask=nmask)
        else:
            _fp8_store_row(acc, s_ptr, b_ptr, y_ptr, rn, nmask, HAS_BIAS)

    @triton.jit
    def _fp8_skinny_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, sx_m, sq_n, sy_m,
                           k_per_split, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # grid (N tiles, K splits). x: [M, K], q: [N, K] e4m3 bytes (uint8), s: [N] fp32, y: [M, N];
        # ws: [SPLIT, M, N] fp32 partials
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        nmask = rn < N
        mmask = rm < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        q_rows = q_ptr + rn.to(tl.int64)[:, None] * sq_n
        x_rows = x_ptr + rm[:, None] * sx_m
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < k_hi
            q = tl.load(q_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                        other=0).to(tl.float8e4nv, bitcast=True)
            x = tl.load(x_rows + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            # e4m3 -> fp16 (the hardware conversion) -> x's dtype: exact, every e4m3 value is a
            # bf16 and an fp16 one
            acc += tl.dot(x, tl.trans(q.to(tl.float16).to(x.dtype)))
        if SPLIT:
            tl.store(ws_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc,
                     mask=mmask[:, None] & nmask[None, :])
        else:
            _fp8_store(acc, s_ptr, b_ptr, y_ptr, rm, rn, mmask, nmask, sy_m, HAS_BIAS)

    @triton.jit(do_not_specialize=["M", "n_splits"])
    def _fp8_split_sum_kernel(ws_ptr, s_ptr, b_ptr, y_ptr, M, N, sy_m, n_splits,
                              HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        # y[m] = scale * (sum over splits of ws[s, m], in split order) + bias
        m = tl.program_id(0)
        rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        nmask = rn < N
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(0, n_splits):
            acc += tl.load(ws_ptr + (s * M + m) * N + rn, mask=nmask, other=0.0)
        _fp8_store_row(acc, s_ptr, b_ptr, y_ptr + m * sy_m, rn, nmask, HAS_BIAS)

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, K_OUT, sx_m, BLOCK: tl.constexpr):
        # one row m: s[m] = max|x[m]| / 448 (1 when 0), q[m, :K] = e4m3(x / s), q[m, K:K_OUT] = 0
        m = tl.program_id(0)
        row = x_ptr + m.to(tl.int64) * sx_m
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            rk = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(row + rk, mask=rk < K, other=0.0).to(tl.float32)))
        a = tl.max(amax, axis=0)
        s = tl.where(a > 0, a / 448.0, 1.0)
        out = q_ptr + m.to(tl.int64) * K_OUT
        for k0 in range(0, K_OUT, BLOCK):
            rk = k0 + tl.arange(0, BLOCK)
            x = tl.load(row + rk, mask=rk < K, other=0.0).to(tl.float32)
            v = tl.minimum(tl.maximum(x / s, -448.0), 448.0)
            tl.store(out + rk, v.to(q_ptr.dtype.element_ty), mask=rk < K_OUT)
        tl.store(s_ptr + m, s)

    def fp8_gemv_triton(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None = None, *, n: int | None = None,
                        block_n: int | None = None, split: int | None = None,
                        num_warps: int | None = None, one_row: str | None = None) -> torch.Tensor:
        """y [M, n] = x @ (qweight[:n, :K] * scale[:n, None]).T (+ bias), in x's dtype.

        x: [M, K], 1 <= M <= 64, bf16/fp16 (fp32 works: tl.dot then runs in tf32), unit
        column stride (rows may be strided). qweight: float8_e4m3fn [N', K'] with K' >= K
        and unit stride along K (columns past K are not read). scale: fp32 [N'] (>= n).
        bias: [n] or None. n: output columns (default N'). M = 1 takes the one-row kernel,
        2..64 the skinny one; block_n / split / num_warps override the one-row plan (tests);
        one_row ("gemv" / "legacy") overrides ONE_ROW (the kernel at M = 1; "gemv" falls back
        to "legacy" when its split counters cannot be had inside CUDA-graph capture).
        Raises ValueError for M outside 1..64, K' < K, strided K dimensions, a non-fp8
        weight or a scale shorter than n.
        """
        m, k = x.shape
        rows, kq = qweight.shape
        n = rows if n is None else n
        if (not 1 <= m <= 64 or kq < k or n > rows or x.stride(1) != 1 or qweight.stride(1) != 1
                or qweight.dtype != torch.float8_e4m3fn or scale.numel() < n):
            raise ValueError(f"fp8 gemv: x {tuple(x.shape)} stride {tuple(x.stride())}, qweight "
                             f"{tuple(qweight.shape)} {qweight.dtype} stride {tuple(qweight.stride())}, "
                             f"scale {tuple(scale.shape)}, n={n}: want 1..64 rows, K <= K', unit K strides")
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if n == 0:
            return y
        if k == 0:
            return y.zero_() if bias is None else y.copy_(bias.expand(m, n))
        b = y if bias is None else bias
        qb = qweight.view(torch.uint8)  # loaded as bytes, bitcast to e4m3 in the kernels
        if m == 1 and (one_row or ONE_ROW) == "gemv":
            yg = fp8_gemv_fused(x, qweight, scale, bias, n=n, block_n=block_n, split=split, num_warps=num_warps)
            if yg is not None:
                return yg
        if m == 1:
            bn, sp, warps = fp8_gemv_plan(n, k, x.device)
            bn = block_n or bn
            k_per = -(-k // max(1, min(split or sp, k)))
            bk, sp = _pow2(k_per), -(-k // k_per)  # no empty trailing split
            ws = torch.empty((sp, n), dtype=torch.float32, device=x.device) if sp > 1 else y
            _fp8_gemv_kernel[(-(-n // bn), sp)](x, qb, scale, b, y, ws, n, k, qweight.stride(0), k_per,
                                               HAS_BIAS=bias is not None, SPLIT=sp > 1, BLOCK_N=bn,
                                               BLOCK_K=bk, num_warps=num_warps or warps)
        else:
            bn, bk, sp = fp8_skinny_plan(n, k, x.device)
            bn, sp = max(16, block_n or bn), max(1, split or sp)  # tl.dot: tiles of 16+
            k_per = _cdiv(_cdiv(k, sp), bk) * bk  # whole K tiles a split
            sp = _cdiv(k, k_per)  # no empty trailing split
            ws = torch.empty((sp, m, n), dtype=torch.float32, device=x.device) if sp > 1 else y
            _fp8_skinny_kernel[(-(-n // bn), sp)](
                x, qb, scale, b, y, ws, m, n, k, x.stride(0), qweight.stride(0), y.stride(0), k_per,
                HAS_BIAS=bias is not None, SPLIT=sp > 1, BLOCK_M=max(16, _pow2(m)), BLOCK_N=bn,
                BLOCK_K=bk, num_warps=num_warps or SKINNY_TUNING["num_warps"],
                num_stages=SKINNY_TUNING["num_stages"])
        if sp > 1:
            blk = 1024
            _fp8_split_sum_kernel[(m, -(-n // blk))](ws, scale, b, y, m, n, y.stride(0), sp,
                                                     HAS_BIAS=bias is not None, BLOCK=blk)
        return y

    def fp8_gemv_fused(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None, *, n: int | None = None,
                       norm_weight: torch.Tensor | None = None, eps: float = 1e-6, silu_mul: bool = False,
                       residual: torch.Tensor | None = None, block_n: int | None = None,
                       split: int | None = None, num_warps: int | None = None,
                       pdl: bool | None = None) -> torch.Tensor | None:
        """One row on `kernels.gemv`'s kernel with e4m3 weights: y [1, n] =
        prologue(x) @ (qweight[:n, :K] * scale[:n, None]).T (+ bias) (+ residual), in x's dtype,
        as `kernels.fp8_linear.fp8_linear_fused_ref` (prologue: the RMSNorm with norm_weight
        [K], or the SiLU-and-mul of x [1, 2K] with silu_mul; not both; the residual [1, n]
        added after the rounding, in fp32, rounded again).
        x: [1, K] (or [1, 2K]) bf16 / fp16 (fp32 works), unit column stride; qweight
        float8_e4m3fn [N', K'] (K' >= K, unit K stride), scale fp32 [N' >= n]. Plan:
        `fp8_gemv_plan`, entries overridden by block_n / split / num_warps; pdl overrides
        `kernels.pdl.use_pdl`. Returns None when the split counters cannot be had inside
        CUDA-graph capture (the caller takes the legacy kernel and ops). Raises ValueError
        as `kernels.gemv.gemv_triton`."""
        rows = qweight.shape[0] if n is None else n
        k = x.shape[-1] // 2 if silu_mul else x.shape[-1]
        return gemv.gemv_triton(x, qweight, bias, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul,
                                residual=residual, block_n=block_n, split=split, num_warps=num_warps, pdl=pdl,
                                scale=scale, n=rows, plan=fp8_gemv_plan(rows, k, x.device))

    def quant_rows_triton(x: torch.Tensor, k_out: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row e4m3 quantization of x [M, K] (bf16/fp16/fp32, unit column stride):
        returns (q float8_e4m3fn [M, k_out] contiguous, the columns past K zero; scale fp32
        [M, 1]), q * scale ~ x as `kernels.fp8_linear.quantize_fp8_rows` makes them (up to
        one e4m3 step on division ties: module docstring). k_out defaults to K.
        Raises ValueError for k_out < K or a strided K dimension."""
        m, k = x.shape
        k_out = k if k_out is None else k_out
        if k_out < k or (k and x.stride(1) != 1):
            raise ValueError(f"quant_rows: x {tuple(x.shape)} stride {tuple(x.stride())}, k_out {k_out}")
        q = torch.empty((m, k_out), dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
        if m:
            _quant_rows_kernel[(m,)](x, q, s, k, k_out, x.stride(0), BLOCK=QUANT_BLOCK, num_warps=4)
        return q, s
