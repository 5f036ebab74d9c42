"""Matrix-vector product of decode batch 1: y [1, N] = x [1, K] @ W [N, K].T (+ bias), with the
SiLU-and-mul of the MLP or the RMSNorm before the projection optionally applied to x as it is
loaded, and the residual add optionally applied to y. Up to MAX_ROWS rows of x run one after
the other over each program's W tile (`ROWS`: the rows `kernels.linear` sends here).

Why a second kernel beside `kernels.linear`'s skinny one: at batch 1 the step is ~110 such
products of 4-12 MB each (Qwen3-0.6B), each bound by reading W once, and each short enough
(a few microseconds) that its fixed costs (launch, the first DRAM round trip, the tail)
weigh as much as the stream. The skinny kernel pads x to 16 rows for a tensor-core dot,
which routes every W tile through shared memory in the dot's layout, and walks K in a
pipelined loop. Here a program loads its whole [BLOCK_N, BLOCK_K] W tile at once into
registers (16-byte vector loads, all in flight together), multiplies by x in fp32 and sums
along K: no shared-memory staging of W, no loop. And with programmatic dependent launch
(`kernels.pdl`) the W load goes before the wait on the kernel before, so a projection's
weight stream overlaps the small norm / attention / activation kernel that produces its x.

Grid (N / BLOCK_N, SPLIT): program (n, s) owns BLOCK_N rows of W over the s-th K range of
k_per_split columns (BLOCK_K = next power of two of k_per_split, masked). With SPLIT > 1
each program stores its fp32 partial; the last program of a row tile to arrive (CTA
barrier, acq_rel atomic on the shared per-device counters of `kernels.device_info`) sums
the partials in split order, deterministically, adds the bias, stores y and re-zeroes its
counter. Rounding matches `kernels.linear.linear_ref`: fp32 products and sums, bias added
in fp32, one rounding to the dtype (only the order of the fp32 sum differs from cuBLAS);
the residual is added to the rounded y in fp32 and rounded again (as `fused_add_rms_norm`).
With the norm, every program loads the whole row of x (a few KB, from L2) for its rstd,
then normalises its own K range as `rms_norm_ref` does; the sum of squares is one tree
reduction here, so a normalised value may round to its neighbour against kernels/norm.py.
The fused decoder layer at batch 1 (`services.worker.fusion`) is then 4 of these launches
and the attention, where the unfused layer adds two norm kernels.

FP8 weights (`scale` given: e4m3 bytes, bitcast after the load, fp32 row scales applied to the
sum before the bias) run the same kernel: `kernels.fp8_gemv.fp8_gemv_fused`, with its own plans.

`gemv_plan` picks (BLOCK_N, SPLIT, num_warps); `PLANS` holds explicit plans per (N, K)
(benchmarks/gemv_sweep.py measures them on a GPU), and `TUNING` the heuristic's knobs.
Measured on the H200 (gemv_sweep.py, Qwen3-0.6B, 28 distinct weights per shape in one CUDA
graph, per launch): qkv 5.6 -> 4.2 us against the skinny kernel, o_proj 6.3 -> 3.2, gate_up
6.9 -> 5.1, down 7.0 -> 3.8; with PDL 3.7 / 2.6 / 5.3 / 3.1 us. The tuned plans gave no TPOT
gain over the heuristic in decode_latency.py (1.071 against 1.046 ms), so none is committed.
"""

from __future__ import annotations

import torch

from kernels.device_info import num_sms, tile_counters
from kernels.linear_ref import linear_ref
from kernels.norm import rms_norm_ref
from kernels.pdl import launch_args, use_pdl

ENABLED = True  # the `linear` dispatcher takes this kernel for one-row CUDA inputs
# ... and for 2..ROWS rows (a verify step at batch 1 of k = 1: [last token, draft]; a decode step
# of 2 seqs) in place of the one-tile skinny kernel (`kernels.linear`); read at every call
# (docs/ARCHITECTURE.md §5.5). 1: the skinny kernel takes 2+ rows. Each row is a pass over the
# tile, so the time grows with the rows: H100, Qwen3-0.6B shape, graphs (scripts/gpu_gemvrows.sh,
# 2026-12-07): 2 rows, verify k = 1 at batch 1 1.39 -> 1.28 ms and a batch-2 decode 1.32 -> 1.26;
# 5 rows (k = 4) 1.42 -> 1.99 and 8 rows (a batch-8 decode) 1.71 -> 2.97: so 2.
ROWS = 2
MAX_ROWS = 16  # rows gemv_triton takes at most (each a pass over the program's W tile)
# heuristic plan: at most tile_elems W elements per program (registers), K ranges of at
# most max_block_k, and at least programs_per_sm programs per SM (narrower row tiles first)
TUNING: dict = {"tile_elems": 8192, "max_block_k": 4096, "programs_per_sm": 2, "num_warps": 4}
PLANS: dict[tuple[int, int], tuple[int, int, int]] = {}  # (N, K) -> (block_n, split, num_warps)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: `linear` keeps its other paths
    triton = None


def _pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def gemv_plan(n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, SPLIT, num_warps) for W [n, k]: PLANS[(n, k)] when present, else
    `heuristic_plan` with TUNING. `gemv_triton` derives BLOCK_K and the final split from
    SPLIT."""
    if (n, k) in PLANS:
        return PLANS[(n, k)]
    return heuristic_plan(n, k, device, TUNING)


def heuristic_plan(n: int, k: int, device: torch.device, tuning: dict) -> tuple[int, int, int]:
    """(BLOCK_N, SPLIT, num_warps) of a one-row kernel that loads a whole [BLOCK_N, BLOCK_K]
    tile a program, for a weight [n, k]: split K only when a row is longer than
    tuning["max_block_k"]; then halve BLOCK_N from tuning["tile_elems"] / BLOCK_K down to 2
    until the grid has tuning["programs_per_sm"] programs per SM. Shared by this kernel and
    the fp8-weight one (`kernels.fp8_gemv`), each with its own tuning dict."""
    split = 1
    while _pow2(-(-k // split)) > tuning["max_block_k"]:
        split *= 2
    bn = max(2, min(64, tuning["tile_elems"] // _pow2(-(-k // split))))
    target = tuning["programs_per_sm"] * num_sms(device)
    while bn > 2 and -(-n // bn) * split < target:
        bn //= 2
    return bn, split, tuning["num_warps"]


gemv_triton = None  # set below when Triton imports: the CUDA kernel (below)

if triton is not None:
    from kernels.pdl import pdl_release, pdl_wait

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, nw_ptr, r_ptr, xn_ptr, M, N, K, sw_n, sx_m,
                     sy_m, sr_m, sxn_m, k_per_split, eps, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                     NORM: tl.constexpr, HAS_RES: tl.constexpr, XN_OUT: tl.constexpr, SPLIT: tl.constexpr,
                     USE_PDL: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     ROW_K: tl.constexpr):
        # x: [M, K] ([M, 2K] = gate | up with SILU; row stride sx_m), W: [N, K] (row stride sw_n;
        # FP8: e4m3 bytes as uint8, s: [N] fp32 row scales), y: [M, N] (row stride sy_m); ws:
        # [SPLIT programs, M, N] fp32 partials and cnt: int32 per row tile (SPLIT only); nw: [K]
        # norm weight (NORM); r: [M, N] residual (HAS_RES, row stride sr_m); ROW_K: K rounded
        # up to a power of two (NORM); xn: [M, K] (XN_OUT, with NORM; row stride sxn_m), where the
        # programs of row tile 0 store the normalised x of their K range (the prologue's output, the
        # MoE experts' input: kernels.moe). M rows (MAX_ROWS at most) reuse the W tile held in
        # registers one after the other; M == 1 is specialised by Triton (an int argument of
        # 1 is a constant), so the one-row kernel is the loop's single trip.
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        rk = pid_k * k_per_split + kk
        nmask = rn < N
        kmask = (kk < k_per_split) & (rk < K)
        # W and the norm weight are written by no kernel of a step: their loads may run
        # before the wait
        w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * sw_n + rk[None, :]
        if FP8:  # bytes (masked lanes: integer 0 = +0.0), bitcast to e4m3
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        else:
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
        if NORM:
            nw = tl.load(nw_ptr + rk, mask=kmask, other=0.0)
        pdl_wait(USE_PDL)
        pdl_release(USE_PDL)
        for m in range(0, M):
            x_row = x_ptr + m * sx_m
            x = tl.load(x_row + rk, mask=kmask, other=0.0)
            if SILU:  # as silu_and_mul_ref: silu(gate) rounded, then the product rounded
                u = tl.load(x_row + K + rk, mask=kmask, other=0.0)
                gf = x.to(tl.float32)
                x = ((gf / (1.0 + tl.exp(-gf))).to(u.dtype).to(tl.float32) * u.to(tl.float32)).to(u.dtype)
            if NORM:  # as rms_norm_ref: rstd over the whole row, x * rstd rounded, times the weight rounded
                rowk = tl.arange(0, ROW_K)
                xr = tl.load(x_row + rowk, mask=rowk < K, other=0.0).to(tl.float32)
                rstd = tl.rsqrt(tl.sum(xr * xr, axis=0) / K + eps)
                xn = (x.to(tl.float32) * rstd).to(x.dtype)
                x = (xn.to(tl.float32) * nw.to(tl.float32)).to(x.dtype)
                if XN_OUT:
                    if pid_n == 0:
                        tl.store(xn_ptr + m * sxn_m + rk, x, mask=kmask)
            acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
            if SPLIT:
                tl.store(ws_ptr + (pid_k * M + m) * N + rn, acc, mask=nmask)
            else:
                _store_y(acc, s_ptr, b_ptr, r_ptr + m * sr_m, y_ptr + m * sy_m, rn, nmask, FP8, HAS_BIAS, HAS_RES)
        if SPLIT:
            tl.debug_barrier()  # every thread's partials are stored before the release below
            n_splits = tl.num_programs(1)
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == n_splits - 1:
                for m in range(0, M):
                    tot = tl.zeros([BLOCK_N], tl.float32)
                    for s in range(0, n_splits):  # split order: deterministic
                        tot += tl.load(ws_ptr + (s * M + m) * N + rn, mask=nmask, other=0.0, cache_modifier=".cg")
                    _store_y(tot, s_ptr, b_ptr, r_ptr + m * sr_m, y_ptr + m * sy_m, rn, nmask, FP8, HAS_BIAS,
                             HAS_RES)
                tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # zero for the next launch

    @triton.jit
    def _store_y(acc, s_ptr, b_ptr, r_ptr, y_ptr, rn, nmask, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HAS_RES: tl.constexpr):
        """y = round(acc (* row scale) + bias), then + residual in fp32 and rounded again
        (linear_ref's order; the scale as fp8_linear_ref's dequantized weight)."""
        if HAS_SCALE:
            acc = acc * tl.load(s_ptr + rn, mask=nmask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        out = acc.to(y_ptr.dtype.element_ty)
        if HAS_RES:
            r = tl.load(r_ptr + rn, mask=nmask, other=0.0)
            out = (out.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rn, out, mask=nmask)

    def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    norm_weight: torch.Tensor | None = None, eps: float = 1e-6, silu_mul: bool = False,
                    residual: torch.Tensor | None = None, block_n: int | None = None,
                    split: int | None = None, num_warps: int | None = None,
                    pdl: bool | None = None, scale: torch.Tensor | None = None, n: int | None = None,
                    plan: tuple[int, int, int] | None = None, xn_out: torch.Tensor | None = None
                    ) -> torch.Tensor | None:
        """`linear_ref(x, weight, bias, norm_weight=, eps=, silu_mul=, residual=)` for 1..MAX_ROWS
        rows: x [M, K] ([M, 2K] = cat(gate, up) with silu_mul; unit column stride, any row
        stride), weight [N, K] (unit stride along K), bias [N] or None, norm_weight [K] or
        None (the RMSNorm of each row of x, computed by every program over the whole row),
        residual [M, N] or None (added after the rounding, in fp32, rounded again); one half
        dtype (bf16/fp16; fp32 works too); norm_weight and silu_mul not both (`linear` checks
        the arguments). Each program loads its W tile once and runs the M rows over it in
        turn (the rows' products are each the one-row kernel's, bit for bit).
        FP8 weights (`kernels.fp8_gemv.fp8_gemv_fused`): scale fp32 [N'] given, weight
        float8_e4m3fn [N', K'] with N' >= n (default N') and K' >= K (K from x's width;
        columns past K and rows past n are not read); the product is then
        `kernels.fp8_linear.fp8_linear_ref`'s, the row scale applied to the fp32 sum before
        the bias.
        Returns y [M, N] in x's dtype, or None when the plan splits K and the split
        counters would have to be allocated inside CUDA-graph capture (the caller then uses
        another kernel).
        plan: (block_n, split, num_warps) in place of `gemv_plan`'s; block_n / split /
        num_warps override single entries (the sweep benchmarks); pdl overrides
        `kernels.pdl.use_pdl`.
        xn_out: with norm_weight, an [M, K] tensor of x's dtype (unit column stride) that
        receives the normalised rows (x * rstd rounded, times the weight rounded: the values the
        product used), stored by the programs of the first row tile; the MoE layers' experts
        read it (`services.worker.layers.moe.SparseMoeBlock.forward_fused`), so their norm
        needs no launch of its own.
        Raises ValueError for no rows or more than MAX_ROWS, x's width not K (2K with silu_mul),
        a strided K dimension, or an xn_out without norm_weight or of another shape or dtype.
        """
        rows, kw = weight.shape
        if scale is None:
            n, k = rows, kw
        else:
            k = x.shape[-1] // 2 if silu_mul else x.shape[-1]
            n = rows if n is None else n
        if (x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] != (2 * k if silu_mul else k)
                or x.stride(1) != 1
                or weight.stride(1) != 1 or k > kw or n > rows
                or (scale is not None and (weight.dtype != torch.float8_e4m3fn or scale.numel() < n))):
            raise ValueError(f"gemv: x {tuple(x.shape)} stride {tuple(x.stride())}, weight "
                             f"{tuple(weight.shape)} {weight.dtype} stride {tuple(weight.stride())}, n={n}: want 1.."
                             f"{MAX_ROWS} rows of {'2K' if silu_mul else 'K'} columns, unit stride along K (fp8: K <= K', "
                             "n <= N', an fp32 scale per row)")
        m = x.shape[0]
        if xn_out is not None and (norm_weight is None or tuple(xn_out.shape) != (m, k) or xn_out.dtype != x.dtype
                                   or xn_out.stride(1) != 1):
            raise ValueError(f"gemv: xn_out {tuple(xn_out.shape)} {xn_out.dtype} stride {tuple(xn_out.stride())}: "
                             f"want norm_weight and ({m}, {k}) {x.dtype} with unit column stride")
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if n == 0 or k == 0:
            # degenerate shapes: no kernel
            w = weight if scale is None else (weight[:n, :k].float() * scale[:n, None]).to(x.dtype)
            if xn_out is not None and norm_weight is not None:
                xn_out.copy_(rms_norm_ref(x, norm_weight, eps))
            return y.copy_(linear_ref(x, w, bias, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul,
                                      residual=residual))
        bn, sp, warps = plan or gemv_plan(n, k, x.device)
        bn = block_n or bn
        k_per = -(-k // max(1, min(split or sp, k)))  # K columns per split program
        bk, sp = _pow2(k_per), -(-k // k_per)  # no empty trailing split
        n_tiles = -(-n // bn)
        counters = tile_counters(x.device, n_tiles) if sp > 1 else y
        if counters is None:
            return None
        ws = torch.empty((sp, m, n), dtype=torch.float32, device=x.device) if sp > 1 else y
        if residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        if residual is not None and m > 1 and residual.shape[0] != m:
            raise ValueError(f"gemv: residual {tuple(residual.shape)} for {m} rows")
        pdl = use_pdl(x.device) if pdl is None else pdl
        w = weight if scale is None else weight.view(torch.uint8)  # fp8: bytes, bitcast in the kernel
        _gemv_kernel[(n_tiles, sp)](x, w, y if scale is None else scale, y if bias is None else bias, y, ws,
                                    counters, x if norm_weight is None else norm_weight,
                                    y if residual is None else residual, y if xn_out is None else xn_out, m, n, k,
                                    weight.stride(0), x.stride(0), y.stride(0),
                                    0 if residual is None else residual.stride(0),
                                    0 if xn_out is None else xn_out.stride(0), k_per, eps,
                                    HAS_BIAS=bias is not None, SILU=silu_mul, NORM=norm_weight is not None,
                                    HAS_RES=residual is not None, XN_OUT=xn_out is not None, SPLIT=sp > 1, USE_PDL=pdl, FP8=scale is not None,
                                    BLOCK_N=bn, BLOCK_K=bk, ROW_K=_pow2(k) if norm_weight is not None else 1,
                                    num_warps=num_warps or warps, **launch_args(pdl))
        return y
