"""The pure-torch truth of the linear layer with its fused steps: y = prologue(x) @ W.T + b
(+ residual). Both CUDA kernels follow it op by op: the skinny kernel (`kernels.linear`) and
the one-row kernel (`kernels.gemv`), which also runs it for degenerate shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul_ref
from kernels.norm import rms_norm_ref


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               norm_weight: torch.Tensor | None = None, eps: float = 1e-6, silu_mul: bool = False,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """y = prologue(x) @ weight.T + bias (+ residual), in torch.

    weight: [N, K]; bias: [N] or None; one dtype for all tensors (fp32/bf16/fp16/fp64).
    x: [M, K], or [M, 2K] = cat(gate, up) with silu_mul.
    prologue: rms_norm_ref(x, norm_weight [K], eps) with norm_weight; silu_and_mul_ref(x)
    with silu_mul; x itself otherwise (not both: see `linear`).
    residual: [M, N] or None, added to the matmul output after that is rounded to the dtype
    (the add in fp32 for half dtypes, rounded: torch's half add).
    Returns [M, N] in x's dtype.
    """
    if norm_weight is not None:
        x = rms_norm_ref(x, norm_weight, eps)
    if silu_mul:
        x = silu_and_mul_ref(x)
    y = F.linear(x, weight, bias)
    return y if residual is None else y + residual
