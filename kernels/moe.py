"""Fused mixture-of-experts MLP: each token's top-k SwiGLU experts, weighted and summed.

out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),
e = topk_ids[t, j] (the MoE block of Mixtral / Qwen3-MoE after the router's top-k; the
router, its softmax and any renormalisation of the weights are the caller's).

The algorithm is a grouped GEMM over expert-sorted tokens, the layout of MegaBlocks (Gale
et al. 2022, arXiv 2211.15841: "block-sparse" expert computation without token dropping)
and of vLLM's fused_moe Triton kernel: the T*k (token, slot) pairs are grouped by expert and
each expert's group is padded to a multiple of the GEMM's M tile (`moe_align`), so that
every M tile of the sorted list belongs to one expert and one launch covers all experts.
The Triton path (`kernels/moe_triton.py`) runs two such launches: gate_up with SiLU-and-mul
in its epilogue, then down with the routing weight in its epilogue, then a sum over k.
A decode step of a few tokens takes `kernels/moe_decode_triton.py` instead (`moe_block`):
the router's top-k and the alignment in one program, gate_up, and a down projection that
sums each token's k experts itself.

- `fused_moe`: the dispatcher. CUDA tensors with Triton importable take `fused_moe_triton`;
  everything else (CPU tensors always) takes `fused_moe_ref`.
- `fused_moe_ref`: the torch truth and the CPU serving path: one pair of matmuls per expert
  that has tokens (a host sync to find them), fp32 accumulation of the weighted outputs.
- `moe_align`: the alignment, in torch ops with shapes fixed by (T, k, E, block_m) and no
  host sync (CUDA-graph capturable).
- `fused_moe_triton`: the Triton path on any device Triton runs on (the interpreter checks
  call it on CPU tensors); None when Triton does not import.
- `topk_softmax` / `topk_softmax_ref`: the router's softmax top-k (dispatcher, torch truth).
- `moe_block`: router top-k and experts from the router logits; CUDA steps of up to
  `moe_decode_triton.MAX_TOKENS` tokens take the three-launch decode path when
  `DECODE_FUSED` is on (the default), everything else `topk_softmax` then `fused_moe`.

Rounding (both paths): gate_up and the down projection's output are rounded to x's dtype
as a torch matmul in that dtype rounds them, silu(gate) and its product with up likewise;
the weighted sum over the k experts is fp32, rounded to x's dtype once at the end. The two
paths differ by summation order only (matmul K order, and the order of the k terms).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kernels.hybrid_glue import shared_expert_combine

try:  # the grouped-GEMM kernels; absent without triton (CPU-only installs)
    from kernels import moe_decode_triton as _moe_decode
    from kernels import moe_triton as _moe_triton
except ImportError:  # pragma: no cover
    _moe_triton = None  # type: ignore[assignment]
    _moe_decode = None  # type: ignore[assignment]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# a CUDA step of at most moe_decode_triton.MAX_TOKENS tokens runs the MoE block in three launches
# (router top-k + alignment, gate_up, down with the sum over k); False: the router launch, then
# `fused_moe` (alignment, gate_up, down, sum over k). On: measured faster at batch 1 on the H200
# (benchmarks/decode_latency.py --ab old moe; docs/ARCHITECTURE.md §6.4)
DECODE_FUSED = True
# a shared expert given to `moe_block` is added in the decode path's down kernel (its epilogue,
# one launch fewer); False: by `kernels.hybrid_glue.shared_expert_combine` after the block
SHARED_IN_DOWN = True


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor) -> None:
    """Raise ValueError unless the shapes and dtypes are those of `fused_moe_ref` (shapes
    only: the values of topk_ids are not read, which would need a host sync)."""
    ok = (x.dim() == 2 and w13.dim() == 3 and w2.dim() == 3 and x.dtype in _FLOATS
          and w13.dtype == x.dtype and w2.dtype == x.dtype)
    if ok:
        t, h = x.shape
        e, two_i, h13 = w13.shape
        ok = (two_i % 2 == 0 and h13 == h and tuple(w2.shape) == (e, h, two_i // 2)
              and topk_ids.dim() == 2 and topk_ids.shape[0] == t
              and tuple(topk_weights.shape) == tuple(topk_ids.shape)
              and topk_ids.dtype in (torch.int32, torch.int64) and topk_weights.is_floating_point())
    if not ok:
        raise ValueError(f"fused_moe: x {tuple(x.shape)} {x.dtype}, w13 {tuple(w13.shape)} {w13.dtype}, "
                         f"w2 {tuple(w2.shape)} {w2.dtype}, topk_weights {tuple(topk_weights.shape)} "
                         f"{topk_weights.dtype}, topk_ids {tuple(topk_ids.shape)} {topk_ids.dtype}: want "
                         "x [T, H], w13 [E, 2I, H] and w2 [E, H, I] of one float dtype, topk_weights "
                         "[T, k] float, topk_ids [T, k] int32/int64")


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The MoE MLP in torch (module doc), one gate_up and one down matmul per expert that
    has tokens.

    x: [T, H] fp32/fp16/bf16. w13: [E, 2I, H], x's dtype; rows 0..I-1 of an expert are the
    gate projection, I..2I-1 the up projection. w2: [E, H, I], x's dtype.
    topk_weights: [T, k] fp32 (another float dtype is upcast). topk_ids: [T, k] int32/int64,
    values in 0..E-1 (not checked: an id out of range raises IndexError or, on CUDA, a
    device-side assert). Returns [T, H] in x's dtype; [0, H] for T = 0.

    Per expert e with pairs: x_e = its tokens' rows of x, gate_up = x_e @ w13[e].T,
    act = silu(gate) * up, y = act @ w2[e].T (all in x's dtype), then
    out += weight * y in an fp32 [T, H] buffer (index_add_), cast at the end. Finding the
    experts with pairs is a host sync (one `.tolist()`); a CUDA tensor works, slowly.
    Raises ValueError for shapes or dtypes that do not fit (`_check`).
    """
    _check(x, w13, w2, topk_weights, topk_ids)
    t, h = x.shape
    k = topk_ids.shape[1]
    if t == 0 or k == 0:
        return x.new_zeros((t, h))
    flat = topk_ids.reshape(-1).long()
    sorted_e, order = torch.sort(flat, stable=True)  # pairs grouped by expert, ascending pair id
    experts, counts = torch.unique_consecutive(sorted_e, return_counts=True)
    tokens = order // k
    weights = topk_weights.reshape(-1).float()[order]
    out = torch.zeros((t, h), dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    start = 0
    for e, c in zip(experts.tolist(), counts.tolist()):
        tok = tokens[start:start + c]
        gate_up = F.linear(x[tok], w13[e])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(act, w2[e])
        out.index_add_(0, tok, y.float().mul_(weights[start:start + c, None]))
        start += c
    return out.to(x.dtype)


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs by expert, each expert's group padded to whole M tiles.

    topk_ids: [T, k] int32/int64, values in 0..num_experts-1 (not checked). Pair p = t * k + j
    is topk_ids[t, j]'s (the row-major flat index). block_m: the GEMM's M tile, >= 1.
    Returns, all int32 on topk_ids's device:
    - sorted_ids [P]: expert 0's pairs in ascending order, padded with the sentinel T*k up to
      a multiple of block_m, then expert 1's, ...; experts without pairs take no room; the
      tail past the last group is all sentinel;
    - expert_of_block [P // block_m]: the expert of each block_m tile of sorted_ids, -1 for
      the tiles past the last group (the kernels skip them);
    - num_tokens_post_pad [1]: the padded length, sum over experts of
      ceil(count / block_m) * block_m (a multiple of block_m).
    P = round_up(T*k + min(E, T*k) * (block_m - 1), block_m): at most min(E, T*k) experts
    have pairs and each pads fewer than block_m, so P bounds the padded length while
    depending on the shapes only. Nothing here reads a value on the host (no .item(), no
    data-dependent shape), so the op runs inside CUDA-graph capture. The layout is that of
    vLLM's moe_align_block_size (its sentinel, its bound with E in place of min(E, T*k)).
    Raises ValueError for block_m < 1, num_experts < 1 or a topk_ids that is not 2-D int.
    """
    if block_m < 1 or num_experts < 1 or topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe_align: topk_ids {tuple(topk_ids.shape)} {topk_ids.dtype}, "
                         f"num_experts {num_experts}, block_m {block_m}")
    dev = topk_ids.device
    n = topk_ids.numel()
    bound = n + min(num_experts, n) * (block_m - 1)
    p = -(-bound // block_m) * block_m
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    sorted_e, order = torch.sort(flat, stable=True)
    # the rank of a sorted pair within its expert is its position minus the pairs of lower experts
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    dest = (padded_end - padded)[sorted_e] + rank
    sorted_ids = torch.full((p,), n, dtype=torch.int32, device=dev).scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, p, block_m, device=dev)
    # the first expert whose padded end lies past the block's start (empty experts end where
    # they start, so they are never picked); num_experts past the last group
    expert = torch.searchsorted(padded_end, block_start, right=True, out_int32=True)
    expert_of_block = torch.where(expert < num_experts, expert, -1)
    return sorted_ids, expert_of_block, padded_end[-1:].to(torch.int32)


def _fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, *, config: dict[str, Any] | None = None) -> torch.Tensor:
    """`fused_moe_ref` (same arguments, shapes and rounding) by the grouped-GEMM Triton
    kernels of `kernels/moe_triton.py`: the alignment at the config's BLOCK_M
    (`moe_triton.moe_align_triton` up to ALIGN_MAX_PAIRS pairs, else `moe_align`), the gate_up
    launch with SiLU-and-mul fused, the down launch with the routing weight fused (fp32
    [T*k, H] partials, `moe_triton.FP32_PARTIALS`), a sum over k. All tensors on one device.

    config: the launch config (`moe_triton.pick_config`'s keys); None picks it from
    `moe_triton.TUNED_CONFIGS` or the default. The last dim of w13 and w2 must have unit
    stride (x is copied when its last stride is not 1). No host sync: CUDA-graph capturable.
    Raises ValueError as `fused_moe_ref`.
    """
    assert _moe_triton is not None
    _check(x, w13, w2, topk_weights, topk_ids)
    t, h = x.shape
    num_experts = w13.shape[0]
    k = topk_ids.shape[1]
    if t == 0 or k == 0:
        return x.new_zeros((t, h))
    cfg = config or _moe_triton.pick_config(t, num_experts, k, w13.shape[1], h, x.element_size())
    if topk_ids.numel() <= _moe_triton.ALIGN_MAX_PAIRS:  # one program (decode, short prefills)
        sorted_ids, expert_of_block, _ = _moe_triton.moe_align_triton(topk_ids, num_experts, cfg["BLOCK_M"])
    else:
        sorted_ids, expert_of_block, _ = moe_align(topk_ids, num_experts, cfg["BLOCK_M"])
    return _moe_triton.fused_moe_aligned(x, w13, w2, topk_weights, sorted_ids, expert_of_block, k, cfg)


fused_moe_triton: Callable[..., torch.Tensor] | None = None if _moe_triton is None else _fused_moe_triton


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """Dispatcher for `fused_moe_ref` (see there for shapes, dtypes and errors): the Triton
    path (`fused_moe_triton`) for CUDA x when Triton imports, the reference otherwise."""
    if x.is_cuda and fused_moe_triton is not None:
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)


def topk_softmax_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing in torch: probabilities softmax(logits) in fp32 over all E
    experts, the k largest, renormalised to sum 1 when `renormalize` (config
    `norm_topk_prob`). logits [T, E] any float dtype -> (topk_weights [T, k] fp32,
    topk_ids [T, k] int64). Ties go to torch.topk's order. Source: the Qwen3-MoE router of
    Hugging Face's `modeling_qwen3_moe.py`."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher of `topk_softmax_ref` (same arguments and outputs): CUDA logits take one
    Triton launch (`moe_triton.topk_softmax_triton`, the lowest index among ties) when
    Triton imports, `moe_triton.ROUTER_TRITON` is on and E <= ROUTER_MAX_EXPERTS."""
    if logits.is_cuda and _moe_triton is not None and _moe_triton.ROUTER_TRITON \
            and logits.shape[-1] <= _moe_triton.ROUTER_MAX_EXPERTS:
        return _moe_triton.topk_softmax_triton(logits, top_k, renormalize)
    return topk_softmax_ref(logits, top_k, renormalize)


def moe_block(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE MLP from the router's logits: `fused_moe(x, w13, w2, *topk_softmax(router_logits,
    top_k, renormalize))`. x [T, H], router_logits [T, E], w13 / w2 as `fused_moe_ref`.
    Returns [T, H] in x's dtype. CUDA x of a few tokens (`moe_decode_triton.fits`) with
    `DECODE_FUSED` on takes `moe_decode_triton.fused_moe_decode` (three launches, no host
    sync); the result differs from the other path's by summation order only.
    shared: a shared expert's (gate [T, 1], output [T, H]) in x's dtype, or None: the block
    then returns out + sigmoid(gate) * output (`kernels.hybrid_glue.shared_expert_combine_ref`'s
    rounding), added in the decode path's down kernel with `SHARED_IN_DOWN`, else by
    `shared_expert_combine` after it.
    residual: [T, H] in x's dtype, or None: the block then returns residual + that (in fp32,
    rounded once more, as the decoder layer's residual add; in the decode path's down kernel,
    else one add after it).
    Raises ValueError for shapes or dtypes that do not fit."""
    if (x.is_cuda and DECODE_FUSED and _moe_decode is not None and x.dim() == 2
            and _moe_decode.fits(x.shape[0], w13.shape[0], top_k)):
        fold = shared if SHARED_IN_DOWN else None
        if shared is None or fold is not None:
            return _moe_decode.fused_moe_decode(x, router_logits, w13, w2, top_k, renormalize, shared=fold,
                                                residual=residual)
        out = _moe_decode.fused_moe_decode(x, router_logits, w13, w2, top_k, renormalize)
        return _add_residual(shared_expert_combine(out, *shared), residual)
    weights, ids = topk_softmax(router_logits, top_k, renormalize)
    out = fused_moe(x, w13, w2, weights, ids)
    return _add_residual(out if shared is None else shared_expert_combine(out, *shared), residual)


def _add_residual(out: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """out + residual ([T, H] each, one dtype) rounded once to that dtype, the value
    `kernels.norm.fused_add_rms_norm_ref` adds (fp32 sum, rounded once); out itself when
    residual is None. Raises ValueError when residual's shape or dtype differs from out's."""
    if residual is None:
        return out
    if residual.shape != out.shape or residual.dtype != out.dtype:
        raise ValueError(f"moe_block: residual {tuple(residual.shape)} {residual.dtype}, want "
                         f"{tuple(out.shape)} {out.dtype}")
    # Equal to (out.float() + residual.float()).to(out.dtype) bit for bit: the fp32 sum is not
    # always exact (65504 + 2**-24 in fp16), but fp32's 24-bit significand is >= 2p + 2 for
    # fp16 (p = 11) and bf16 (p = 8), so rounding to fp32 and then to the dtype gives the
    # correctly rounded sum (Figueroa 1995, double rounding innocuous), which is what the
    # dtype's own add returns (torch adds fp16/bf16 in fp32 and rounds once). fp32 inputs:
    # the same op. Checked on every fp16 and bf16 pair.
    return out + residual
