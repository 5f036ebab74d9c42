"""The few-token (decode) path of the MoE block on Triton: router top-k + alignment in one
program, the gate_up grouped GEMM of `kernels.moe_triton`, and a down projection that sums a
token's k experts itself. Three launches where `kernels.moe.fused_moe` after the router takes
five (top-k softmax, alignment, gate_up, down, the sum over k); docs/ARCHITECTURE.md §6.4.

- `route_align_triton` (`_route_align_kernel`, one program): the softmax over the E router
  logits of every token in fp32, k rounds of argmax (ties to the lowest index, as
  `moe_triton.topk_softmax_triton`), the optional renormalisation, then the alignment of
  `kernels.moe.moe_align` on the same [tokens, experts] register tiles: counts per expert,
  padded ends by a cumsum, the sentinel fill, each tile's expert, and each pair's place in
  its expert's group from the number of earlier tokens that picked the same expert (an
  exclusive cumsum over tokens: a token picks an expert at most once). Pairs of one expert
  therefore come in ascending pair id: the layout equals `moe_align`'s exactly (no atomics).
- `moe_down_sum_triton` (`_moe_down_sum_kernel`, a program per (token, N tile)): for j = 0..k-1
  the row act[t * k + j] times expert topk_ids[t, j]'s w2 rows of the tile, as the one-row
  kernel of `kernels.gemv` multiplies (a whole [BLOCK_N, BLOCK_K] weight tile in registers,
  fp32 products summed along K, no tensor cores), rounded to x's dtype, times the routing
  weight in fp32, accumulated in j order in fp32 and stored once in x's dtype: the weighted
  sum is deterministic and needs neither fp32 partials in memory nor a second launch. The next
  expert's weight tile is loaded before the current one is reduced (two in flight), and with
  programmatic dependent launch (`kernels.pdl`) the first tile before the wait on the gate_up
  kernel: the expert ids come from the router kernel, which had finished before gate_up's
  programs passed their own wait and let this kernel start.
  Given a shared expert's output and gate (`shared`), the epilogue adds
  sigmoid(gate) * output as `kernels.hybrid_glue.shared_expert_combine_ref` rounds it (read
  after the wait: the shared expert's down projection runs just before the router program).
- GATE_UP "gemv" (off by default until measured faster): two launches and no alignment.
  `moe_gate_up_gemv` (`_moe_gate_up_gemv_kernel`, a program per (token, slot, column tile)) routes
  its token from the logits (`_route_row`: the router program's softmax top-k on one row), holds
  its expert's gate and up rows of the tile in registers as the down kernel holds w2's, and
  stores silu(gate) * up; `moe_down_routed_triton` is the down kernel with the same routing done
  before its wait (the logits are two launches back by then), so its first weight tile still
  loads early. Rounding as the grouped path's.
- `fused_moe_decode`: the three launches, each with PDL where the device has it (the router
  program and gate_up wait for the kernel before them first); `kernels.moe.moe_block` calls it.

Rounding is `kernels.moe.fused_moe_ref`'s (gate, up, silu, act and each expert's down output
rounded to x's dtype; the weighted sum in fp32, rounded once); only the summation order
differs (K order, and the k terms in slot order where the reference adds them by expert).
Why only a few tokens: each token's programs read its k experts' w2 rows themselves, so
tokens that share an expert read its rows once each (from L2 when close in time); at
batch 1 every expert is distinct anyway. `fits` says which shapes take this path.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels import moe_triton
from kernels.device_info import num_sms
from kernels.pdl import launch_args, pdl_release, pdl_wait, use_pdl

MAX_TOKENS = 8  # tokens a step that take this path (`kernels.moe.moe_block`; more: the five-launch path)
ROUTE_TILE_ELEMS = 8192  # next_pow2(T) x next_pow2(E) of the router program's register tiles, at most
# down-projection plan (`down_plan`): weight elements a program holds a tile, the longest K
# tile (longer rows loop over K), programs per SM at least (narrower row tiles first; by token
# count where measured), warps. programs_per_sm_by_tokens {1: 8}: H200, 2026-12-03,
# benchmarks/moe_decode_sweep.py at T = 1 (BLOCK_N 2 best for Qwen3.5-35B-A3B's and
# Qwen3-30B-A3B's experts; the other counts are not swept yet)
DOWN_TUNING: dict = {"tile_elems": 8192, "max_block_k": 2048, "programs_per_sm": 2, "num_warps": 4,
                     "programs_per_sm_by_tokens": {1: 8}}
# The gate_up launch of the decode path: "grouped" = the router + alignment program, then the
# grouped GEMM of kernels.moe_triton (three launches with the down kernel); "gemv" = a one-row
# kernel (`_moe_gate_up_gemv_kernel`, a program per (token, slot, column tile), the gate and up
# rows of its expert in registers as the down kernel holds w2's) that routes its token itself from
# the router logits (`_route_row`), and the down kernel routes its token too (before its PDL wait:
# the logits are two launches back), so no alignment and two launches. Read at every call.
# "gemv" since 2026-12-07: with GATE_UP_TUNING's plan, batch-1 TPOT on an H100 -2.9% (Qwen3-30B-A3B)
# and -3.1% (Qwen3.5-35B-A3B) against "grouped" (docs/ARCHITECTURE.md §6.3 "Two launches").
GATE_UP = "gemv"
# the most tokens a step sends to the "gemv" gate_up; more take "grouped". 1: only batch 1 was
# timed (at a few tokens the gemv reads an expert once per token that picked it, the grouped
# GEMM once). Up to MAX_TOKENS works (tests/gpu/test_moe_gpu.py).
GEMV_MAX_TOKENS = 1
# the gemv gate_up's plan (`gate_up_plan`): gate + up weight elements a program holds, longest K
# tile, programs per SM at least (narrower column tiles first), warps. From benchmarks/
# moe_decode_sweep.py --stages gemv on an H100 (2026-12-07, Qwen3-30B-A3B at T = 1): BLOCK_N 4,
# 2 warps: the MoE call 32.5 us, against 41.5 us with 8,192 elements and 4 warps (BLOCK_N 2) and
# 35.3 us on the grouped path (the down kernel's best plan gained 0.2 us more: kept as it is).
GATE_UP_TUNING: dict = {"tile_elems": 16384, "max_block_k": 2048, "programs_per_sm": 4, "num_warps": 2}
# The decode path's measured choices: the gate_up configs of kernels/moe_configs/ (`moe_triton.
# pick_config`) and DOWN_TUNING's programs_per_sm_by_tokens; False takes the untuned defaults
# (the A/B baseline: benchmarks/decode_latency.py variant moe_untuned)
USE_TUNED = True


def fits(num_tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether a step of num_tokens tokens routed top_k of num_experts takes this path:
    1..MAX_TOKENS tokens, at most `moe_triton.ROUTER_MAX_EXPERTS` experts, and the router's
    [next_pow2(T), next_pow2(E)] tiles within ROUTE_TILE_ELEMS."""
    return (1 <= num_tokens <= MAX_TOKENS and 1 <= top_k <= num_experts <= moe_triton.ROUTER_MAX_EXPERTS
            and triton.next_power_of_2(num_tokens) * triton.next_power_of_2(num_experts) <= ROUTE_TILE_ELEMS)


@triton.jit(do_not_specialize=["num_tokens", "p", "num_blocks"])
def _route_align_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_ptr, expert_ptr, post_pad_ptr, num_tokens,
                        num_experts, stride_row, p, num_blocks, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                        BLOCK_T: tl.constexpr, E_POW2: tl.constexpr, RENORMALIZE: tl.constexpr,
                        BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr, USE_PDL: tl.constexpr):
    # One program: the top-k softmax of every token on [BLOCK_T, E_POW2] tiles, then the
    # alignment (module doc). Rows t >= num_tokens and columns e >= num_experts are masked.
    # `_route_row` is the same routing on one row (the gemv path's): keep the two in step (fp32
    # softmax, ties to the lowest index, the renormalisation). Not shared: the tile form
    # reduces along axis 1 of every token at once and also fills `slot` for the alignment; a
    # per-row loop or a [1, E] tile in the row kernels would change the code GPU timings were
    # taken on.
    pdl_wait(USE_PDL)  # the logits are the kernel before's output
    pdl_release(USE_PDL)
    tt = tl.arange(0, BLOCK_T)
    ee = tl.arange(0, E_POW2)
    tv = tt < num_tokens
    ev = ee < num_experts
    live = tv[:, None] & ev[None, :]
    x = tl.load(logits_ptr + tt.to(tl.int64)[:, None] * stride_row + ee[None, :], mask=live,
                other=float("-inf")).to(tl.float32)
    mx = tl.where(tv, tl.max(x, 1), 0.0)
    ex = tl.exp(x - mx[:, None])
    den = tl.where(tv, tl.sum(ex, 1), 1.0)
    pr = tl.where(live, ex / den[:, None], -1.0)
    kk = tl.arange(0, K_POW2)
    wt = tl.zeros([BLOCK_T, K_POW2], dtype=tl.float32)
    it = tl.zeros([BLOCK_T, K_POW2], dtype=tl.int32)
    slot = tl.full([BLOCK_T, E_POW2], -1, tl.int32)  # the slot j in which token t picked expert e
    for j in tl.static_range(TOP_K):
        best = tl.max(pr, 1)
        idx = tl.min(tl.where(pr == best[:, None], ee[None, :], E_POW2), 1)  # the lowest index among ties
        wt = tl.where(kk[None, :] == j, best[:, None], wt)
        it = tl.where(kk[None, :] == j, idx[:, None], it)
        hit = ee[None, :] == idx[:, None]
        slot = tl.where(hit, j, slot)
        pr = tl.where(hit, -2.0, pr)
    if RENORMALIZE:
        wt = wt / tl.sum(wt, 1)[:, None]  # the padding columns of K_POW2 hold 0
    kv = tv[:, None] & (kk < TOP_K)[None, :]
    out_off = tt.to(tl.int64)[:, None] * TOP_K + kk[None, :]
    tl.store(weights_ptr + out_off, wt, mask=kv)
    tl.store(ids_ptr + out_off, it.to(ids_ptr.dtype.element_ty), mask=kv)
    # the alignment of kernels.moe.moe_align
    sel = ((slot >= 0) & live).to(tl.int32)
    counts = tl.sum(sel, 0)
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(post_pad_ptr, tl.sum(padded, 0))
    n = num_tokens * TOP_K
    for start in range(0, p, FILL):
        offs = start + tl.arange(0, FILL)
        tl.store(sorted_ptr + offs, tl.zeros([FILL], dtype=tl.int32) + n, mask=offs < p)
    for start in range(0, num_blocks, CHUNK):
        blk = start + tl.arange(0, CHUNK)
        # the first expert whose padded end lies past the tile's start (torch.searchsorted right=True)
        before = tl.sum(((ends[None, :] <= (blk * BLOCK_M)[:, None]) & ev[None, :]).to(tl.int32), axis=1)
        tl.store(expert_ptr + blk, tl.where(before < num_experts, before, -1), mask=blk < num_blocks)
    # pair (t, slot) of expert e goes after the pairs of e from earlier tokens
    dest = (ends - padded)[None, :] + (tl.cumsum(sel, 0) - sel)
    tl.debug_barrier()  # the sentinel fill is written before the pairs overwrite it
    tl.store(sorted_ptr + dest, tt[:, None] * TOP_K + slot, mask=sel != 0)


def route_align_triton(logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`kernels.moe.topk_softmax_ref` and then `kernels.moe.moe_align` in one program.

    logits [T, E] (any float dtype; unit stride along E), top_k in 1..E, block_m >= 1.
    Returns (topk_weights [T, k] fp32, topk_ids [T, k] int64, sorted_ids [P] int32,
    expert_of_block [P // block_m] int32, num_tokens_post_pad [1] int32), with P and the
    layout of `moe_align` (pairs of an expert in ascending pair id, as there). Ties among
    probabilities go to the lowest expert index. No host sync: CUDA-graph capturable.
    Raises ValueError when `fits(T, E, top_k)` is false or block_m < 1.
    """
    t, e = logits.shape
    if block_m < 1 or not fits(t, e, top_k):
        raise ValueError(f"route_align_triton: logits {tuple(logits.shape)}, top_k {top_k}, block_m {block_m}: "
                         f"want 1..{MAX_TOKENS} tokens, top_k in 1..E, E <= {moe_triton.ROUTER_MAX_EXPERTS}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n = t * top_k
    bound = n + min(e, n) * (block_m - 1)
    p = -(-bound // block_m) * block_m
    dev = logits.device
    weights = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=dev)
    sorted_ids = torch.empty((p,), dtype=torch.int32, device=dev)
    expert_of_block = torch.empty((p // block_m,), dtype=torch.int32, device=dev)
    post_pad = torch.empty((1,), dtype=torch.int32, device=dev)
    e_pow2 = triton.next_power_of_2(e)
    pdl = use_pdl(dev)
    _route_align_kernel[(1,)](logits, weights, ids, sorted_ids, expert_of_block, post_pad, t, e, logits.stride(0),
                              p, p // block_m, TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k),
                              BLOCK_T=triton.next_power_of_2(t), E_POW2=e_pow2, RENORMALIZE=renormalize,
                              BLOCK_M=block_m, CHUNK=max(16, min(128, 8192 // e_pow2)), FILL=1024, USE_PDL=pdl,
                              num_warps=4, **launch_args(pdl))
    return weights, ids, sorted_ids, expert_of_block, post_pad


@triton.jit
def _route_row(logits_row, num_experts, TOP_K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr,
               RENORMALIZE: tl.constexpr):
    # One token's routing, `_route_align_kernel`'s on one row: the fp32 softmax of its E logits,
    # k rounds of argmax (ties to the lowest index), the optional renormalisation. Returns
    # (ids [K_POW2] int32, weights [K_POW2] fp32); slots past TOP_K hold 0. A change to the
    # routing math here goes into `_route_align_kernel`'s tile form too (why not shared: there).
    ee = tl.arange(0, E_POW2)
    ev = ee < num_experts
    x = tl.load(logits_row + ee, mask=ev, other=float("-inf")).to(tl.float32)
    ex = tl.exp(x - tl.max(x, 0))
    pr = tl.where(ev, ex / tl.sum(ex, 0), -1.0)
    kk = tl.arange(0, K_POW2)
    wt = tl.zeros([K_POW2], dtype=tl.float32)
    it = tl.zeros([K_POW2], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(pr, 0)
        idx = tl.min(tl.where(pr == best, ee, E_POW2), 0)
        wt = tl.where(kk == j, best, wt)
        it = tl.where(kk == j, idx, it)
        pr = tl.where(ee == idx, -2.0, pr)
    if RENORMALIZE:
        wt = wt / tl.sum(wt, 0)
    return it, wt


@triton.jit
def _moe_gate_up_gemv_kernel(x_ptr, logits_ptr, w_ptr, act_ptr, num_experts, I, K, stride_xm, stride_lm,
                             stride_we, stride_wn, stride_am, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                             E_POW2: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    # act[t * TOP_K + j, n tile] = round(round(silu(g)) * u), g / u = round(w13[e, n] @ x[t]) /
    # round(w13[e, I + n] @ x[t]) for e = token t's j-th expert (routed here from its logits);
    # the products in fp32 along K (tiles of BLOCK_K), no tensor cores (module doc, GATE_UP)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    rn = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < I
    kk = tl.arange(0, BLOCK_K)
    pdl_wait(USE_PDL)  # the logits and x are outputs of the kernels before
    pdl_release(USE_PDL)
    ids, _ = _route_row(logits_ptr + t * stride_lm, num_experts, TOP_K, K_POW2, E_POW2, RENORMALIZE)
    e = tl.sum(tl.where(tl.arange(0, K_POW2) == j, ids, 0), 0).to(tl.int64)
    g_rows = w_ptr + e * stride_we + rn.to(tl.int64)[:, None] * stride_wn
    u_rows = g_rows + I * stride_wn
    g = tl.zeros([BLOCK_N], dtype=tl.float32)
    u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + kk
        km = rk < K
        m2 = nmask[:, None] & km[None, :]
        wg = tl.load(g_rows + rk[None, :], mask=m2, other=0.0)
        wu = tl.load(u_rows + rk[None, :], mask=m2, other=0.0)
        a = tl.load(x_ptr + t * stride_xm + rk, mask=km, other=0.0).to(tl.float32)
        g += tl.sum(wg.to(tl.float32) * a[None, :], axis=1)
        u += tl.sum(wu.to(tl.float32) * a[None, :], axis=1)
    dt = act_ptr.dtype.element_ty
    gf = g.to(dt).to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32)
    tl.store(act_ptr + (t * TOP_K + j) * stride_am + rn, (s * u.to(dt).to(tl.float32)).to(dt), mask=nmask)


@triton.jit
def _moe_down_sum_kernel(act_ptr, w_ptr, ids_ptr, tw_ptr, out_ptr, sh_ptr, g_ptr, r_ptr, logits_ptr, N, K,
                         stride_am, stride_we, stride_wn, stride_om, stride_sm, stride_gm, stride_rm, stride_lm,
                         num_experts, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         ONE_K: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_RES: tl.constexpr,
                         ROUTE: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr,
                         RENORMALIZE: tl.constexpr, USE_PDL: tl.constexpr):
    # out[t, n tile] = sum_j tw[t, j] * round(w2[ids[t, j], n tile] @ act[t * TOP_K + j]) (module doc).
    # ONE_K: BLOCK_K >= K, one weight tile an expert, the next one loaded before this one is used.
    # HAS_SHARED: out = round(out + round(round(sigmoid(g[t])) * sh[t, n tile])), a shared expert's
    # output sh [T, N] (row stride stride_sm) and gate g [T, 1] (row stride stride_gm) added as
    # kernels.hybrid_glue.shared_expert_combine_ref rounds it. HAS_RES: then out = round(out + r[t, n tile])
    # in fp32, a residual r [T, N] (row stride stride_rm) as the next layer's fused_add_rms_norm adds it.
    # ROUTE: the token's expert ids and weights from its router logits (`_route_row`; row stride
    # stride_lm) in place of ids / tw, before the wait (the logits are two launches back: GATE_UP "gemv")
    t = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    first = t * TOP_K
    kmask = kk < K
    wmask = nmask[:, None] & kmask[None, :]
    slots = tl.arange(0, K_POW2)
    if ROUTE:
        r_ids, r_w = _route_row(logits_ptr + t * stride_lm, num_experts, TOP_K, K_POW2, E_POW2, RENORMALIZE)
    if ONE_K:  # the expert ids and the weights are no output of the kernel before (module doc)
        if ROUTE:
            e0 = tl.sum(tl.where(slots == 0, r_ids, 0), 0)
        else:
            e0 = tl.load(ids_ptr + first)
        w_cur = tl.load(w_rows + e0.to(tl.int64) * stride_we + kk[None, :], mask=wmask, other=0.0)
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    dt = act_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = first + j
        if ROUTE:
            w_j = tl.sum(tl.where(slots == j, r_w, 0.0), 0)
        else:
            w_j = tl.load(tw_ptr + pair).to(tl.float32)
        if ONE_K:
            if j + 1 < TOP_K:
                if ROUTE:
                    e_nxt = tl.sum(tl.where(slots == j + 1, r_ids, 0), 0)
                else:
                    e_nxt = tl.load(ids_ptr + pair + 1)
                w_nxt = tl.load(w_rows + e_nxt.to(tl.int64) * stride_we + kk[None, :], mask=wmask, other=0.0)
            a = tl.load(act_ptr + pair * stride_am + kk, mask=kmask, other=0.0)
            y = tl.sum(w_cur.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)
            if j + 1 < TOP_K:
                w_cur = w_nxt
        else:
            if ROUTE:
                e_cur = tl.sum(tl.where(slots == j, r_ids, 0), 0)
            else:
                e_cur = tl.load(ids_ptr + pair)
            w_exp = w_rows + e_cur.to(tl.int64) * stride_we
            y = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + kk
                km = rk < K
                w = tl.load(w_exp + rk[None, :], mask=nmask[:, None] & km[None, :], other=0.0)
                a = tl.load(act_ptr + pair * stride_am + rk, mask=km, other=0.0)
                y += tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)
        acc += y.to(dt).to(tl.float32) * w_j
    o = acc.to(out_ptr.dtype.element_ty)
    if HAS_SHARED:  # both written by kernels before: read after the wait
        sh = tl.load(sh_ptr + t * stride_sm + rn, mask=nmask, other=0.0)
        s = tl.sigmoid(tl.load(g_ptr + t * stride_gm).to(tl.float32)).to(dt)
        o = (o.to(tl.float32) + (s.to(tl.float32) * sh.to(tl.float32)).to(dt).to(tl.float32)).to(dt)
    if HAS_RES:  # written by kernels before: read after the wait
        r = tl.load(r_ptr + t * stride_rm + rn, mask=nmask, other=0.0)
        o = (o.to(tl.float32) + r.to(tl.float32)).to(dt)
    tl.store(out_ptr + t * stride_om + rn, o, mask=nmask)


def down_plan(num_tokens: int, n: int, k: int, device: torch.device, tuning: dict | None = None
              ) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of `_moe_down_sum_kernel` for w2's per-expert [n, k] =
    [H, I]: BLOCK_K = next_pow2(k) up to tuning["max_block_k"] (longer rows loop over K);
    BLOCK_N from tuning["tile_elems"] / BLOCK_K (2..64), halved down to 2 until the grid
    (num_tokens x n / BLOCK_N) has tuning["programs_per_sm"] programs per SM (with USE_TUNED,
    tuning["programs_per_sm_by_tokens"][num_tokens] where given). tuning: DOWN_TUNING when
    None (the heuristic of `kernels.gemv.heuristic_plan`, swept by benchmarks/moe_decode_sweep.py)."""
    tu = DOWN_TUNING if tuning is None else tuning
    bk = min(triton.next_power_of_2(k), tu["max_block_k"])
    bn = max(2, min(64, tu["tile_elems"] // bk))
    by_tokens = tu.get("programs_per_sm_by_tokens", {}) if USE_TUNED else {}
    target = by_tokens.get(num_tokens, tu["programs_per_sm"]) * num_sms(device)
    while bn > 2 and num_tokens * triton.cdiv(n, bn) < target:
        bn //= 2
    return bn, bk, tu["num_warps"]


def moe_down_sum_triton(act: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        plan: tuple[int, int, int] | None = None,
                        shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                        residual: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * (w2[topk_ids[t, j]] @ act[t * k + j]), each
    expert's product rounded to act's dtype, the sum in fp32 rounded once (module doc).

    act [T * k, I] (row t * k + j: token t's slot j; the gate_up launch's output), w2 [E, H, I]
    of act's dtype (unit last stride), topk_weights [T, k] float, topk_ids [T, k] int32/int64
    in 0..E-1 (not checked). Returns [T, H] in act's dtype. plan: (BLOCK_N, BLOCK_K,
    num_warps), `down_plan` when None. shared: (gate [T, 1], shared_out [T, H]) of act's
    dtype, or None: a shared expert added in the epilogue, out + sigmoid(gate) * shared_out
    rounded as `kernels.hybrid_glue.shared_expert_combine_ref`. residual: [T, H] of act's
    dtype or None: added last (in fp32, rounded once more: the decoder layer's residual add,
    `services.worker.layers.moe.SparseMoeBlock.forward_fused`). No host sync. Raises
    ValueError for shapes that do not fit or a w2 whose last stride is not 1.
    """
    t, k = topk_ids.shape
    if tuple(topk_weights.shape) != (t, k):
        raise ValueError(f"moe_down_sum_triton: topk {tuple(topk_weights.shape)} / {tuple(topk_ids.shape)}")
    return _down(act, w2, t, k, (topk_ids.contiguous(), topk_weights.contiguous()), None, False, plan, shared,
                 residual)


def moe_down_routed_triton(act: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                           renormalize: bool, plan: tuple[int, int, int] | None = None,
                           shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                           residual: torch.Tensor | None = None) -> torch.Tensor:
    """`moe_down_sum_triton` with each token's experts and weights routed in the kernel from
    router_logits [T, E] (`kernels.moe.topk_softmax_ref(router_logits, top_k, renormalize)`'s
    routing, ties to the lowest index) instead of given: the down launch of GATE_UP "gemv".
    Same act / w2 / plan / shared / residual and result. Raises ValueError as there, or when
    `fits(T, E, top_k)` is false."""
    t, e = router_logits.shape
    if not fits(t, e, top_k) or e != w2.shape[0]:
        raise ValueError(f"moe_down_routed_triton: logits {tuple(router_logits.shape)}, top_k {top_k}, "
                         f"w2 {tuple(w2.shape)}")
    return _down(act, w2, t, top_k, None, router_logits if router_logits.stride(1) == 1 else
                 router_logits.contiguous(), renormalize, plan, shared, residual)


def _down(act, w2, t, k, given, logits, renormalize, plan, shared, residual) -> torch.Tensor:
    """The down launch of `moe_down_sum_triton` (given = (ids, weights)) or of
    `moe_down_routed_triton` (given None, logits [T, E]); checks the shapes (ValueError)."""
    e, h, inter = w2.shape
    if tuple(act.shape) != (t * k, inter) or w2.dtype != act.dtype or w2.stride(2) != 1:
        raise ValueError(f"moe_down_sum_triton: act {tuple(act.shape)} {act.dtype}, w2 {tuple(w2.shape)} {w2.dtype} "
                         f"strides {w2.stride()}, {t} tokens of top-{k}")
    out = torch.empty((t, h), dtype=act.dtype, device=act.device)
    if t == 0:
        return out
    if act.stride(1) != 1:
        act = act.contiguous()
    ids, tw = given if given is not None else (out, out)  # (unread with ROUTE)
    gate, sh = shared if shared is not None else (out, out)  # (unread without HAS_SHARED)
    if shared is not None:
        if tuple(gate.shape) != (t, 1) or tuple(sh.shape) != (t, h) or gate.dtype != act.dtype \
                or sh.dtype != act.dtype:
            raise ValueError(f"moe_down_sum_triton: shared gate {tuple(gate.shape)} {gate.dtype}, out "
                             f"{tuple(sh.shape)} {sh.dtype}: want [{t}, 1] and [{t}, {h}] of {act.dtype}")
        if sh.stride(1) != 1:
            sh = sh.contiguous()
    if residual is not None:
        if tuple(residual.shape) != (t, h) or residual.dtype != act.dtype:
            raise ValueError(f"moe_down_sum_triton: residual {tuple(residual.shape)} {residual.dtype}: want "
                             f"[{t}, {h}] of {act.dtype}")
        if residual.stride(1) != 1:
            residual = residual.contiguous()
    res = out if residual is None else residual  # (unread without HAS_RES)
    lg = out if logits is None else logits  # (unread without ROUTE)
    bn, bk, warps = plan or down_plan(t, h, inter, act.device)
    pdl = use_pdl(act.device)
    _moe_down_sum_kernel[(t, triton.cdiv(h, bn))](act, w2, ids, tw, out, sh, gate, res, lg, h, inter, act.stride(0),
                                                  w2.stride(0), w2.stride(1), out.stride(0), sh.stride(0),
                                                  gate.stride(0), res.stride(0), lg.stride(0), e, TOP_K=k,
                                                  BLOCK_N=bn, BLOCK_K=bk, ONE_K=bk >= inter,
                                                  HAS_SHARED=shared is not None, HAS_RES=residual is not None,
                                                  ROUTE=logits is not None, K_POW2=triton.next_power_of_2(k),
                                                  E_POW2=triton.next_power_of_2(e), RENORMALIZE=renormalize,
                                                  USE_PDL=pdl, num_warps=warps, **launch_args(pdl))
    return out


def gate_up_plan(num_tokens: int, top_k: int, inter: int, hidden: int, device: torch.device,
                 tuning: dict | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of `_moe_gate_up_gemv_kernel` for experts of width inter
    and rows of hidden: BLOCK_K = next_pow2(hidden) up to tuning["max_block_k"] (longer rows
    loop over K), BLOCK_N from tuning["tile_elems"] / (2 BLOCK_K) (1..64: gate and up rows),
    halved down to 1 until the grid (tokens x top_k x inter / BLOCK_N) has
    tuning["programs_per_sm"] programs per SM. tuning: GATE_UP_TUNING when None."""
    tu = GATE_UP_TUNING if tuning is None else tuning
    bk = min(triton.next_power_of_2(hidden), tu["max_block_k"])
    bn = max(1, min(64, tu["tile_elems"] // (2 * bk)))
    target = tu["programs_per_sm"] * num_sms(device)
    while bn > 1 and num_tokens * top_k * triton.cdiv(inter, bn) < target:
        bn //= 2
    return bn, bk, tu["num_warps"]


def moe_gate_up_gemv(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, top_k: int,
                     renormalize: bool, plan: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The gate_up launch of GATE_UP "gemv": act [T * k, I] in x's dtype, row t * k + j =
    silu(gate) * up of token t's j-th expert (routed in the kernel from router_logits as
    `kernels.moe.topk_softmax_ref` routes), rounded as `kernels.moe.fused_moe_ref` rounds
    (gate, up, silu and the product each to x's dtype).

    x [T, H], router_logits [T, E], w13 [E, 2I, H] of x's dtype with unit last strides. plan:
    (BLOCK_N, BLOCK_K, num_warps), `gate_up_plan` when None. No host sync. Raises ValueError
    when `fits(T, E, top_k)` is false or shapes and dtypes do not fit.
    """
    t, h = x.shape
    e, two_i, h2 = w13.shape
    if (h2 != h or w13.dtype != x.dtype or w13.stride(2) != 1 or tuple(router_logits.shape) != (t, e)
            or not fits(t, e, top_k)):
        raise ValueError(f"moe_gate_up_gemv: x {tuple(x.shape)} {x.dtype}, logits {tuple(router_logits.shape)}, "
                         f"w13 {tuple(w13.shape)} {w13.dtype} strides {w13.stride()}, top_k {top_k}")
    inter = two_i // 2
    act = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    if t == 0:
        return act
    if x.stride(1) != 1:
        x = x.contiguous()
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    bn, bk, warps = plan or gate_up_plan(t, top_k, inter, h, x.device)
    pdl = use_pdl(x.device)
    _moe_gate_up_gemv_kernel[(t, top_k, triton.cdiv(inter, bn))](
        x, router_logits, w13, act, e, inter, h, x.stride(0), router_logits.stride(0), w13.stride(0), w13.stride(1),
        act.stride(0), TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k), E_POW2=triton.next_power_of_2(e),
        RENORMALIZE=renormalize, BLOCK_N=bn, BLOCK_K=bk, USE_PDL=pdl, num_warps=warps, **launch_args(pdl))
    return act


def fused_moe_decode(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     top_k: int, renormalize: bool, *, config: dict[str, Any] | None = None,
                     down: tuple[int, int, int] | None = None,
                     shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE block after its router projection for a few tokens, in three launches:
    `route_align_triton`, the gate_up grouped GEMM of `kernels.moe_triton` (SiLU-and-mul
    fused, into act [T * k, I]) and `moe_down_sum_triton`. Equals
    `kernels.moe.fused_moe_ref(x, w13, w2, *kernels.moe.topk_softmax_ref(router_logits, top_k,
    renormalize))` up to summation order.

    x [T, H] fp32/fp16/bf16, router_logits [T, E] (any float dtype), w13 [E, 2I, H] and
    w2 [E, H, I] of x's dtype (unit last strides). config: the gate_up launch config
    (`moe_triton.pick_config`'s keys; None picks it as `fused_moe_triton` does); down: the
    down plan (`down_plan` when None); shared: a shared expert's (gate [T, 1], output
    [T, H]) added in the down kernel's epilogue (`moe_down_sum_triton`), or None; residual
    [T, H] or None: added after it there too. With GATE_UP "gemv" (and no config given) two
    launches instead: `moe_gate_up_gemv` and `moe_down_routed_triton`, each routing its token
    itself, for steps of up to GEMV_MAX_TOKENS tokens. Returns [T, H] in x's dtype. No host sync:
    CUDA-graph capturable. Raises ValueError when `fits(T, E, top_k)` is false or shapes
    and dtypes do not fit.
    """
    t, h = x.shape
    e = w13.shape[0]
    if (tuple(router_logits.shape) != (t, e) or w13.dtype != x.dtype or w13.shape[2] != h
            or tuple(w2.shape) != (e, h, w13.shape[1] // 2) or not fits(t, e, top_k)):
        raise ValueError(f"fused_moe_decode: x {tuple(x.shape)} {x.dtype}, logits {tuple(router_logits.shape)}, "
                         f"w13 {tuple(w13.shape)} {w13.dtype}, w2 {tuple(w2.shape)}, top_k {top_k}")
    if GATE_UP == "gemv" and config is None and t <= GEMV_MAX_TOKENS:  # two launches, the routing in both kernels
        if x.stride(1) != 1:
            x = x.contiguous()
        act = moe_gate_up_gemv(x, router_logits, w13, top_k, renormalize)
        return moe_down_routed_triton(act, w2, router_logits, top_k, renormalize, down, shared, residual)
    cfg = config or (moe_triton.pick_config(t, e, top_k, w13.shape[1], h, x.element_size()) if USE_TUNED
                     else moe_triton.default_config(t, e, top_k, x.element_size()))
    if min(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) < 16 or w13.stride(2) != 1:
        raise ValueError(f"fused_moe_decode: config {cfg} (blocks >= 16), w13 strides {w13.stride()}")
    if x.stride(1) != 1:
        x = x.contiguous()
    weights, ids, sorted_ids, expert_of_block, _ = route_align_triton(router_logits, top_k, renormalize,
                                                                      cfg["BLOCK_M"])
    inter = w2.shape[2]
    act = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    moe_triton.launch_gemm(x, w13, act, sorted_ids, expert_of_block, weights.view(-1), inter, top_k, True, cfg,
                           pdl=use_pdl(x.device))
    return moe_down_sum_triton(act, w2, weights, ids, down, shared, residual)
