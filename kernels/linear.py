"""Linear layer matmul, y = x @ W.T (+ b), with a skinny-batch kernel for decode that can
also fuse the RMSNorm before it, the SiLU-and-mul before it, or the residual add after it.

`linear` (the dispatcher) calls `skinny_linear_triton` for CUDA inputs with few rows
(`skinny_applies`; a single row, and 2..`gemv.ROWS` rows, go to `kernels.gemv` instead) and otherwise torch
(`F.linear`: cuBLAS on the GPU, MKL on the CPU), with the fused steps run as their own ops
(`kernels.norm`, `kernels.activation`, an add).
`linear_ref` (`kernels.linear_ref`, imported here) is the pure-torch truth for tests.

Why a kernel of our own: at decode batch 1..16 a linear layer is a matrix-vector product
bound by reading W once. cuBLAS picks tiles meant for larger M there and reaches about a
quarter of the copy bandwidth on the small projections of a 0.6B model (H200, Qwen3-0.6B
shapes: 20 MB of qkv + gate_up weights in 10.5 us per layer, ~1.9 TB/s; step_profile in
benchmarks/results/). The kernel below streams W in [BLOCK_N, BLOCK_K] tiles, each program
owning BLOCK_N output columns of every row (so each W element is read exactly once), with
the rows of x padded to 16 for the tensor-core dot (the multiply is free: the time is the
W read). When N / BLOCK_N programs would not fill the GPU, the K dimension is split in
SPLIT_K parts that write fp32 partials.

Why the fusions: at that batch a decoder layer is ~14 launches of a few microseconds each,
half of them tiny elementwise kernels. x is a few KB, so the kernel recomputes what those
kernels did on each x tile it loads (prologue) or on the output tile (epilogue):
- norm: each program computes the per-row rstd over the whole of x (K <= ~8192 values a
  row, from L2), then loads x tiles as rms_norm_ref would produce them.
- silu_mul: x is [M, 2K] = cat(gate, up); the tile is silu(gate) * up.
- residual: y = round(x @ W.T + b) + residual, the add in fp32, rounded once more.
- split-K: each split program stores its fp32 partial; then (CTA barrier, acq_rel atomic on
  a per-N-tile int32 counter) the last program to arrive for its N tile sums the partials
  in split order (deterministic, and the same order as the 2-kernel path), applies the
  epilogue, stores y and resets its counter to 0. The counters are one persistent zeroed
  buffer per device (`_tile_counters`), shared by every launch: each launch leaves it
  zeroed, so launches that follow each other on one stream (or in one CUDA graph) can share
  it. Two streams of one device must not run split launches at the same time. The older
  path (`split_reduce="kernel"`: a second kernel sums the partials) is the default, and is
  used for a first call made inside CUDA-graph capture.
- one tile (`SKINNY_PDL`, the default at 2..16 rows: `_skinny_pdl_kernel`, issue 15): the
  K-loop kernel's fused path lost to its launches (below) and it has no PDL, so a verify
  step's chain of skinny kernels, split sums and norm / SiLU kernels ran back to back. Here
  each program loads its whole [BLOCK_N, BLOCK_K] W tile at once (K split in ranges of at
  most 256 columns, `SKINNY_PDL_TUNING`: x and both dot operands sit in registers) before
  `kernels.pdl.pdl_wait`; x, the prologue and the single dot come after, while W streams
  in, and the split is summed in the kernel by the last program of the N tile (same
  counters and protocol as above). The fusion plan fuses 2..16-row steps with it
  (services.worker.fusion.FUSE_SMALL_BATCHES). Not yet timed on a GPU.
Measured on the H200 (benchmarks/kernel_sweep.py --only fused, Qwen3-0.6B's 28-layer
linear stack at M=1 in one CUDA graph): unfused 851 us, unfused with the in-kernel split sum
813 us, fused 1,302 us. The fused prologues cost more than the launches they save, so the
runner keeps the unfused path (`services.worker.fusion.FUSE_SMALL_BATCHES`); the in-kernel sum waits
for a run of the whole step before it becomes the default.
Rounding follows the references op by op (fp32 math, rounded to the dtype where torch
rounds), so the fused output equals the unfused kernel sequence up to summation order:
- the residual sum is bit for bit the `x + residual` of `fused_add_rms_norm` given the same
  matmul output (round(acc + bias), then the add in fp32, rounded), and the matmul is the
  unfused skinny kernel's (same tiles, partials summed in the same order);
- the norm's rstd sums its squares in BLOCK_K chunks here, in one reduction in
  kernels/norm.py, so a normalised x may round to the neighbouring value;
- bias is added to the fp32 accumulator before the one rounding (as cuBLAS's epilogue);
  torch's CPU half `F.linear` may round the product before adding it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import gemv
from kernels.cpu_linear import packed_linear
from kernels.activation import silu_and_mul
from kernels.device_info import num_sms
from kernels.device_info import tile_counters as _tile_counters
from kernels.linear_ref import linear_ref  # the truth of both kernels
from kernels.norm import rms_norm

skinny_linear_triton = None  # set below when Triton imports: linear_ref's signature plus tiles
SKINNY_MAX_ROWS = 16  # rows of x up to which CUDA inputs take the skinny kernel
# weights of at most this many elements take it: larger ones (Llama-3.1-8B's) stream at
# 3.7 TB/s through cuBLAS already, against 3.5 here (benchmarks/kernel_sweep.py, H200)
SKINNY_MAX_WEIGHT = 16 << 20
# ... except a single row, which takes `kernels.gemv` up to this many: Qwen3.5-35B-A3B's and
# Qwen3-Next's gated-DeltaNet in_proj_qkvz [12288, 2048] (25.2M) and gated-attention qkv
# [9216, 2048] (18.9M) fell to a cuBLAS GEMM at batch 1 (0.61 ms in 40 calls of a 5.84 ms
# graph step on the H200, benchmarks/results/2026-12-02_h200_step_profile_qwen3.5-35b-a3b.json),
# which PDL cannot overlap with the kernel before; lm_heads (over 100M) stay on cuBLAS.
GEMV_MAX_WEIGHT = 32 << 20
_HALF = (torch.bfloat16, torch.float16)
# The SiLU-and-mul prologue runs inside the projection's kernel at one row (the gemv kernel)
# and on the one-tile skinny kernel (SKINNY_PDL); on the K-loop skinny kernel `linear` runs
# `silu_and_mul` first, then the kernel. H200, K-loop kernel,
# benchmarks/kernel_sweep.py --only silu, Qwen3-0.6B's 28 down projections in one graph:
# 1 row 101 us in-kernel vs 120 us apart; 2..16 rows 576-595 us in-kernel vs 245-251 us apart
# (benchmarks/results/2026-12-01_h200_silu_down.json).
SILU_IN_KERNEL_ROWS = 1


def skinny_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight, ...)` runs our Triton kernels (one row: `kernels.gemv`,
    else the skinny kernel): CUDA x with 1..SKINNY_MAX_ROWS rows, bf16/fp16 (fp32 stays on
    cuBLAS: the kernel's dot would run as tf32), weight of x's dtype with unit stride along
    K and at most SKINNY_MAX_WEIGHT elements (GEMV_MAX_WEIGHT for one row with the gemv on),
    Triton importable."""
    if not (x.is_cuda and skinny_linear_triton is not None and x.dim() == 2
            and 0 < x.shape[0] <= SKINNY_MAX_ROWS and weight.stride(1) == 1
            and x.dtype in _HALF and weight.dtype == x.dtype):
        return False
    one_row = x.shape[0] == 1 and gemv.ENABLED
    return weight.numel() <= (max(GEMV_MAX_WEIGHT, SKINNY_MAX_WEIGHT) if one_row else SKINNY_MAX_WEIGHT)


def _gemv_rows(m: int) -> bool:
    """Whether `kernels.gemv` takes an x of m rows (1, or up to gemv.ROWS; gemv.ENABLED)."""
    return gemv.ENABLED and (m == 1 or m <= min(gemv.ROWS, gemv.MAX_ROWS))


def _check_fused(x, weight, norm_weight, silu_mul, residual) -> None:
    """Raise ValueError for fused arguments that do not fit x and weight (see `linear`)."""
    n, k = weight.shape
    if norm_weight is not None and silu_mul:
        raise ValueError("linear: norm_weight and silu_mul are both prologues; give one")
    if x.dim() != 2 or x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"linear: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}"
                         f"{' with silu_mul (x needs 2K columns)' if silu_mul else ''}")
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.dtype != x.dtype):
        raise ValueError(f"linear: norm_weight {tuple(norm_weight.shape)} {norm_weight.dtype}, "
                         f"want ({k},) {x.dtype}")
    if residual is not None and (residual.shape != (x.shape[0], n) or residual.dtype != x.dtype):
        raise ValueError(f"linear: residual {tuple(residual.shape)} {residual.dtype}, "
                         f"want ({x.shape[0]}, {n}) {x.dtype}")


def _one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, **fused) -> torch.Tensor | None:
    """`kernels.gemv` for an x of one row (or up to gemv.ROWS rows: `_gemv_rows`) that
    `skinny_applies` to (gemv.ENABLED), with the fused steps (norm_weight, eps, silu_mul,
    residual) in the kernel; else None (more rows, or gemv declined: the caller takes the
    skinny kernel)."""
    if not _gemv_rows(x.shape[0]):
        return None
    return gemv.gemv_triton(x if x.stride(1) == 1 else x.contiguous(), weight, bias, **fused)


def _norm_apart(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, xn_out: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
    """`linear`'s xn_out path when the gemv prologue does not store it: the norm runs apart
    into xn_out (one `rms_norm`), then the plain projection (with the residual add) reads it."""
    xn_out.copy_(rms_norm(x, norm_weight, eps))
    return linear(xn_out, weight, bias, residual=residual)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           norm_weight: torch.Tensor | None = None, eps: float = 1e-6, silu_mul: bool = False,
           residual: torch.Tensor | None = None, xn_out: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatcher for `linear_ref` (see there for shapes and rounding): one launch of
    `kernels.gemv` for a single row (`gemv.ENABLED`), or of the skinny kernel, when
    `skinny_applies(x, weight)` (with SKINNY_PDL off a SiLU-and-mul prologue then runs as its
    own kernel first: SILU_IN_KERNEL_ROWS), otherwise F.linear with the prologue and the residual add as
    separate ops (the `rms_norm` / `silu_and_mul` dispatchers, an in-place add), which is
    the reference on the CPU; a weight packed by `kernels.cpu_linear.pack` (CPU fp32) takes
    `packed_linear` in F.linear's place. Callers state the math (e.g. `silu_mul=True` for an MLP's
    down projection at any batch); which kernels run is decided here.
    xn_out: with norm_weight, an [M, K] tensor of x's dtype that also receives the normalised
    x (the MoE experts' input, `services.worker.layers.moe`): stored by the gemv kernel's
    prologue on its path, else the norm runs apart (one `rms_norm`) and the projection takes
    its output.
    Raises ValueError when norm_weight and silu_mul are both given, when x's columns,
    norm_weight or residual (shape or dtype) do not fit weight, or for an xn_out without
    norm_weight or of another shape or dtype than x.
    """
    if norm_weight is None and residual is None and not silu_mul:  # the plain (per-call cheap) path
        if x.is_cuda and skinny_applies(x, weight):
            y = _one_row(x, weight, bias)
            return y if y is not None else skinny_linear_triton(x, weight, bias)
        if weight.is_mkldnn:  # the CPU's packed fp32 weights (kernels.cpu_linear)
            return packed_linear(x, weight, bias)
        return F.linear(x, weight, bias)  # = linear_ref(x, weight, bias)
    _check_fused(x, weight, norm_weight, silu_mul, residual)
    if xn_out is not None:
        if norm_weight is None or xn_out.shape != x.shape or xn_out.dtype != x.dtype:
            raise ValueError(f"linear: xn_out {tuple(xn_out.shape)} {xn_out.dtype}: want norm_weight and "
                             f"{tuple(x.shape)} {x.dtype}")
        if not (skinny_applies(x, weight) and _gemv_rows(x.shape[0]) and xn_out.stride(1) == 1):
            return _norm_apart(x, norm_weight, eps, xn_out, weight, bias, residual)
    if skinny_applies(x, weight):
        y = _one_row(x, weight, bias, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul, residual=residual,
                     **({} if xn_out is None else {"xn_out": xn_out}))
        if y is not None:
            return y
        if xn_out is not None and norm_weight is not None:  # gemv declined (split counters in a capture)
            return _norm_apart(x, norm_weight, eps, xn_out, weight, bias, residual)
        if silu_mul and not SKINNY_PDL:  # SILU_IN_KERNEL_ROWS: the K-loop kernel's SiLU runs apart
            x, silu_mul = silu_and_mul(x), False
        return skinny_linear_triton(x, weight, bias, norm_weight=norm_weight, eps=eps,
                                    silu_mul=silu_mul, residual=residual)
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    if silu_mul:
        x = silu_and_mul(x)
    y = packed_linear(x, weight, bias) if weight.is_mkldnn else F.linear(x, weight, bias)
    return y if residual is None else y.add_(residual)


# ---------------------------------------------------------------- Triton (CUDA)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the dispatcher keeps the reference
    triton = None

# launch defaults of the skinny kernel (benchmarks/kernel_sweep.py sweeps them): K tile,
# the programs per SM that the K split aims for, warps, software-pipeline stages, and how
# K-split partials are summed ("atomic": by the last split program; "kernel": a 2nd kernel)
SKINNY_TUNING: dict = {"block_k": 256, "programs_per_sm": 1, "num_warps": 4, "num_stages": 3,
                       "split_reduce": "kernel"}
# The one-tile skinny kernel (`_skinny_pdl_kernel`) for 2..SKINNY_MAX_ROWS rows: each program
# loads its whole W tile before the PDL wait (as kernels.gemv), its K split is summed in the
# kernel (no second launch), and the fused prologues run on the x tile while W streams in.
# False: the K-loop kernel above with the 2-kernel split sum, the path before issue 15 (the
# fusion plan then keeps 2..16-row steps unfused: services.worker.fusion.FUSE_SMALL_BATCHES).
# Read at every call: flip it to A/B time both paths in one process (benchmarks/spec_verify_cost.py
# --skinny); the fusion plan reads it when the runner is built.
SKINNY_PDL = True
# its plan (`skinny_pdl_plan`): at most tile_elems W elements a program (registers), K ranges
# of at most max_block_k, BLOCK_N 16..64, programs_per_sm programs per SM (not yet timed), and
# how its K splits are summed ("atomic": in the kernel; "kernel": by `_split_sum_kernel`).
# Registers (ptxas -v for sm_90a of Triton 3.9's PTX, bf16, 4 warps): the x tile [16, BLOCK_K]
# and both dot operands sit in registers, so they grow with BLOCK_K: [32, 256] tiles 80 (plain)
# / 162 (norm) / 168 (SiLU + residual + split) registers, no spills; [16, 1024] 255 with spills
# (308 bytes with the norm, 20 KB with the SiLU); [64, 256] 165-255.
SKINNY_PDL_TUNING: dict = {"tile_elems": 8192, "max_block_k": 256, "programs_per_sm": 1, "num_warps": 4,
                           "split_reduce": "atomic"}

if triton is not None:
    from kernels.pdl import launch_args, pdl_release, pdl_wait, use_pdl

    @triton.jit
    def _epilogue(acc, b_ptr, r_ptr, y_ptr, rm, rn, mmask, nmask, sr_m, sy_m,
                  HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
        """Store y = round(acc + bias) (+ residual in fp32, rounded again) for one tile:
        acc [BLOCK_M, BLOCK_N] fp32, rows rm, columns rn."""
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        out = acc.to(y_ptr.dtype.element_ty)
        mask = mmask[:, None] & nmask[None, :]
        if HAS_RES:
            r = tl.load(r_ptr + rm[:, None] * sr_m + rn[None, :], mask=mask, other=0.0)
            out = (out.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rm[:, None] * sy_m + rn[None, :], out, mask=mask)

    @triton.jit
    def _silu_mul(g, u):
        # as silu_and_mul_ref: silu(g) rounded to g's dtype, then the product rounded to u's
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        return (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype)

    @triton.jit
    def _finish(acc, ws_ptr, cnt_ptr, b_ptr, r_ptr, y_ptr, rm, rn, mmask, nmask, M, N, sr_m, sy_m, pid_n, pid_k,
                HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SPLIT: tl.constexpr, ATOMIC: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # a skinny program's fp32 [BLOCK_M, BLOCK_N] partial: without SPLIT the epilogue; with it
        # stored at ws[pid_k] ([splits, M, N] fp32), and with ATOMIC the last program of the N
        # tile to arrive (cnt: int32 per N tile) sums every split in split order (as
        # _split_sum_kernel: deterministic), runs the epilogue and zeroes its counter; without
        # ATOMIC `_split_sum_kernel` sums after the launch
        if SPLIT:
            ws_tile = ws_ptr + rm[:, None] * N + rn[None, :]
            out_mask = mmask[:, None] & nmask[None, :]
            tl.store(ws_tile + pid_k * M * N, acc, mask=out_mask)
            if ATOMIC:
                # every thread's partial is stored before the release below (CTA barrier,
                # then one gpu-scope acq_rel atomic); the last arrival acquires all partials
                tl.debug_barrier()
                n_splits = tl.num_programs(1)
                arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
                if arrived == n_splits - 1:
                    tot = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                    for s_i in range(0, n_splits):
                        tot += tl.load(ws_tile + s_i * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                    _epilogue(tot, b_ptr, r_ptr, y_ptr, rm, rn, mmask, nmask, sr_m, sy_m, HAS_BIAS, HAS_RES)
                    tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # zeroed for the next launch
        else:
            _epilogue(acc, b_ptr, r_ptr, y_ptr, rm, rn, mmask, nmask, sr_m, sy_m, HAS_BIAS, HAS_RES)

    @triton.jit(do_not_specialize=["M"])  # the step's rows: no variant per row count
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, nw_ptr, r_ptr, cnt_ptr, M, N, K,
                       sx_m, sw_n, sy_m, sr_m, k_per_split, eps, HAS_BIAS: tl.constexpr,
                       NORM: tl.constexpr, SILU: tl.constexpr, HAS_RES: tl.constexpr,
                       SPLIT: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # grid (N tiles, K splits). x: [M, K] ([M, 2K] with SILU), W: [N, K], ws: [splits, M, N]
        # fp32 partials (SPLIT), cnt: int32 per N tile (ATOMIC), nw: [K] (NORM), r: [M, N]
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        nmask = rn < N
        mmask = rm < M
        x_rows = x_ptr + rm[:, None] * sx_m
        if NORM:  # rstd of each row over all of K (padding rows: 0 * rsqrt(eps))
            ss = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                xf = tl.load(x_rows + rk[None, :], mask=mmask[:, None] & (rk < K)[None, :], other=0.0)
                xf = xf.to(tl.float32)
                ss += tl.sum(xf * xf, axis=1)
            rstd = tl.rsqrt(ss / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * sw_n
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < k_hi
            w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            xmask = mmask[:, None] & kmask[None, :]
            x = tl.load(x_rows + rk[None, :], mask=xmask, other=0.0)
            if SILU:  # x holds the gate; as silu_and_mul_ref: silu rounded, then the product
                u = tl.load(x_rows + K + rk[None, :], mask=xmask, other=0.0)
                x = _silu_mul(x, u)
            if NORM:  # as rms_norm_ref: x * rstd rounded, times the weight rounded
                nw = tl.load(nw_ptr + rk, mask=kmask, other=0.0)
                xn = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
                x = (xn.to(tl.float32) * nw.to(tl.float32)[None, :]).to(xn.dtype)
            acc += tl.dot(x, tl.trans(w))
        _finish(acc, ws_ptr, cnt_ptr, b_ptr, r_ptr, y_ptr, rm, rn, mmask, nmask, M, N, sr_m, sy_m, pid_n, pid_k,
                HAS_BIAS, HAS_RES, SPLIT, ATOMIC, BLOCK_M, BLOCK_N)

    @triton.jit(do_not_specialize=["M"])  # the step's rows: no variant per row count
    def _skinny_pdl_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, nw_ptr, r_ptr, cnt_ptr, M, N, K,
                           sx_m, sw_n, sy_m, sr_m, k_per_split, eps, HAS_BIAS: tl.constexpr,
                           NORM: tl.constexpr, SILU: tl.constexpr, HAS_RES: tl.constexpr,
                           SPLIT: tl.constexpr, ATOMIC: tl.constexpr, USE_PDL: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           NORM_BLOCK: tl.constexpr):
        # the one-tile variant (SKINNY_PDL, docs/ARCHITECTURE.md §6): grid (N tiles, K splits),
        # program (n, s) owns BLOCK_N rows of W over the s-th range of k_per_split columns,
        # loaded as one [BLOCK_N, BLOCK_K] tile (BLOCK_K = next power of two of k_per_split,
        # masked) before the PDL wait; then x, the prologue, one dot and the split-K sum by
        # the last program of the N tile (ATOMIC; cnt: int32 per N tile, ws: [splits, M, N]
        # fp32), else by `_split_sum_kernel` after it (no counters: a first call in capture).
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        kk = tl.arange(0, BLOCK_K)
        rk = pid_k * k_per_split + kk
        rm = tl.arange(0, BLOCK_M)
        nmask = rn < N
        kmask = (kk < k_per_split) & (rk < K)
        mmask = rm < M
        # W and the norm weight are written by no kernel of a step: loaded before the wait
        w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * sw_n + rk[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0.0)
        if NORM:
            nw = tl.load(nw_ptr + rk, mask=kmask, other=0.0)
        pdl_wait(USE_PDL)
        pdl_release(USE_PDL)
        x_rows = x_ptr + rm[:, None] * sx_m
        xmask = mmask[:, None] & kmask[None, :]
        x = tl.load(x_rows + rk[None, :], mask=xmask, other=0.0)
        if SILU:  # x holds the gate; as silu_and_mul_ref: silu rounded, then the product
            u = tl.load(x_rows + K + rk[None, :], mask=xmask, other=0.0)
            x = _silu_mul(x, u)
        if NORM:  # rstd of each row over all of K (from L2), then as rms_norm_ref
            ss = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, K, NORM_BLOCK):
                rr = k0 + tl.arange(0, NORM_BLOCK)
                xf = tl.load(x_rows + rr[None, :], mask=mmask[:, None] & (rr < K)[None, :], other=0.0)
                xf = xf.to(tl.float32)
                ss += tl.sum(xf * xf, axis=1)
            rstd = tl.rsqrt(ss / K + eps)
            xn = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
            x = (xn.to(tl.float32) * nw.to(tl.float32)[None, :]).to(xn.dtype)
        acc = tl.dot(x, tl.trans(w))
        _finish(acc, ws_ptr, cnt_ptr, b_ptr, r_ptr, y_ptr, rm, rn, mmask, nmask, M, N, sr_m, sy_m, pid_n, pid_k,
                HAS_BIAS, HAS_RES, SPLIT, ATOMIC, BLOCK_M, BLOCK_N)

    @triton.jit(do_not_specialize=["M", "n_splits"])
    def _split_sum_kernel(ws_ptr, b_ptr, r_ptr, y_ptr, M, N, sr_m, sy_m, n_splits,
                          HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        # the 2-kernel path: y[m] = sum over splits of ws[s, m] in split order, then the epilogue
        m = tl.program_id(0)
        rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        nmask = rn < N
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(0, n_splits):
            acc += tl.load(ws_ptr + (s * M + m) * N + rn, mask=nmask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        out = acc.to(y_ptr.dtype.element_ty)
        if HAS_RES:
            r = tl.load(r_ptr + m * sr_m + rn, mask=nmask, other=0.0)
            out = (out.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + m * sy_m + rn, out, mask=nmask)

    def skinny_plan(m: int, n: int, k: int, device: torch.device, block_n: int | None = None,
                    block_k: int | None = None, split_k: int | None = None) -> tuple[int, int, int]:
        """(BLOCK_N, BLOCK_K, SPLIT_K) for an [m, k] x [n, k]^T product: BLOCK_N 16..64 by the
        width (wider tiles for wide layers such as an lm_head), then split K (in whole
        BLOCK_K tiles) until there are SKINNY_TUNING["programs_per_sm"] programs per SM, at
        most 8 splits.
        Explicit arguments override (the benchmark sweeps them)."""
        bn = block_n or (64 if n >= 32768 else 32 if n >= 8192 else 16)
        bk = block_k or SKINNY_TUNING["block_k"]
        if split_k is None:
            programs = triton.cdiv(n, bn)
            split_k = 1
            max_split = max(1, min(8, triton.cdiv(k, bk)))
            target = SKINNY_TUNING["programs_per_sm"] * num_sms(device)
            while programs * split_k < target and split_k < max_split:
                split_k *= 2
            split_k = min(split_k, max_split)
        return bn, bk, split_k

    def skinny_pdl_plan(n: int, k: int, device: torch.device, tuning: dict | None = None) -> tuple[int, int, int]:
        """(BLOCK_N, SPLIT, num_warps) of the one-tile kernel for W [n, k] (`SKINNY_PDL_TUNING`
        unless `tuning`): K split in cdiv(k, max_block_k) ranges (Qwen3-0.6B: 4, 8, 4 and 12
        of 256 columns); BLOCK_N = tile_elems / BLOCK_K within 16..64; then halve BLOCK_N down
        to 16, and past that double the split (while a range keeps 64 columns), until the
        grid has programs_per_sm programs per SM. BLOCK_K is the next power of two of the range."""
        t = SKINNY_PDL_TUNING if tuning is None else tuning
        split = triton.cdiv(k, t["max_block_k"])
        bk = triton.next_power_of_2(triton.cdiv(k, split))
        bn = max(16, min(64, t["tile_elems"] // bk))
        target = t["programs_per_sm"] * num_sms(device)
        while triton.cdiv(n, bn) * split < target:
            if bn > 16:
                bn //= 2
            elif triton.cdiv(k, 2 * split) >= 64:
                split *= 2
            else:
                break
        return bn, split, t["num_warps"]

    def _skinny_pdl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
                    norm_weight: torch.Tensor | None, eps: float, silu_mul: bool,
                    residual: torch.Tensor | None, block_n: int | None, split_k: int | None,
                    num_warps: int | None, pdl: bool | None, reduce: str) -> None:
        """Launch `_skinny_pdl_kernel` into y. A K split is summed in the kernel, unless
        reduce is "kernel" or the tile counters would be allocated inside CUDA-graph capture:
        then by `_split_sum_kernel` (the same sum, bit for bit)."""
        m = x.shape[0]
        n, k = weight.shape
        bn, sp, warps = skinny_pdl_plan(n, k, x.device)
        bn = block_n or bn
        k_per = triton.cdiv(k, max(1, min(split_k or sp, k)))
        bk, sp = max(16, triton.next_power_of_2(k_per)), triton.cdiv(k, k_per)  # the dot's K >= 16; no empty split
        n_tiles = triton.cdiv(n, bn)
        counters = _tile_counters(x.device, n_tiles) if sp > 1 and reduce == "atomic" else None
        ws = torch.empty((sp, m, n), dtype=torch.float32, device=x.device) if sp > 1 else y
        pdl = use_pdl(x.device) if pdl is None else pdl
        _skinny_pdl_kernel[(n_tiles, sp)](
            x, weight, y if bias is None else bias, y, ws,
            x if norm_weight is None else norm_weight, y if residual is None else residual,
            y if counters is None else counters, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
            0 if residual is None else residual.stride(0), k_per, eps,
            HAS_BIAS=bias is not None, NORM=norm_weight is not None, SILU=silu_mul,
            HAS_RES=residual is not None, SPLIT=sp > 1, ATOMIC=counters is not None, USE_PDL=pdl,
            BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, NORM_BLOCK=min(256, triton.next_power_of_2(k)),
            num_warps=num_warps or warps, **launch_args(pdl))
        if sp > 1 and counters is None:
            _split_sum(ws, bias, residual, y, sp)

    def _split_sum(ws: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                   y: torch.Tensor, split: int) -> None:
        """y = epilogue(sum over splits of ws [split, M, N] in split order): `_split_sum_kernel`."""
        m, n = y.shape
        blk = 1024
        _split_sum_kernel[(m, triton.cdiv(n, blk))](
            ws, y if bias is None else bias, y if residual is None else residual, y, m, n,
            0 if residual is None else residual.stride(0), y.stride(0), split,
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, BLOCK=blk)

    def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                             norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                             silu_mul: bool = False, residual: torch.Tensor | None = None,
                             block_n: int | None = None, block_k: int | None = None,
                             split_k: int | None = None, num_warps: int | None = None,
                             num_stages: int | None = None, split_reduce: str | None = None,
                             one_tile: bool | None = None, pdl: bool | None = None) -> torch.Tensor:
        """Triton `linear_ref` for x with M <= 64 rows (same shapes, dtypes and fused steps;
        norm_weight and silu_mul not both: `linear` checks the arguments).

        weight must have unit stride along K; x and residual may be row-strided views.
        one_tile (default SKINNY_PDL) takes the one-tile kernel for M <= SKINNY_MAX_ROWS
        (`_skinny_pdl_kernel`: W tile loaded before the PDL wait, the split summed in the
        kernel unless split_reduce (default SKINNY_PDL_TUNING's) is "kernel" or the
        counters would be allocated inside graph capture; tiles from `skinny_pdl_plan`,
        block_n / split_k / num_warps override it, block_k / num_stages do not apply; pdl
        overrides `kernels.pdl.use_pdl`); else the K-loop kernel, whose tile arguments
        default to `skinny_plan` and split_reduce ("atomic" or "kernel") to SKINNY_TUNING.
        Raises ValueError for M > 64, a weight whose last stride is not 1 or an unknown
        split_reduce.
        """
        m = x.shape[0]
        n, k = weight.shape
        reduce = split_reduce or SKINNY_TUNING["split_reduce"]
        if m > 64 or weight.stride(1) != 1 or reduce not in ("atomic", "kernel"):
            raise ValueError(f"skinny kernel: M={m} (max 64), weight stride {tuple(weight.stride())}, "
                             f"split_reduce {reduce!r}")
        if x.stride(1) != 1:
            x = x.contiguous()
        if residual is not None and residual.stride(1) != 1:
            residual = residual.contiguous()
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if m == 0 or n == 0:
            return y
        if k == 0:
            return y.copy_(linear_ref(x, weight, bias, norm_weight=norm_weight, eps=eps,
                                      silu_mul=silu_mul, residual=residual))
        if (SKINNY_PDL if one_tile is None else one_tile) and m <= SKINNY_MAX_ROWS:
            _skinny_pdl(x, weight, bias, y, norm_weight, eps, silu_mul, residual, block_n, split_k, num_warps,
                        pdl, split_reduce or SKINNY_PDL_TUNING["split_reduce"])
            return y
        bn, bk, split = skinny_plan(m, n, k, x.device, block_n, block_k, split_k)
        bm = max(16, triton.next_power_of_2(m))
        k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
        split = triton.cdiv(k, k_per)  # no empty trailing split
        n_tiles = triton.cdiv(n, bn)
        counters = _tile_counters(x.device, n_tiles) if split > 1 and reduce == "atomic" else None
        ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
        _skinny_kernel[(n_tiles, split)](
            x, weight, y if bias is None else bias, y, ws,
            x if norm_weight is None else norm_weight, y if residual is None else residual,
            y if counters is None else counters, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
            0 if residual is None else residual.stride(0), k_per, eps,
            HAS_BIAS=bias is not None, NORM=norm_weight is not None, SILU=silu_mul,
            HAS_RES=residual is not None, SPLIT=split > 1, ATOMIC=counters is not None,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=num_warps or SKINNY_TUNING["num_warps"],
            num_stages=num_stages or SKINNY_TUNING["num_stages"])
        if split > 1 and counters is None:
            _split_sum(ws, bias, residual, y, split)
        return y
