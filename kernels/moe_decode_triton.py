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
def _moe_down_sum_kernel(act_ptr, w_ptr, ids_ptr, tw_ptr, out_ptr, sh_ptr, g_ptr, N, K, stride_am, stride_we,
                         stride_wn, stride_om, stride_sm, stride_gm, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, ONE_K: tl.constexpr, HAS_SHARED: tl.constexpr,
                         USE_PDL: tl.constexpr):
    # out[t, n tile] = sum_j tw[t, j] * round(w2[ids[t, j], n tile] @ act[t * TOP_K + j]) (module doc).
    # ONE_K: BLOCK_K >= K, one weight tile an expert, the next one loaded before this one is used.
    # HAS_SHARED: out = round(out + round(round(sigmoid(g[t])) * sh[t, n tile])), a shared expert's
    # output sh [T, N] (row stride stride_sm) and gate g [T, 1] (row stride stride_gm) added as
    # kernels.hybrid_glue.shared_expert_combine_ref rounds it
    t = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    kk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    first = t * TOP_K
    kmask = kk < K
    wmask = nmask[:, None] & kmask[None, :]
    if ONE_K:  # the expert ids and the weights are no output of the kernel before (module doc)
        w_cur = tl.load(w_rows + tl.load(ids_ptr + first).to(tl.int64) * stride_we + kk[None, :], mask=wmask,
                        other=0.0)
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    dt = act_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = first + j
        if ONE_K:
            if j + 1 < TOP_K:
                w_nxt = tl.load(w_rows + tl.load(ids_ptr + pair + 1).to(tl.int64) * stride_we + kk[None, :],
                                mask=wmask, other=0.0)
            a = tl.load(act_ptr + pair * stride_am + kk, mask=kmask, other=0.0)
            y = tl.sum(w_cur.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)
            if j + 1 < TOP_K:
                w_cur = w_nxt
        else:
            w_exp = w_rows + tl.load(ids_ptr + pair).to(tl.int64) * stride_we
            y = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + kk
                km = rk < K
                w = tl.load(w_exp + rk[None, :], mask=nmask[:, None] & km[None, :], other=0.0)
                a = tl.load(act_ptr + pair * stride_am + rk, mask=km, other=0.0)
                y += tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)
        acc += y.to(dt).to(tl.float32) * tl.load(tw_ptr + pair).to(tl.float32)
    o = acc.to(out_ptr.dtype.element_ty)
    if HAS_SHARED:  # both written by kernels before: read after the wait
        sh = tl.load(sh_ptr + t * stride_sm + rn, mask=nmask, other=0.0)
        s = tl.sigmoid(tl.load(g_ptr + t * stride_gm).to(tl.float32)).to(dt)
        o = (o.to(tl.float32) + (s.to(tl.float32) * sh.to(tl.float32)).to(dt).to(tl.float32)).to(dt)
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
                        shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * (w2[topk_ids[t, j]] @ act[t * k + j]), each
    expert's product rounded to act's dtype, the sum in fp32 rounded once (module doc).

    act [T * k, I] (row t * k + j: token t's slot j; the gate_up launch's output), w2 [E, H, I]
    of act's dtype (unit last stride), topk_weights [T, k] float, topk_ids [T, k] int32/int64
    in 0..E-1 (not checked). Returns [T, H] in act's dtype. plan: (BLOCK_N, BLOCK_K,
    num_warps), `down_plan` when None. shared: (gate [T, 1], shared_out [T, H]) of act's
    dtype, or None: a shared expert added in the epilogue, out + sigmoid(gate) * shared_out
    rounded as `kernels.hybrid_glue.shared_expert_combine_ref`. No host sync. Raises
    ValueError for shapes that do not fit or a w2 whose last stride is not 1.
    """
    t, k = topk_ids.shape
    e, h, inter = w2.shape
    if (tuple(act.shape) != (t * k, inter) or tuple(topk_weights.shape) != (t, k) or w2.dtype != act.dtype
            or w2.stride(2) != 1):
        raise ValueError(f"moe_down_sum_triton: act {tuple(act.shape)} {act.dtype}, w2 {tuple(w2.shape)} {w2.dtype} "
                         f"strides {w2.stride()}, topk {tuple(topk_weights.shape)} / {tuple(topk_ids.shape)}")
    out = torch.empty((t, h), dtype=act.dtype, device=act.device)
    if t == 0:
        return out
    if act.stride(1) != 1:
        act = act.contiguous()
    tw, ids = topk_weights.contiguous(), topk_ids.contiguous()
    gate, sh = shared if shared is not None else (out, out)  # (unread without HAS_SHARED)
    if shared is not None:
        if tuple(gate.shape) != (t, 1) or tuple(sh.shape) != (t, h) or gate.dtype != act.dtype \
                or sh.dtype != act.dtype:
            raise ValueError(f"moe_down_sum_triton: shared gate {tuple(gate.shape)} {gate.dtype}, out "
                             f"{tuple(sh.shape)} {sh.dtype}: want [{t}, 1] and [{t}, {h}] of {act.dtype}")
        if sh.stride(1) != 1:
            sh = sh.contiguous()
    bn, bk, warps = plan or down_plan(t, h, inter, act.device)
    pdl = use_pdl(act.device)
    _moe_down_sum_kernel[(t, triton.cdiv(h, bn))](act, w2, ids, tw, out, sh, gate, h, inter, act.stride(0),
                                                  w2.stride(0), w2.stride(1), out.stride(0), sh.stride(0),
                                                  gate.stride(0), TOP_K=k, BLOCK_N=bn, BLOCK_K=bk,
                                                  ONE_K=bk >= inter, HAS_SHARED=shared is not None, USE_PDL=pdl,
                                                  num_warps=warps, **launch_args(pdl))
    return out


def fused_moe_decode(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     top_k: int, renormalize: bool, *, config: dict[str, Any] | None = None,
                     down: tuple[int, int, int] | None = None,
                     shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The MoE block after its router projection for a few tokens, in three launches:
    `route_align_triton`, the gate_up grouped GEMM of `kernels.moe_triton` (SiLU-and-mul
    fused, into act [T * k, I]) and `moe_down_sum_triton`. Equals
    `kernels.moe.fused_moe_ref(x, w13, w2, *kernels.moe.topk_softmax_ref(router_logits, top_k,
    renormalize))` up to summation order.

    x [T, H] fp32/fp16/bf16, router_logits [T, E] (any float dtype), w13 [E, 2I, H] and
    w2 [E, H, I] of x's dtype (unit last strides). config: the gate_up launch config
    (`moe_triton.pick_config`'s keys; None picks it as `fused_moe_triton` does); down: the
    down plan (`down_plan` when None); shared: a shared expert's (gate [T, 1], output
    [T, H]) added in the down kernel's epilogue (`moe_down_sum_triton`), or None. Returns
    [T, H] in x's dtype. No host sync:
    CUDA-graph capturable. Raises ValueError when `fits(T, E, top_k)` is false or shapes
    and dtypes do not fit.
    """
    t, h = x.shape
    e = w13.shape[0]
    if (tuple(router_logits.shape) != (t, e) or w13.dtype != x.dtype or w13.shape[2] != h
            or tuple(w2.shape) != (e, h, w13.shape[1] // 2) or not fits(t, e, top_k)):
        raise ValueError(f"fused_moe_decode: x {tuple(x.shape)} {x.dtype}, logits {tuple(router_logits.shape)}, "
                         f"w13 {tuple(w13.shape)} {w13.dtype}, w2 {tuple(w2.shape)}, top_k {top_k}")
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
    return moe_down_sum_triton(act, w2, weights, ids, down, shared)
