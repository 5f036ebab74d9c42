"""Triton path of `kernels.moe`: one grouped GEMM kernel over expert-sorted (token, slot)
pairs, launched twice.

Input: the alignment of `kernels.moe.moe_align` (sorted_ids [P]: pair ids grouped by
expert, each group padded with the sentinel T*k to whole BLOCK_M tiles; expert_of_block
[P / BLOCK_M]: each tile's expert, -1 past the last group). The design is MegaBlocks' (Gale
et al. 2022, arXiv 2211.15841) grouped GEMM as vLLM's fused_moe kernel runs it: a program
per (M tile of sorted pairs, N tile); it reads its tile's expert (and returns at -1), gathers
its pairs' rows of A, and runs a K loop of tl.dot against that expert's weight tile with an
fp32 accumulator (fp32 operands multiply in full precision, `input_precision="ieee"`, not
TF32: the fp32 path is the GPU's debugging truth). Padding rows (the sentinel) load zeros and
store nothing.

- Launch 1 (gate_up, GATED): A = x, row of pair p = p // k (its token); the weight is
  w13[e] [2I, H]; each program owns output columns n..n+BLOCK_N of both halves, so it keeps
  two accumulators (gate rows n, up rows I + n) over the same x tiles, and its epilogue
  stores act = silu(gate) * up (rounded as `kernels.moe.fused_moe_ref` rounds: gate and up
  to x's dtype, silu to x's dtype, the product to x's dtype) into act [T*k, I], row p.
- Launch 2 (down, WEIGHTED): A = act, row p; the weight is w2[e] [H, I]; the epilogue
  rounds y to x's dtype, multiplies by topk_weights[p] in fp32 and stores [T*k, H] fp32
  partials (`FP32_PARTIALS`; x's dtype when False, half the memory, one more rounding).
Then out = the sum over k of the partials, cast to x's dtype, in one launch (`_sum_k_kernel`;
torch's sum and cast were two, 4.8 us of a batch-1 Qwen3-30B-A3B layer on the H200).

Program order: a 1-D grid with the grouped ordering of the Triton matmul tutorial (GROUP_M
M tiles walk the N tiles together), so that tiles of one expert and one set of rows are
resident in L2 together.

Launch configs: `pick_config(T, E, k, N, K, dtype_bytes)` -> {BLOCK_M, BLOCK_N, BLOCK_K,
GROUP_M, num_warps, num_stages}, one config for both launches (they share the alignment,
hence BLOCK_M). It looks up `TUNED_CONFIGS[(m_bucket(T), N, K)]` (N = 2I and K = H: w13's
per-expert [N, K] shape; bf16/fp16 only) and falls back to `default_config`.
TUNED_CONFIGS holds what benchmarks/moe_tune.py measured on the device and wrote to
kernels/moe_configs/ (it sweeps the configs for a model's (N, K) at each of M_BUCKETS, timing
the whole `fused_moe_triton`, since the launches share BLOCK_M); a shape without a file
takes the default.
tl.dot needs BLOCK_M, BLOCK_N and BLOCK_K >= 16.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_args, pdl_release, pdl_wait

# (m_bucket, N, K) -> config dict (keys of `default_config`), from the JSON files that
# benchmarks/moe_tune.py writes into kernels/moe_configs/ (read once, at import)
TUNED_CONFIGS: dict[tuple[int, int, int], dict[str, Any]] = {}
CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_configs")


def load_tuned_configs(folder: str = CONFIG_DIR) -> dict[tuple[int, int, int], dict[str, Any]]:
    """The tuned launch configs of every `*.json` in `folder`: each file is {"N": 2I, "K": H,
    "device": ..., "configs": {"<m_bucket>": {BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
    num_warps, num_stages}, ...}} (benchmarks/moe_tune.py). A missing folder gives {};
    a malformed file raises ValueError naming it."""
    out: dict[tuple[int, int, int], dict[str, Any]] = {}
    if not os.path.isdir(folder):
        return out
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(folder, name)
        try:
            with open(path) as fh:
                data = json.load(fh)
            for bucket, cfg in data["configs"].items():
                out[(int(bucket), int(data["N"]), int(data["K"]))] = dict(cfg)
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"tuned MoE config {path}: {e}") from None
    return out


TUNED_CONFIGS.update(load_tuned_configs())
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
FP32_PARTIALS = True  # the down launch's weighted outputs in fp32 (False: x's dtype)


def m_bucket(num_tokens: int) -> int:
    """The smallest of M_BUCKETS >= num_tokens (the largest for more tokens)."""
    for b in M_BUCKETS:
        if num_tokens <= b:
            return b
    return M_BUCKETS[-1]


def default_config(num_tokens: int, num_experts: int, top_k: int, dtype_bytes: int = 2) -> dict[str, Any]:
    """The untuned launch config, by the mean pairs per expert (T*k/E): at decode sizes
    (<= 16, most experts hold one pair or none) a 16-row tile and a long K tile (the time
    is the weight read); 32-row tiles up to 64 pairs an expert; 64 x 128 tiles above.
    dtype_bytes 4 (fp32) takes 2 pipeline stages in place of 3, to keep the gated launch's
    buffers (an A tile and two weight tiles a stage) within the H200's 227 KB of shared
    memory a block. Keys: BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    stages = 2 if dtype_bytes > 2 else 3
    if per_expert <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": stages}
    if per_expert <= 64:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4, "num_warps": 4, "num_stages": stages}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": stages}


def pick_config(num_tokens: int, num_experts: int, top_k: int, n: int, k: int,
                dtype_bytes: int = 2) -> dict[str, Any]:
    """The launch config of `kernels.moe.fused_moe_triton` for T = num_tokens tokens and
    w13's per-expert shape [n, k] = [2I, H]: TUNED_CONFIGS[(m_bucket(T), n, k)] for 2-byte
    dtypes (the tuned ones), else `default_config` (fp32, a debugging path on the GPU,
    always takes the default)."""
    tuned = TUNED_CONFIGS.get((m_bucket(num_tokens), n, k)) if dtype_bytes <= 2 else None
    return tuned or default_config(num_tokens, num_experts, top_k, dtype_bytes)


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ptr, expert_ptr, tw_ptr, num_pairs, num_m_blocks, N, K,
                     stride_am, stride_we, stride_wn, stride_om, up_offset,
                     A_DIV: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    # out[p, n] for the pairs p of one M tile: A [rows, K] (row p // A_DIV), W [E, *, K]
    # (row n of expert e at e * stride_we + n * stride_wn; with GATED the up row n at
    # + up_offset), out [num_pairs, N]. Grid: num_m_blocks * cdiv(N, BLOCK_N) programs.
    # USE_PDL (the decode path of kernels.moe_decode_triton only): launched with PDL, waits
    # for the router kernel before reading the tile's expert, then lets the down kernel start
    pdl_wait(USE_PDL)
    pdl_release(USE_PDL)
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n_blocks
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    expert = tl.load(expert_ptr + pid_m)
    if expert < 0:  # a tile past the last expert's group
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    mvalid = pairs < num_pairs
    rows = tl.where(mvalid, pairs // A_DIV, 0).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    a_rows = a_ptr + rows[:, None] * stride_am
    # [BLOCK_K, BLOCK_N] tiles of W^T: element (k, n) at n * stride_wn + k
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        a = tl.load(a_rows + rk[None, :], mask=mvalid[:, None] & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & nmask[None, :]
        w = tl.load(w_cols + rk[:, None], mask=wmask, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if GATED:
            wu = tl.load(w_cols + up_offset + rk[:, None], mask=wmask, other=0.0)
            acc_up = tl.dot(a, wu, acc_up, input_precision=PRECISION)
    dt = a_ptr.dtype.element_ty
    if GATED:  # as fused_moe_ref: gate and up rounded, silu rounded, the product rounded
        g = acc.to(dt).to(tl.float32)
        u = acc_up.to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        res = s * u
    else:
        res = acc.to(dt).to(tl.float32)
    if WEIGHTED:
        res = res * tl.load(tw_ptr + pairs, mask=mvalid, other=0.0).to(tl.float32)[:, None]
    optrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(optrs, res.to(out_ptr.dtype.element_ty), mask=mvalid[:, None] & nmask[None, :])


ROUTER_TRITON = True  # topk_softmax on CUDA through `topk_softmax_triton` (False: torch ops; an A/B switch)
ROUTER_MAX_EXPERTS = 1024  # one row of logits a program


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_row,
                         TOP_K: tl.constexpr, E_POW2: tl.constexpr, RENORMALIZE: tl.constexpr):
    # One token a program: softmax in fp32 over its E logits, then TOP_K rounds of argmax
    # (the chosen expert masked out after each), then the optional renormalisation.
    row = tl.program_id(0)
    experts = tl.arange(0, E_POW2)
    live = experts < num_experts
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + experts, mask=live, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, 0))
    p = tl.where(live, e / tl.sum(e, 0), -1.0)
    total = 0.0
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, experts, E_POW2), 0)  # the lowest index among ties
        tl.store(weights_ptr + row * TOP_K + j, best)
        tl.store(ids_ptr + row * TOP_K + j, idx.to(tl.int64))
        total += best
        p = tl.where(experts == idx, -2.0, p)
    if RENORMALIZE:
        for j in tl.static_range(TOP_K):
            w = tl.load(weights_ptr + row * TOP_K + j)
            tl.store(weights_ptr + row * TOP_K + j, w / total)


def topk_softmax_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`services.worker.layers.moe.topk_softmax` (same arguments, outputs and dtypes:
    weights [T, k] fp32, ids [T, k] int64) in one launch, a program a token: the torch
    version's softmax, topk and renormalisation are four launches, each a few microseconds
    of a batch-1 decode layer. Ties go to the lowest expert index (torch.topk's order is
    not specified). Raises ValueError for more than ROUTER_MAX_EXPERTS experts or a top_k
    outside 1..E."""
    t, num_experts = logits.shape
    if num_experts > ROUTER_MAX_EXPERTS or not 1 <= top_k <= num_experts:
        raise ValueError(f"topk_softmax_triton: {num_experts} experts (at most {ROUTER_MAX_EXPERTS}), top_k {top_k}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t:
        _topk_softmax_kernel[(t,)](logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
                                   E_POW2=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize,
                                   num_warps=4 if num_experts >= 256 else 1)
    return weights, ids


ALIGN_MAX_PAIRS = 16384  # `moe_align_triton` takes up to this many (token, slot) pairs (one program)


@triton.jit(do_not_specialize=["n", "num_experts", "p", "num_blocks"])
def _moe_align_kernel(ids_ptr, sorted_ptr, expert_ptr, post_pad_ptr, cursor_ptr, n, num_experts, p, num_blocks,
                      BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr):
    # One program does the whole alignment (module doc of kernels.moe, `moe_align`):
    # counts per expert by comparison, padded ends by a cumsum, the sentinel fill, each
    # tile's expert, then (after a block barrier) one atomic cursor per expert scatters the
    # pair ids. cursor_ptr: [num_experts] int32 scratch, written here before it is used.
    experts = tl.arange(0, E_POW2)
    live = experts < num_experts
    counts = tl.zeros([E_POW2], dtype=tl.int32)
    for start in range(0, n, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < n, other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + experts, ends - padded, mask=live)
    tl.store(post_pad_ptr, tl.sum(padded, 0))
    for start in range(0, p, FILL):
        offs = start + tl.arange(0, FILL)
        tl.store(sorted_ptr + offs, tl.zeros([FILL], dtype=tl.int32) + n, mask=offs < p)
    for start in range(0, num_blocks, CHUNK):
        blk = start + tl.arange(0, CHUNK)
        # the first expert whose padded end lies past the tile's start (as torch.searchsorted right=True)
        before = tl.sum(((ends[None, :] <= (blk * BLOCK_M)[:, None]) & live[None, :]).to(tl.int32), axis=1)
        tl.store(expert_ptr + blk, tl.where(before < num_experts, before, -1), mask=blk < num_blocks)
    tl.debug_barrier()  # the cursors and the sentinel fill are written before the scatter
    for start in range(0, n, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        m = offs < n
        e = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int32)
        dest = tl.atomic_add(cursor_ptr + e, tl.full([CHUNK], 1, tl.int32), mask=m)
        tl.store(sorted_ptr + dest, offs.to(tl.int32), mask=m)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int,
                     block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`kernels.moe.moe_align` (same arguments, outputs, bound P and sentinel) in one Triton
    program, for T*k <= ALIGN_MAX_PAIRS pairs: the torch version's fifteen-odd launches cost
    ~40 us in a CUDA graph, the weight read of a batch-1 Qwen3-30B-A3B layer ~18 us. The
    only difference: within an expert's group the pairs come in the order of the atomic
    cursor, not ascending (each pair's output row is computed independently, so the results
    do not depend on it). No host sync: CUDA-graph capturable. Raises ValueError as
    `moe_align`, and for more pairs than ALIGN_MAX_PAIRS."""
    if block_m < 1 or num_experts < 1 or topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe_align_triton: topk_ids {tuple(topk_ids.shape)} {topk_ids.dtype}, "
                         f"num_experts {num_experts}, block_m {block_m}")
    n = topk_ids.numel()
    if n > ALIGN_MAX_PAIRS:
        raise ValueError(f"moe_align_triton: {n} pairs, more than ALIGN_MAX_PAIRS={ALIGN_MAX_PAIRS}")
    bound = n + min(num_experts, n) * (block_m - 1)
    p = -(-bound // block_m) * block_m
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    if ids.stride(0) != 1:
        ids = ids.contiguous()
    sorted_ids = torch.empty((p,), dtype=torch.int32, device=dev)
    expert_of_block = torch.empty((p // block_m,), dtype=torch.int32, device=dev)
    post_pad = torch.empty((1,), dtype=torch.int32, device=dev)
    cursor = torch.empty((num_experts,), dtype=torch.int32, device=dev)
    e_pow2 = triton.next_power_of_2(num_experts)
    chunk = max(16, min(128, 8192 // e_pow2))  # a [chunk, E] compare tile stays small
    _moe_align_kernel[(1,)](ids, sorted_ids, expert_of_block, post_pad, cursor, n, num_experts, p,
                            p // block_m, BLOCK_M=block_m, E_POW2=e_pow2, CHUNK=chunk, FILL=1024, num_warps=4)
    return sorted_ids, expert_of_block, post_pad


def launch_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                expert_of_block: torch.Tensor, tw: torch.Tensor, n: int, a_div: int, gated: bool,
                cfg: dict[str, Any], pdl: bool = False) -> None:
    """One grouped GEMM launch (module doc) writing out [T*k, n]: A = a (row of pair p:
    p // a_div), the weight w [E, *, K], gated (gate_up, SiLU-and-mul) or weighted by tw
    [T*k] (down). pdl: launch with programmatic dependent launch (`kernels.pdl`; the
    decode path, `kernels.moe_decode_triton`); the prefill path launches without."""
    num_m_blocks = sorted_ids.shape[0] // cfg["BLOCK_M"]
    grid = (num_m_blocks * triton.cdiv(n, cfg["BLOCK_N"]),)
    _moe_gemm_kernel[grid](
        a, w, out, sorted_ids, expert_of_block, tw, out.shape[0], num_m_blocks, n, w.shape[2],
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), n * w.stride(1) if gated else 0,
        A_DIV=a_div, GATED=gated, WEIGHTED=not gated, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        USE_PDL=pdl, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_args(pdl))


def fused_moe_aligned(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      sorted_ids: torch.Tensor, expert_of_block: torch.Tensor, top_k: int,
                      cfg: dict[str, Any]) -> torch.Tensor:
    """The two launches and the sum over k (module doc) for T >= 1 tokens.

    x [T, H], w13 [E, 2I, H], w2 [E, H, I] (one float dtype; w13 and w2 with unit last
    stride), topk_weights [T, top_k] float, sorted_ids / expert_of_block from
    `kernels.moe.moe_align(topk_ids, E, cfg["BLOCK_M"])`, cfg a `pick_config` dict.
    Returns [T, H] in x's dtype. Shapes are not checked here (`kernels.moe` does).
    Raises ValueError for a block size under 16 (tl.dot's minimum) or weights whose last
    stride is not 1.
    """
    if min(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) < 16 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError(f"fused_moe_triton: config {cfg} (blocks >= 16), w13 strides {w13.stride()}, "
                         f"w2 strides {w2.stride()} (unit last stride)")
    if x.stride(1) != 1:
        x = x.contiguous()
    t, h = x.shape
    inter = w2.shape[2]
    pairs = t * top_k
    tw = topk_weights.reshape(-1)
    if tw.stride(0) != 1:
        tw = tw.contiguous()
    act = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    launch_gemm(x, w13, act, sorted_ids, expert_of_block, tw, inter, top_k, True, cfg)
    part = torch.empty((pairs, h), dtype=torch.float32 if FP32_PARTIALS else x.dtype, device=x.device)
    launch_gemm(act, w2, part, sorted_ids, expert_of_block, tw, h, 1, False, cfg)
    if top_k == 1:
        return part.to(x.dtype)
    if not SUM_K_TRITON:
        return part.view(t, top_k, h).sum(1).to(x.dtype)
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    block_h = min(1024, triton.next_power_of_2(h))
    _sum_k_kernel[(t, triton.cdiv(h, block_h))](part, out, h, TOP_K=top_k, BLOCK_H=block_h, num_warps=4)
    return out


SUM_K_TRITON = True  # the sum over k and the cast in one launch (False: torch's sum, then .to; the A/B baseline)


@triton.jit
def _sum_k_kernel(part_ptr, out_ptr, h, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    # out[t, n] = sum_j part[t * TOP_K + j, n] in fp32 (j ascending), stored in out's dtype
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < h
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(part_ptr + (t * TOP_K + j) * h + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * h + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
