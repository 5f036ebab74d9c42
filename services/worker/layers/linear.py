"""Linear layers whose weight may be stacked from several checkpoint tensors.

Fusing q/k/v (and gate/up) into one matmul saves kernel launches and, on the CPU, the Python
overhead of separate calls. The checkpoint keeps them apart, so a stacked weight records
the row sizes of its shards and the loader copies each checkpoint tensor into its rows.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.linear import linear


class Linear(nn.Module):
    """y = x @ W.T (+ b).

    in_features: columns of W. out_features: rows of W, or a list of shard row counts whose
    sum is the rows (shard i fills rows sum(sizes[:i]) .. sum(sizes[:i+1])-1).
    Parameters are created uninitialised (torch.empty, in the default dtype and device):
    the loader fills them. Stacked parameters carry `shard_sizes` for the loader.
    x: [num_tokens, in_features] -> [num_tokens, sum(out_features)].
    forward's keyword arguments fuse a step before or after the matmul (see
    `kernels.linear.linear`): norm_weight / eps an RMSNorm of x, silu_mul a SiLU-and-mul of
    x [num_tokens, 2 * in_features], residual [num_tokens, out] an add to the output.
    """

    def __init__(self, in_features: int, out_features: int | list[int], bias: bool = False):
        super().__init__()
        stacked = isinstance(out_features, (list, tuple))
        sizes: list[int] = list(out_features) if isinstance(out_features, (list, tuple)) else [out_features]
        weight = torch.empty(sum(sizes), in_features)
        if weight.device.type == "cpu":  # born in the CPU gemm layout (to_cpu_gemm_layout):
            # the loader copies into it once, instead of a copy and a re-laid second copy
            weight = torch.empty(in_features, sum(sizes)).t()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(sizes)), requires_grad=False) if bias else None
        if stacked:
            for p in (self.weight, self.bias):
                if p is not None:
                    setattr(p, "shard_sizes", sizes)  # noqa: B010 (an attribute torch's stubs do not know)

    def forward(self, x: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                silu_mul: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
        if norm_weight is None and residual is None and not silu_mul:
            return linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul,
                      residual=residual)

    def process_weights_after_loading(self) -> None:
        """On the CPU, store W column-major (W.t() contiguous), same shape and values."""
        to_cpu_gemm_layout(self.weight)


def to_cpu_gemm_layout(weight: torch.Tensor) -> None:
    """Re-lay a CPU [out, in] weight in place so that W.t() is contiguous.

    F.linear then hands MKL a plain [in, out] operand instead of a transposed one; for the
    few-row matmuls of decode that kernel is faster (SmolLM2-135M fp32 on 2 cores: batch-8
    decode step 62 -> 52 ms, batch 1 unchanged). GPU weights keep the row-major layout.
    """
    if weight.device.type == "cpu" and not weight.t().is_contiguous():
        weight.data = weight.data.t().contiguous().t()


def shard_rows(param: torch.Tensor, shard: int | None) -> torch.Tensor:
    """The view of `param` that checkpoint shard `shard` fills (None = the whole tensor).

    Raises IndexError for a shard the parameter does not have.
    """
    sizes = getattr(param, "shard_sizes", None)
    if shard is None or sizes is None:
        return param.data
    if not 0 <= shard < len(sizes):
        raise IndexError(f"shard {shard} out of {len(sizes)}")
    return param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
