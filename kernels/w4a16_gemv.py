"""Triton kernels of the W4A16 linear layer at 1..16 rows (decode; `kernels.w4a16_linear`,
docs/ARCHITECTURE.md §6.4): y [M, N] = x [M, K] @ W.T (+ bias), W[n, k] = (q[k, n] -
z[k // G, n]) * s[k // G, n], q packed 8 to an int32 along K (qweight int32 [K / 8, N], nibble
j of word r is row 8r + j), zeros uint8 [K / G, N], scales fp16 [K / G, N].

Why this arithmetic: a decode product is bound by reading the weight once (half a byte an
element), so a kernel may spend only a few instructions an element: at the H200's ~4.8 TB/s
an SM must take in ~37 elements a clock, and it issues 128 thread-instructions a clock. The
first kernel (a 3-D [BLOCK_K / 8, 8, BLOCK_N] tile, an int -> float conversion, the zero and
scale on every element, layout conversions through shared memory with ~30 barriers a K tile)
ran Llama-3.1-8B's awq decode at 4.4x the bf16 time. Instruction counts below are per weight
element in the K loop, read from the sm_90 SASS that Triton 3.6 emits.

Grid (N / BLOCK_N, SPLIT): a program owns BLOCK_N output columns (consecutive columns of a
packed row are contiguous: 16-byte loads along N) over one K range of whole BLOCK_K tiles;
BLOCK_K divides G where a power of two >= 16 does (ONE_GROUP: one scale and zero row
[BLOCK_N] a tile), else each packed row gathers its own group's.
- `_w4_gemv1_kernel` (one row, ONE_GROUP; ~3.4 instructions): with BLOCK_N = 128 a warp,
  every thread holds all KP = BLOCK_K / 8 packed rows of 4 consecutive columns, so no sum
  crosses threads in the loop.
  Nibble j sits at bits 4i (i = j mod 4) of the word, or of the word shifted right by 16
  (j >= 4); ANDed in place and read as an fp32 bit pattern it is the denormal q * 2^(4i -
  149), exactly; x is scaled by 2^(XA - 4i), so each product is q x 2^(XA - 149) and one
  FMA takes it (no conversion, no shift: one AND and one FMA an element, a shift a word).
  bf16 x is read as int32 pairs (a shift or an AND makes each fp32). Per tile P = sum q x
  and X = sum x give acc += s 2^(149 - XA) P - s z X (zero and scale once a column a tile).
  XA = 96: exact for |x| < 2^32 (beyond, the scaled x overflows); a product |q x| < 2^-73
  underflows (an error below 2^-100 of y). fp32 FMAs keep denormals (Triton emits no .ftz).
- `_w4_dot_kernel` (2..16 rows, or odd group sizes; tensor cores, ~4.2 instructions): the
  words load transposed ([BLOCK_N, KP], n contiguous) and each word's 8 nibbles become 8
  K-consecutive values of one column of the [BLOCK_N, BLOCK_K] tile, at positions 2j + h
  for nibble j + 4h (h = the word's half), so a bf16 / fp16 pair is one AND + OR of a
  shifted word with the 16-bit magic numbers 0x4300 / 0x6400 in both halves: 128 + q /
  1024 + q exactly. x's [16, BLOCK_K] tile is permuted the same way in registers; tl.dot
  (fp32 accumulation) takes the tile transposed, and the tile's product minus (128 or
  1024) + z times the sum of x is scaled by s per column. fp32 x, gathered groups and
  config magic16 False take q - z (or (q - z) s) in fp32 from the magic number 2^23
  instead, rounded to x's dtype (exact for q - z).
K splits (a grid too small to fill the GPU otherwise) store fp32 partials [SPLIT, M, N]; the
last program of a column tile to arrive (acq_rel atomic on the shared counters of
`kernels.device_info.tile_counters`, as `kernels.gemv`) sums them in split order
(deterministic; the config's sum_chunk loads in flight at a time) and stores y; where the counters cannot be had (first
use inside CUDA-graph capture) or `split_sum` says "kernel", `_w4_split_sum_kernel` does the
same sum. The bias is added in fp32 before the one rounding to x's dtype. Launched with
programmatic dependent launch (`kernels.pdl`) where the device has it: the first tile's
weight loads go before the wait.

Launch configs: GEMV1_DEFAULTS / DOT_DEFAULTS (the heuristic's knobs), PLANS (explicit
configs per (rows bucket, N, K), from benchmarks/w4a16_sweep.py), or a `config` dict per call
(keys of CONFIG_KEYS): `gemv_plan`. The truth is `kernels.w4a16_linear.w4a16_linear_ref`.
"""

from __future__ import annotations

import torch

from kernels.device_info import num_sms, tile_counters
from kernels.pdl import launch_args, use_pdl

# launch configs by kernel (module docstring): tiles BLOCK_N x BLOCK_K, warps, pipeline stages;
# the heuristic splits K (whole tiles, at most max_split) until programs_per_sm programs per SM
# (not measured on a GPU: defaults chosen by registers and instruction counts of the SASS,
# ~96 registers for GEMV1's, 163 for DOT's; benchmarks/w4a16_sweep.py times the alternatives)
# sum_chunk: the K-split partials the summing program loads at a time (`_sum_partials`; at most
# the splits): 8 until 2026-12-03; the one-row kernel's 16 (its tile is 4 values a thread)
# halves the L2 round trips of that tail at the 16..32 splits Llama-3.1-8B's shapes take
GEMV1_DEFAULTS: dict = {"block_n": 128, "block_k": 64, "num_warps": 1, "num_stages": 3, "programs_per_sm": 8,
                        "max_split": 32, "split_sum": "atomic", "sum_chunk": 16}
DOT_DEFAULTS: dict = {"block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 2, "programs_per_sm": 2,
                      "max_split": 16, "split_sum": "atomic", "magic16": True, "sum_chunk": 8}
# (rows bucket, N, K) -> config overrides (keys of CONFIG_KEYS); rows bucket: 1, 2, 4, 8, 16
# Llama-3.1-8B's qkv from the 2026-12-03 H200 sweep (w4a16_sweep.py --ms 1, cut by its budget after
# this shape; decode_latency.py --ab q_old q_new: 2.60 -> 2.58 ms a token with it and sum_chunk 16)
PLANS: dict[tuple[int, int, int], dict] = {
    (1, 6144, 4096): {"block_n": 128, "block_k": 128, "num_warps": 1, "num_stages": 3, "split": 32}}
USE_PLANS = True  # False: the defaults for every shape (decode_latency.py's w4_tuned knob A/Bs PLANS)
# magic16 (dot kernel): bf16 / fp16 pairs from the 16-bit magic numbers, else q - z in fp32
CONFIG_KEYS = ("block_n", "block_k", "split", "num_warps", "num_stages", "split_sum", "pdl", "magic16", "sum_chunk")
XA = 96  # x is scaled by 2^(XA - 4i) in the one-row kernel (module docstring)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: kernels.w4a16_linear keeps its torch reference
    triton = None

w4_gemv_triton = None  # set below when Triton imports


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def pick_block_k(group_size: int, target: int) -> tuple[int, bool]:
    """(BLOCK_K, ONE_GROUP): the largest power of two <= target, >= 16, dividing group_size
    (one scale row a tile), else target with per-row scale gathers."""
    bk = target
    while bk > 16 and group_size % bk:
        bk //= 2
    return (bk, True) if group_size % bk == 0 else (target, False)


def rows_bucket(m: int) -> int:
    """The PLANS key of m rows: the next power of two (1, 2, 4, 8, 16)."""
    return 1 << max(0, (m - 1).bit_length())


def gemv_plan(m: int, n: int, k: int, group_size: int, device: torch.device,
              config: dict | None = None) -> dict:
    """The launch config of `w4_gemv_triton` for x [m, k] and W [n, k] of group_size: the
    kernel ("gemv1" for one row when a power-of-two tile of at least 16 rows divides the
    group, else "dot") and the keys of CONFIG_KEYS, from the kernel's defaults
    (GEMV1_DEFAULTS / DOT_DEFAULTS), then PLANS[(rows_bucket(m), n, k)] (with USE_PLANS),
    then `config`.
    block_k is made to divide the group where it can (`pick_block_k`; "one_group" says
    whether it does), split is a number of K ranges of whole tiles (none empty) and
    k_per_split their length."""
    one = m == 1 and pick_block_k(group_size, {**GEMV1_DEFAULTS, **(config or {})}["block_k"])[1]
    kern = "gemv1" if one else "dot"
    d = GEMV1_DEFAULTS if one else DOT_DEFAULTS
    cfg: dict = {"magic16": True, **d, "split": None, "pdl": None}
    if USE_PLANS:
        cfg.update(PLANS.get((rows_bucket(m), n, k), {}))
    cfg.update(config or {})
    bk, one_group = pick_block_k(group_size, cfg["block_k"])
    tiles = _cdiv(k, bk)
    if cfg["split"] is None:
        split, target = 1, cfg["programs_per_sm"] * num_sms(device)
        while _cdiv(n, cfg["block_n"]) * split < target and split < min(cfg["max_split"], tiles):
            split *= 2
    else:
        split = max(1, min(int(cfg["split"]), tiles))
    per = _cdiv(tiles, split)  # tiles a split
    cfg.update(kernel=kern, block_k=bk, one_group=one_group, split=_cdiv(tiles, per), k_per_split=per * bk)
    return cfg


if triton is not None:
    from kernels.pdl import pdl_release, pdl_wait

    @triton.jit
    def _load_t(qw, sp, zp, kmask, nmask, EVEN: tl.constexpr, ONE_GROUP: tl.constexpr):
        """One tile of the dot kernel: packed words at qw ([BLOCK_N, KP] pointers, n the
        contiguous dimension; 0 outside kmask [KP] / nmask [BLOCK_N] unless EVEN) and, ONE_GROUP,
        the scale and zero rows at sp / zp ([BLOCK_N] fp32; else placeholders)."""
        if EVEN:
            p = tl.load(qw)
        else:
            p = tl.load(qw, mask=nmask[:, None] & kmask[None, :], other=0)
        if ONE_GROUP:
            if EVEN:
                s = tl.load(sp).to(tl.float32)
                z = tl.load(zp).to(tl.float32)
            else:
                s = tl.load(sp, mask=nmask, other=0.0).to(tl.float32)
                z = tl.load(zp, mask=nmask, other=0).to(tl.float32)
        else:
            s = tl.zeros([p.shape[0]], tl.float32)
            z = s
        return p, s, z

    @triton.jit
    def _gemv1_tile(acc, p, s, z, x_ptr, xw_ptr, k0, KP: tl.constexpr, X_PAIRS: tl.constexpr,
                    XA: tl.constexpr):
        """acc [BLOCK_N] plus x[k0 : k0 + 8 KP] @ W tile (p [KP, BLOCK_N] packed words, one group:
        s, z [BLOCK_N] fp32), module docstring: FMAs into [KP, BLOCK_N] over the 8 nibbles, then
        a sum over the KP rows (in-thread where BLOCK_N is 128 a warp: each thread then holds
        all KP rows of its 4 columns and loads the tile's x itself)."""
        rkp = k0 // 8 + tl.arange(0, KP)
        u = p.to(tl.uint32, bitcast=True)
        t = u >> 16  # nibbles 4..7 at bits 0..15
        acc2 = tl.zeros(p.shape, tl.float32)
        xsum = tl.zeros([KP], tl.float32)
        for j in tl.static_range(8):
            src = u if j < 4 else t
            f = (src & (15 << (4 * (j % 4)))).to(tl.float32, bitcast=True)  # q * 2^(4i - 149), exact
            if X_PAIRS:  # bf16 x read as int32 pairs: the upper half is element 2c + 1
                xw = tl.load(xw_ptr + rkp * 4 + j // 2)
                bits = (xw << 16) if j % 2 == 0 else (xw & -65536)
                xv = bits.to(tl.float32, bitcast=True)
            else:
                xv = tl.load(x_ptr + rkp * 8 + j).to(tl.float32)
            xsum += xv
            acc2 += f * (xv * (2.0 ** (XA - 4 * (j % 4))))[:, None]
        # P = sum q x * 2^(XA - 149), X = sum x: y += s P 2^(149 - XA) - s z X
        return acc + (s * (2.0 ** (149 - XA))) * tl.sum(acc2, axis=0) - (s * z) * tl.sum(xsum, axis=0)

    @triton.jit
    def _w4_gemv1_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, N, K, k_per_split,
                         G: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                         ATOMIC_SUM: tl.constexpr, EVEN_N: tl.constexpr, X_PAIRS: tl.constexpr,
                         USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, XA: tl.constexpr,
                         SUM_CHUNK: tl.constexpr):
        # one row, BLOCK_K divides G (tiles are whole: K is a multiple of G, k_per_split of
        # BLOCK_K); grid (N tiles, K splits); x [K] (xw: the same as int32 pairs, X_PAIRS);
        # y [N]; ws [SPLIT, N] fp32 partials; cnt: int32 per N tile (ATOMIC_SUM)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        KP: tl.constexpr = BLOCK_K // 8
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        k_lo = pid_k * k_per_split
        rows = tl.arange(0, KP)
        qw = qw_ptr + (k_lo // 8 + rows).to(tl.int64)[:, None] * N + rn[None, :]
        sp = s_ptr + (k_lo // G) * N + rn
        zp = z_ptr + (k_lo // G) * N + rn
        # the weight is written by no kernel of a step: its first tile loads before the wait
        if EVEN_N:
            p = tl.load(qw)
            s = tl.load(sp).to(tl.float32)
            z = tl.load(zp).to(tl.float32)
        else:
            p = tl.load(qw, mask=nmask[None, :], other=0)
            s = tl.load(sp, mask=nmask, other=0.0).to(tl.float32)
            z = tl.load(zp, mask=nmask, other=0).to(tl.float32)
        pdl_wait(USE_PDL)
        pdl_release(USE_PDL)
        xw_ptr = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        acc = _gemv1_tile(tl.zeros([BLOCK_N], tl.float32), p, s, z, x_ptr, xw_ptr, k_lo, KP, X_PAIRS, XA)
        for k0 in range(k_lo + BLOCK_K, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
            qw += KP * N
            g = k0 // G
            if EVEN_N:
                p = tl.load(qw)
                s = tl.load(s_ptr + g * N + rn).to(tl.float32)
                z = tl.load(z_ptr + g * N + rn).to(tl.float32)
            else:
                p = tl.load(qw, mask=nmask[None, :], other=0)
                s = tl.load(s_ptr + g * N + rn, mask=nmask, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + g * N + rn, mask=nmask, other=0).to(tl.float32)
            acc = _gemv1_tile(acc, p, s, z, x_ptr, xw_ptr, k0, KP, X_PAIRS, XA)
        _finish(acc[None, :], b_ptr, y_ptr, ws_ptr, cnt_ptr, tl.arange(0, 1), tl.arange(0, 1) < 1, rn, nmask,
                1, N, N, pid_n, pid_k, HAS_BIAS, SPLIT, ATOMIC_SUM, BLOCK_N, SUM_CHUNK)

    @triton.jit
    def _nibble_pair(u, zc, sg, zg, j: tl.constexpr, MAGIC16: tl.constexpr, DT: tl.constexpr):
        """Nibbles j and j + 4 (j < 4) of the words u ([BLOCK_N, KP] uint32), joined ([BLOCK_N,
        KP, 2]) in dtype DT. MAGIC16 (bf16 / fp16, one group a tile): 128 + q / 1024 + q
        exactly, both of a word in one AND and OR (the 16-bit magic numbers 0x4300 / 0x6400
        in each half: the caller subtracts (128 or 1024) + z times the sum of x); else in fp32
        (2^23 + q by the magic 0x4B000000, minus 2^23: q), then q - zc (one group a tile: sg
        is None) or (q - zg) sg per element, rounded to DT."""
        v = u >> (4 * j) if j > 0 else u
        if MAGIC16:
            v = (v & 0x000F000F) | (0x43004300 if DT == tl.bfloat16 else 0x64006400)
            lo = (v & 0xFFFF).to(tl.uint16).to(DT, bitcast=True)
            hi = (v >> 16).to(tl.uint16).to(DT, bitcast=True)
        else:
            lo = ((v & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            hi = (((v >> 16) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            if sg is None:
                lo = (lo - zc).to(DT)
                hi = (hi - zc).to(DT)
            else:
                lo = ((lo - zg) * sg).to(DT)
                hi = ((hi - zg) * sg).to(DT)
        return tl.join(lo, hi)

    @triton.jit
    def _dot_tile(acc, p, s, z, x_ptr, s_ptr, z_ptr, k0, k_hi, rn, nmask, rm, mmask, N, G, sx_m,
                  KP: tl.constexpr, ONE_GROUP: tl.constexpr, MAGIC: tl.constexpr, BLOCK_N: tl.constexpr):
        """acc [16, BLOCK_N] plus x tile [16, 8 KP] @ W tile on tensor cores (module docstring).
        The tile is built [BLOCK_N, BLOCK_K] in registers, each word's 8 nibbles at 8
        consecutive positions 2j + h (nibble j + 4h: no data moves between halves of a
        word), and tl.dot takes it transposed; x is read in the same order (k = 8r +
        PERM[2j + h], PERM = 0 4 1 5 2 6 3 7)."""
        BLOCK_K: tl.constexpr = KP * 8
        u = p.to(tl.uint32, bitcast=True)
        rk = k0 + tl.arange(0, BLOCK_K)
        xn = tl.load(x_ptr + rm.to(tl.int64)[:, None] * sx_m + rk[None, :],
                     mask=mmask[:, None] & (rk < k_hi)[None, :], other=0.0)
        # natural order 8r + 4h + j -> the tile's 8r + 2j + h
        xv = tl.reshape(tl.permute(tl.reshape(xn, (16, KP, 2, 4)), (0, 1, 3, 2)), (16, BLOCK_K))
        dt: tl.constexpr = xv.dtype
        m16: tl.constexpr = MAGIC and ONE_GROUP and (dt == tl.bfloat16 or dt == tl.float16)
        zc = z[:, None]
        if ONE_GROUP:
            sg = None
            zg = zc
        else:
            rkp = k0 // 8 + tl.arange(0, KP)
            goff = ((rkp * 8) // G).to(tl.int64)[None, :] * N + rn[:, None]
            gmask = nmask[:, None] & (rkp * 8 < k_hi)[None, :]
            sg = tl.load(s_ptr + goff, mask=gmask, other=0.0).to(tl.float32)
            zg = tl.load(z_ptr + goff, mask=gmask, other=0).to(tl.float32)
        # [BN, KP, h, j0, j1] (j = j0 + 2 j1) -> [BN, KP, j1, j0, h] -> position 8r + 2j + h
        wt = tl.join(tl.join(_nibble_pair(u, zc, sg, zg, 0, m16, dt), _nibble_pair(u, zc, sg, zg, 1, m16, dt)),
                     tl.join(_nibble_pair(u, zc, sg, zg, 2, m16, dt), _nibble_pair(u, zc, sg, zg, 3, m16, dt)))
        wt = tl.reshape(tl.permute(wt, (0, 1, 4, 3, 2)), (BLOCK_N, BLOCK_K))
        d = tl.dot(xv, tl.trans(wt))
        if m16:
            bias: tl.constexpr = 128.0 if dt == tl.bfloat16 else 1024.0
            d -= tl.sum(xn.to(tl.float32), axis=1)[:, None] * (z + bias)[None, :]
        if ONE_GROUP:
            d = d * s[None, :]
        return acc + d

    @triton.jit
    def _sum_partials(ws_ptr, rm, rn, omask, M, N, n_splits, SUM_CHUNK: tl.constexpr):
        """sum over s of ws[s, rm, rn] ([ROWS, BLOCK_N] fp32) in split order, SUM_CHUNK
        independent loads at a time (n_splits / SUM_CHUNK L2 round trips, not one a split;
        the order of the adds is the split order for any SUM_CHUNK)."""
        tot = tl.zeros(omask.shape, tl.float32)
        off = rm[:, None] * N + rn[None, :]
        last = tl.zeros_like(off) + n_splits  # (a tensor: the interpreter takes no scalar mask term)
        for s0 in range(0, n_splits, SUM_CHUNK):
            for i in tl.static_range(SUM_CHUNK):
                tot += tl.load(ws_ptr + (s0 + i) * M * N + off, mask=omask & (s0 + i < last), other=0.0,
                               cache_modifier=".cg")
        return tot

    @triton.jit
    def _finish(acc, b_ptr, y_ptr, ws_ptr, cnt_ptr, rm, mmask, rn, nmask, M, N, sy_m, pid_n, pid_k,
                HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, ATOMIC_SUM: tl.constexpr, BLOCK_N: tl.constexpr,
                SUM_CHUNK: tl.constexpr):
        """Store y = round(acc + bias), or the split's partial (and, ATOMIC_SUM, y by the last
        program of the column tile to arrive: partials summed in split order)."""
        omask = mmask[:, None] & nmask[None, :]
        if SPLIT:
            tl.store(ws_ptr + (pid_k * M + rm)[:, None] * N + rn[None, :], acc, mask=omask)
            if ATOMIC_SUM:
                tl.debug_barrier()  # every thread's partial is stored before the release below
                n_splits = tl.num_programs(1)
                arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
                if arrived == n_splits - 1:
                    tot = _sum_partials(ws_ptr, rm, rn, omask, M, N, n_splits, SUM_CHUNK)
                    if HAS_BIAS:
                        tot += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
                    tl.store(y_ptr + rm.to(tl.int64)[:, None] * sy_m + rn[None, :],
                             tot.to(y_ptr.dtype.element_ty), mask=omask)
                    tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # zero for the next launch
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + rm.to(tl.int64)[:, None] * sy_m + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=omask)

    @triton.jit
    def _w4_dot_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, sx_m, sy_m, k_per_split,
                       G: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, ATOMIC_SUM: tl.constexpr,
                       ONE_GROUP: tl.constexpr, EVEN: tl.constexpr, MAGIC16: tl.constexpr, USE_PDL: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUM_CHUNK: tl.constexpr):
        # grid (N tiles, K splits); x [M, K] (M <= 16), y [M, N]; ws [SPLIT, M, N] fp32 partials;
        # cnt: int32 per N tile (ATOMIC_SUM). EVEN: N % BLOCK_N == 0 and whole K tiles (no masks)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        KP: tl.constexpr = BLOCK_K // 8
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        rm = tl.arange(0, 16)
        mmask = rm < M
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        rkp = k_lo // 8 + tl.arange(0, KP)
        qw = qw_ptr + rkp.to(tl.int64)[None, :] * N + rn[:, None]
        # the weight is written by no kernel of a step: its first tile loads before the wait
        p, s, z = _load_t(qw, s_ptr + (k_lo // G) * N + rn, z_ptr + (k_lo // G) * N + rn, rkp * 8 < k_hi, nmask,
                          EVEN, ONE_GROUP)
        pdl_wait(USE_PDL)
        pdl_release(USE_PDL)
        acc = _dot_tile(tl.zeros([16, BLOCK_N], tl.float32), p, s, z, x_ptr, s_ptr, z_ptr, k_lo, k_hi, rn, nmask,
                        rm, mmask, N, G, sx_m, KP, ONE_GROUP, MAGIC16, BLOCK_N)
        for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
            qw += KP * N
            p, s, z = _load_t(qw, s_ptr + (k0 // G) * N + rn, z_ptr + (k0 // G) * N + rn,
                              k0 // 8 + tl.arange(0, KP) < k_hi // 8, nmask, EVEN, ONE_GROUP)
            acc = _dot_tile(acc, p, s, z, x_ptr, s_ptr, z_ptr, k0, k_hi, rn, nmask, rm, mmask, N, G, sx_m,
                            KP, ONE_GROUP, MAGIC16, BLOCK_N)
        _finish(acc, b_ptr, y_ptr, ws_ptr, cnt_ptr, rm, mmask, rn, nmask, M, N, sy_m, pid_n, pid_k,
                HAS_BIAS, SPLIT, ATOMIC_SUM, BLOCK_N, SUM_CHUNK)

    @triton.jit(do_not_specialize=["M", "n_splits"])
    def _w4_split_sum_kernel(ws_ptr, b_ptr, y_ptr, M, N, sy_m, n_splits, HAS_BIAS: tl.constexpr,
                             USE_PDL: tl.constexpr, BLOCK: tl.constexpr, SUM_CHUNK: tl.constexpr):
        # y[m] = (sum over splits of ws[s, m], in split order) + bias, rounded once
        m = tl.program_id(0)
        rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        nmask = rn < N
        pdl_wait(USE_PDL)
        pdl_release(USE_PDL)
        acc = tl.reshape(_sum_partials(ws_ptr, tl.full([1], m, tl.int32), rn, nmask[None, :], M, N, n_splits,
                                       SUM_CHUNK), (BLOCK,))
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * sy_m + rn, acc.to(y_ptr.dtype.element_ty), mask=nmask)

    def check_operands(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                       group_size: int) -> tuple[int, int, int]:
        """(M, N, K) of the W4A16 kernels' operands (`w4_gemv_triton`, `kernels.w4a16_gemm`).
        Raises ValueError for shapes, strides or a group size that do not fit."""
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
                       group_size: int, bias: torch.Tensor | None = None, *,
                       config: dict | None = None) -> torch.Tensor:
        """y [M, N] = x @ W.T (+ bias) in x's dtype for 1 <= M <= 16 (module docstring).

        x: [M, K] bf16 / fp16 (fp32 works: the dot kernel's tl.dot then runs in tf32; the
        one-row kernel is exact fp32 for |x| < 2^32), unit column stride. qweight int32 [K / 8, N],
        zeros uint8 [K / G, N], scales fp16 [K / G, N], contiguous; bias [N] or None.
        config: launch overrides (keys of CONFIG_KEYS; `gemv_plan`), for the sweep and tests.
        Raises ValueError for M outside 1..16 or tensors that do not fit."""
        m, n, k = check_operands(x, qweight, zeros, scales, group_size)
        if not 1 <= m <= 16:
            raise ValueError(f"w4a16 gemv: {m} rows, want 1..16 (w4_gemm_triton for more)")
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if n == 0:
            return y
        c = gemv_plan(m, n, k, group_size, x.device, config)
        sp, bn = c["split"], c["block_n"]
        n_tiles = _cdiv(n, bn)
        counters = tile_counters(x.device, n_tiles) if sp > 1 and c["split_sum"] == "atomic" else None
        atomic = counters is not None
        ws = torch.empty((sp, m, n), dtype=torch.float32, device=x.device) if sp > 1 else y
        b = y if bias is None else bias
        cnt = y if counters is None else counters
        pdl = use_pdl(x.device) if c["pdl"] is None else bool(c["pdl"])
        chunk = max(1, min(int(c["sum_chunk"]), _pow2(sp)))  # no more loads than splits
        common = dict(HAS_BIAS=bias is not None, SPLIT=sp > 1, ATOMIC_SUM=atomic, USE_PDL=pdl, BLOCK_N=bn,
                      SUM_CHUNK=chunk,
                      BLOCK_K=c["block_k"], num_warps=c["num_warps"], num_stages=c["num_stages"],
                      **launch_args(pdl))
        if c["kernel"] == "gemv1":
            pairs = x.dtype == torch.bfloat16 and x.data_ptr() % 4 == 0
            _w4_gemv1_kernel[(n_tiles, sp)](x, qweight, zeros, scales, b, y, ws, cnt, n, k, c["k_per_split"],
                                            G=group_size, EVEN_N=n % bn == 0, X_PAIRS=pairs, XA=XA, **common)
        else:
            _w4_dot_kernel[(n_tiles, sp)](x, qweight, zeros, scales, b, y, ws, cnt, m, n, k, x.stride(0),
                                          y.stride(0), c["k_per_split"], G=group_size, ONE_GROUP=c["one_group"],
                                          EVEN=c["one_group"] and n % bn == 0, MAGIC16=bool(c["magic16"]), **common)
        if sp > 1 and not atomic:
            blk = 1024
            _w4_split_sum_kernel[(m, _cdiv(n, blk))](ws, b, y, m, n, y.stride(0), sp, HAS_BIAS=bias is not None,
                                                     USE_PDL=pdl, BLOCK=blk, SUM_CHUNK=chunk, **launch_args(pdl))
        return y
