"""Mixture-of-experts MLP: a top-k router and the experts' SwiGLU MLPs in stacked weights,
run by one fused kernel call (`kernels.moe.fused_moe`: the torch reference on the CPU, a
grouped GEMM over expert-sorted tokens in Triton on the GPU; docs/ARCHITECTURE.md §6.3).

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

from kernels.moe import fused_moe
from services.worker.layers.linear import Linear

try:  # the GPU router kernel; absent without triton (CPU-only installs)
    from kernels import moe_triton as _moe_triton
except ImportError:  # pragma: no cover
    _moe_triton = None  # type: ignore[assignment]

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


class FusedMoE(nn.Module):
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


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: probabilities softmax(logits) in fp32 over all E experts, the
    k largest, renormalised to sum 1 when `renormalize` (config `norm_topk_prob`).
    logits [T, E] any float dtype -> (topk_weights [T, k] fp32, topk_ids [T, k] int64).
    Ties go to torch.topk's order. CUDA logits take one Triton launch
    (`kernels.moe_triton.topk_softmax_triton`, the lowest index among ties) when Triton
    imports and `ROUTER_TRITON` is on."""
    if logits.is_cuda and _moe_triton is not None and _moe_triton.ROUTER_TRITON \
            and logits.shape[-1] <= _moe_triton.ROUTER_MAX_EXPERTS:
        return _moe_triton.topk_softmax_triton(logits, top_k, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoeBlock(nn.Module):
    """A decoder layer's MoE MLP: the router's projection `gate` (a Linear [E, H], no
    bias), softmax top-k routing (`topk_softmax`) and the experts (`FusedMoE`); the
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
        weights, ids = topk_softmax(self.gate(x), self.top_k, self.norm_topk_prob)
        return self.experts(x, weights, ids)
