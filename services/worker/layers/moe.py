"""Mixture-of-experts MLP: a top-k router and the experts' SwiGLU MLPs in stacked weights,
run by one fused kernel call (`kernels.moe.moe_block`: the torch reference on the CPU, a
grouped GEMM over expert-sorted tokens in Triton on the GPU, three launches in all for a
decode step of a few tokens; docs/ARCHITECTURE.md §6.3, §6.4).

Source: Shazeer et al. 2017 (sparsely-gated MoE, arXiv 1701.06538) for the top-k router;
the Qwen3-MoE router as Hugging Face's `modeling_qwen3_moe.py` defines it (softmax over
all experts in fp32, top-k, optional renormalisation of the k weights: `norm_topk_prob`).

Weights: `w13_weight` [E, 2 * I, H] (per expert, the gate projection's I rows then the up
projection's), `w2_weight` [E, H, I]. Checkpoints store one tensor per expert and
projection (`mlp.experts.<e>.gate_proj.weight` ...): the loader fills one expert's shard
through `expert_shard` (the parameters carry `num_experts` and `shard_sizes`, see
`services.worker.loader`).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.moe import fused_moe, moe_block, topk_softmax
from services.worker.layers.linear import Linear
from services.worker.layers.module import Module
from services.worker.layers.norm import RMSNorm

__all__ = ["EXPERT_PARAMS", "FusedMoE", "SparseMoeBlock", "expert_shard", "topk_softmax"]

# checkpoint projection name inside `experts.<e>.` -> (our parameter, shard of its rows)
EXPERT_PARAMS: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1), "down_proj": ("w2_weight", None),
}


def expert_shard(param: torch.Tensor, expert: int, shard: int | None) -> torch.Tensor:
    """The view of a stacked expert parameter ([E, rows, cols]) that one checkpoint tensor
    fills: expert `expert`'s rows of shard `shard` (None = all its rows). Raises IndexError
    for an expert or shard the parameter does not have."""
    num = getattr(param, "num_experts", None)
    if num is None or not 0 <= expert < num:
        raise IndexError(f"expert {expert} out of {num}")
    rows = param.data[expert]
    sizes = getattr(param, "shard_sizes", None)
    if shard is None or sizes is None:
        return rows
    if not 0 <= shard < len(sizes):
        raise IndexError(f"shard {shard} out of {len(sizes)}")
    return rows.narrow(0, sum(sizes[:shard]), sizes[shard])


def _stacked(num_experts: int, rows: int, cols: int, shard_sizes: list[int] | None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(num_experts, rows, cols), requires_grad=False)
    p.num_experts = num_experts  # type: ignore[attr-defined]
    if shard_sizes is not None:
        p.shard_sizes = shard_sizes  # type: ignore[attr-defined]
    return p


class FusedMoE(Module):
    """The experts of one MoE layer. forward(x [T, H], topk_weights [T, k] fp32,
    topk_ids [T, k] int64) -> [T, H] in x's dtype: sum over j of topk_weights[t, j] times
    expert topk_ids[t, j]'s down(silu(gate(x)) * up(x)). Build under the target device and
    default dtype (the weights take it)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.w13_weight = _stacked(num_experts, 2 * intermediate_size, hidden_size,
                                   [intermediate_size, intermediate_size])
        self.w2_weight = _stacked(num_experts, hidden_size, intermediate_size, None)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)

    def routed(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool,
               shared: tuple[torch.Tensor, torch.Tensor] | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """forward with the routing done here: the softmax top-k of router_logits [T, E]
        (`kernels.moe.topk_softmax`), renormalised when `renormalize`, then the experts; on
        CUDA a few tokens take the three-launch decode path (`kernels.moe.moe_block`).
        shared: a shared expert's (gate [T, 1], output [T, H]) to add as out + sigmoid(gate) *
        output (in the decode path's down kernel, `kernels.moe.SHARED_IN_DOWN`), or None.
        residual: [T, H] or None, added to the result last (`kernels.moe.moe_block`)."""
        return moe_block(x, router_logits, self.w13_weight, self.w2_weight, top_k, renormalize, shared, residual)


class SparseMoeBlock(Module):
    """A decoder layer's MoE MLP: the router's projection `gate` (a Linear [E, H], no
    bias), softmax top-k routing (`kernels.moe.topk_softmax`) and the experts (`FusedMoE`); the
    parameter names are the Qwen3-MoE checkpoints' (`mlp.gate.weight`, `mlp.experts.<e>.*`
    into `mlp.experts.w13_weight` / `w2_weight`). forward(x [T, H]) -> [T, H].
    Raises ValueError when top_k is not in 1..num_experts."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 norm_topk_prob: bool):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..num_experts ({num_experts})")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = Linear(hidden_size, num_experts, False, quantizable=False)  # the router stays in the model dtype
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.routed(x, self.gate(x), self.top_k, self.norm_topk_prob)

    def forward_fused(self, h: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """h + moe(norm(h)) for the residual stream h [T, H] (the fused layer path,
        `services.worker.fusion`), with no norm or add launch of its own: the router's
        projection normalises h in its prologue and stores the normalised rows it used
        (`kernels.linear.linear`'s xn_out) for the experts, and the decode path's down kernel
        adds h (`kernels.moe.moe_block`'s residual). norm: the layer's RMSNorm (its
        `prologue_weight` and eps)."""
        xn = torch.empty_like(h)
        logits = self.gate(h, norm_weight=norm.prologue_weight, eps=norm.eps, xn_out=xn)
        return self.experts.routed(xn, logits, self.top_k, self.norm_topk_prob, residual=h)
