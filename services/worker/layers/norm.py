"""RMSNorm layer (optionally fused with the residual add); math in `kernels.norm`."""

from __future__ import annotations

import torch
from torch import nn

from kernels.norm import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """RMSNorm with weight [hidden] (uninitialised until loaded).

    forward(x) -> rms_norm(x); forward(x, residual) -> (rms_norm(x + residual), x + residual).
    x, residual: [num_tokens, hidden].
    """

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
